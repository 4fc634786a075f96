"""The generic tool-call format, for chat templates that have no tool format of their own (as
llama.cpp's server falls back to one): the tools are described in a system-prompt section, and
the model's reply is one JSON object, either

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]}
or
    {"response": "It is sunny in Paris."}

(with a JSON `response_format` the response is the JSON value itself). Constrained decoding
keeps every reply in this shape (inference.structured.grammar), laid out as `json.dumps`
writes it; the history renders past calls, results and answers the same way, so a
conversation reads to the model as it wrote it.

`GenericReader` reads such a reply a piece at a time for the tool-call parser
(inference.text.tool_calls): a response string is decoded and streamed as content as it
arrives, a call is emitted once its object is complete. Output that does not open with either
key is content, byte for byte; so is output that stops following the format before anything
of it was sent (a call of a function not offered, say); after that (only possible without the
grammar) the rest is content.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .json_scanner import COMPLETE, INVALID, PARTIAL, WS_RUN, JsonObjectScanner, run_end

GENERIC = "generic"
CALLS_KEY = "tool_calls"
RESPONSE_KEY = "response"
CALLS_END = "]}"  # what closes a reply of calls


def _dumps(value: Any) -> str:
    """JSON as the grammar lays it out (json.dumps' separators; text unescaped)."""
    return json.dumps(value, ensure_ascii=False)


# -- the prompt ------------------------------------------------------------------------------


def tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system-prompt section that offers `tools` (OpenAI tool objects): one function per
    line as a signature with its description, then how to reply. The same for every
    tool_choice, so a conversation's prompt does not change with it (the grammar enforces
    the choice and the arguments' schemas, so the model reads names and types, not schemas:
    Open WebUI's 36 built-in tools take 2,637 tokens so, 6,585 as JSON schemas)."""
    lines = [
        "You can call these tools:",
        *(signature(_function(tool)) for tool in tools),
        "",
        'Answer in JSON, with either "tool_calls" (the tools to call and their arguments) or '
        '"response" (your reply to the user).',
    ]
    return "\n".join(lines)


def signature(function: Mapping[str, Any]) -> str:
    """`name(arg: type, other: type (optional)): description`, types as Python writes them
    (`str`, `int`, `list[str]`, a literal's values, `{key: type}` for an object)."""
    parameters = function.get("parameters")
    parameters = parameters if isinstance(parameters, Mapping) else {}
    properties = parameters.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = parameters.get("required")
    required = set(required) if isinstance(required, list) else set()
    arguments = []
    for name, schema in properties.items():
        argument = f"{name}: {_type(schema)}"
        if name not in required:
            default = schema.get("default") if isinstance(schema, Mapping) else None
            argument += f" = {_dumps(default)}" if default is not None else " (optional)"
        arguments.append(argument)
    description = " ".join(str(function.get("description") or "").split())
    head = f"{function.get('name')}({', '.join(arguments)})"
    return f"{head}: {description}" if description else head


_PYTHON_TYPES = {
    "string": "str",
    "integer": "int",
    "number": "float",
    "boolean": "bool",
    "object": "dict",
    "array": "list",
    "null": "None",
}


def _type(schema: Any, depth: int = 0) -> str:
    """A JSON schema's type as a Python annotation (nested objects two levels deep)."""
    if not isinstance(schema, Mapping):
        return "Any"
    if "enum" in schema and isinstance(schema["enum"], list):
        return " | ".join(_dumps(v) for v in schema["enum"])
    if "const" in schema:
        return _dumps(schema["const"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return " | ".join(_type(s, depth) for s in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_PYTHON_TYPES.get(str(k), str(k)) for k in kind)
    if kind == "array":
        return f"list[{_type(schema.get('items'), depth)}]" if "items" in schema else "list"
    properties = schema.get("properties")
    if kind in ("object", None) and isinstance(properties, Mapping) and properties and depth < 2:
        inner = ", ".join(f"{k}: {_type(v, depth + 1)}" for k, v in properties.items())
        return "{" + inner + "}"
    return _PYTHON_TYPES.get(str(kind), "Any") if kind is not None else "Any"


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function", tool)
    return function if isinstance(function, Mapping) else tool


def calls_text(calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant's OpenAI tool calls as the model writes them in this format. Arguments
    given as JSON text are embedded as the object they hold."""
    entries = []
    for call in calls:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError, RecursionError):
                arguments = json.loads(arguments)
        entries.append({"name": function.get("name"), "arguments": arguments})
    return _dumps({CALLS_KEY: entries})


def response_text(content: str) -> str:
    """A plain answer as the model writes it in this format."""
    return _dumps({RESPONSE_KEY: content})


def tool_result_text(name: str | None, content: str) -> str:
    """A tool's result as the next prompt shows it: the function's name (when known) and its
    output, embedded as JSON when it is a JSON object or array."""
    output: Any = content
    stripped = content.strip()
    if stripped[:1] in ("{", "["):
        try:
            output = json.loads(stripped)
        except (ValueError, RecursionError):
            output = content
    result: dict[str, Any] = {"name": name} if name is not None else {}
    result["content"] = output
    return _dumps({"tool_response": result})


# -- reading a reply ---------------------------------------------------------------------------


class Sink(Protocol):
    """Where the reader's findings go (the tool-call parser)."""

    def on_content(self, out: list[Any], text: str) -> None: ...

    def on_call(self, out: list[Any], json_text: str, span: tuple[int, int]) -> bool:
        """A complete call object (span: where it and its joiner lie in the whole output);
        False if it is not a valid call."""
        ...


_KEY_RE = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"([a-z_]*)("?)[ \t\n\r]*(:?)[ \t\n\r]*')
_BEFORE_KEY = re.compile(r"[ \t\n\r]*(?:\{[ \t\n\r]*)?")  # what may still open a reply
_KEYS = (CALLS_KEY, RESPONSE_KEY)
_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r"}
_SIMPLE_ESCAPES["t"] = "\t"
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")


class GenericReader:
    """One reply in the generic format, read a piece at a time (see the module docstring)."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._buffer = ""  # received, not yet decided
        self._offset = 0  # where buffer[0] lies in the whole output
        # Markup taken since content or a call was last sent (the opening, joiners): content
        # after all if the output stops following the format.
        self._unsent = ""
        # start | string | value | calls | tail | done | raw
        self._mode = "start"
        self._scanner: JsonObjectScanner | None = None
        self._num_emitted = 0  # of a response value: characters of the buffer sent
        self._after_call = False  # in the calls: a call was read, a `,` or `]` is due
        self._call_from = 0  # where the next call's span starts (its `,` included)
        self._num_calls = 0  # calls read
        # Where an unfinished call (its joiner included) or escape begins in the whole output,
        # when the output ended in one: cut from there, the reply closes (`closing`).
        self.unfinished_from: int | None = None

    @property
    def closing(self) -> str:
        """What closes the reply once `unfinished_from` is cut (ToolCallStreamParser.closing):
        `"}` in a response's string, `]}` in the calls, else ""."""
        return {"string": '"}', "calls": CALLS_END}.get(self._mode, "")

    def push(self, out: list[Any], text: str, final: bool) -> None:
        self._buffer += text
        while self._step(out, final):
            pass
        if final and self._buffer:  # what no step took: an unfinished call or escape
            self.unfinished_from = self._call_from if self._mode == "calls" else self._offset
            self._take(len(self._buffer))

    def _take(self, n: int, *, sent: bool = False) -> None:
        """buffer[:n] is decided: `sent` as content or a call, else markup held unsent."""
        self._unsent = "" if sent else self._unsent + self._buffer[:n]
        self._buffer = self._buffer[n:]
        self._offset += n

    def _raw(self, out: list[Any]) -> bool:
        """The rest of the output is content, as written (the markup held unsent too)."""
        self._mode = "raw"
        self._sink.on_content(out, self._unsent + self._buffer)
        self._take(len(self._buffer), sent=True)
        return False

    def _step(self, out: list[Any], final: bool) -> bool:
        """Decides what the buffer allows; True if it should be called again."""
        mode, buf = self._mode, self._buffer
        if mode == "raw":
            return self._raw(out)
        if mode == "start":
            return self._opening(out, final)
        if mode == "string":
            return self._string(out)
        if mode == "value":
            return self._value(out, final)
        i = run_end(WS_RUN, buf)
        if i == len(buf):
            self._take(i)
            return False
        if mode == "calls":
            return self._calls(out, i)
        if mode == "tail" and buf[i] == "}":
            self._mode = "done"
            self._take(i + 1)
            return True
        return self._raw(out)  # text after the object, or not a closing brace

    def _opening(self, out: list[Any], final: bool) -> bool:
        """`{"tool_calls": [` or `{"response": ` followed by the value's first character."""
        buf = self._buffer
        match = _KEY_RE.match(buf)
        if match is None:
            could_open = _BEFORE_KEY.fullmatch(buf) is not None
            return False if could_open and not final else self._raw(out)
        key, quoted, colon = match.groups()
        end = match.end()
        if not (colon and end < len(buf)):
            could_be = key in _KEYS if quoted else any(k.startswith(key) for k in _KEYS)
            return False if could_be and end == len(buf) and not final else self._raw(out)
        if key not in _KEYS:
            return self._raw(out)
        first = buf[end]
        if key == CALLS_KEY:
            if first != "[":
                return self._raw(out)
            self._take(end + 1)
            self._mode, self._call_from = "calls", self._offset
        elif first == '"':
            self._take(end + 1)
            self._mode = "string"
        else:  # a value is sent as it comes, so its opening is never content (streams that
            # send some of it before it goes astray give what the whole text gives)
            self._take(end, sent=True)
            self._mode, self._num_emitted = "value", 0
            self._scanner = JsonObjectScanner(0, any_value=True)
        return True

    def _string(self, out: list[Any]) -> bool:
        """The response string, decoded; an escape cut by the piece's end waits for more."""
        buf, i, pieces = self._buffer, 0, []
        while i < len(buf):
            end = run_end(_PLAIN_RUN, buf, i)
            pieces.append(buf[i:end])
            i = end
            if i == len(buf):
                break
            if buf[i] == '"':
                self._send_text(out, pieces, i)
                self._take(1)
                self._mode = "tail"
                return True
            decoded = _escape(buf, i) if buf[i] == "\\" else None  # else a control character
            if decoded is None:  # not JSON
                self._send_text(out, pieces, i)
                return self._raw(out)
            if isinstance(decoded, str):  # cut short: wait for the rest
                break
            text, i = decoded
            pieces.append(text)
        self._send_text(out, pieces, i)
        return False

    def _send_text(self, out: list[Any], pieces: list[str], end: int) -> None:
        """The decoded text of buffer[:end] sent (the markup before it stays unsent until
        some text is)."""
        text = "".join(pieces)
        if text:
            self._sink.on_content(out, text)
        self._take(end, sent=bool(text))

    def _value(self, out: list[Any], final: bool) -> bool:
        """A JSON response value (a response_format's), streamed as written."""
        scanner = self._scanner
        assert scanner is not None
        buf = self._buffer
        scanner.advance(buf)
        if scanner.status == INVALID:  # the rest is content, the value's start among it
            self._take(self._num_emitted, sent=self._num_emitted > 0)
            return self._raw(out)
        end = scanner.end if scanner.status == COMPLETE else len(buf)
        if end > self._num_emitted:
            self._sink.on_content(out, buf[self._num_emitted : end])
            self._unsent = ""
        self._num_emitted = end
        if scanner.status == COMPLETE:
            self._take(end, sent=True)
            self._mode, self._scanner = "tail", None
            return True
        if final:
            self._take(len(buf), sent=True)
        return False

    def _calls(self, out: list[Any], i: int) -> bool:
        """In the calls' array, at its next non-space character buf[i]."""
        buf, char = self._buffer, self._buffer[i]
        if self._after_call:
            if char == ",":
                self._call_from = self._offset + i
                self._take(i + 1)
                self._after_call = False
                return True
            if char == "]":
                self._take(i + 1)
                self._mode = "tail"
                return True
            return self._raw(out)
        if char == "]" and self._num_calls == 0:
            self._take(i + 1)  # no calls at all
            self._mode = "tail"
            return True
        if char != "{":
            return self._raw(out)
        if self._scanner is None:
            self._scanner = JsonObjectScanner(i)
        scanner = self._scanner
        scanner.advance(buf)
        if scanner.status == PARTIAL:
            return False
        self._scanner = None
        span = (self._call_from, self._offset + scanner.end)
        if scanner.status == INVALID or not self._sink.on_call(
            out, buf[scanner.start : scanner.end], span
        ):
            return self._raw(out)
        self._take(scanner.end, sent=True)
        self._after_call = True
        self._num_calls += 1
        return True


def _escape(text: str, i: int) -> tuple[str, int] | str | None:
    """The escape at text[i] (a backslash): (its text, the index after it); "" when the text
    ends inside it; None when JSON does not allow it (a lone surrogate among them, which no
    reply could carry)."""
    if i + 1 >= len(text):
        return ""
    char = text[i + 1]
    if char in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[char], i + 2
    if char != "u":
        return None
    code = _hex4(text, i + 2)
    if not isinstance(code, int):
        return code
    if 0xDC00 <= code <= 0xDFFF:
        return None
    if not 0xD800 <= code <= 0xDBFF:
        return chr(code), i + 6
    if i + 8 > len(text):
        return "" if "\\u".startswith(text[i + 6 : i + 8]) else None
    if text[i + 6 : i + 8] != "\\u":
        return None
    low = _hex4(text, i + 8)
    if not isinstance(low, int):
        return low
    if not 0xDC00 <= low <= 0xDFFF:
        return None
    return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), i + 12


def _hex4(text: str, i: int) -> int | str | None:
    digits = text[i : i + 4]
    if _HEX4.fullmatch(digits):
        return int(digits, 16)
    if len(digits) < 4 and _HEX4.fullmatch(digits + "0" * (4 - len(digits))):
        return ""  # cut short
    return None
