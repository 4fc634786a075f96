"""Tool calls in model output: parsed whole, or streamed as deltas while the text arrives.

Three formats, the first two named as vLLM names its parsers:

- ``hermes`` (Hermes, Qwen2/2.5, our ChatML default): any number of
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among ordinary text.
- ``llama3_json`` (Llama 3.1/3.2): the whole output is one ``{"name": ..., "parameters": {...}}``
  object, optionally after ``<|python_tag|>``, or several joined by ``;`` (Llama 3.2).
  All or nothing: if any part is not a valid call, the whole output is content.
- ``generic`` (any template without a tool format of its own): the whole output is one JSON
  object, ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` or
  ``{"response": "..."}``, whose response is streamed as content as it is decoded
  (inference.text.generic_tool_calls).

A block is a call only if it is a JSON object with a non-empty string ``name`` (one of
``tool_names`` when given) and object arguments (``arguments`` or ``parameters``; missing means
``{}``); anything else that only looks like a call stays content, byte for byte. Arguments
are re-serialized compactly, so the same call always reads the same.

The whole-text parser is the stream parser fed everything at once, so a stream split anywhere
reassembles to exactly the whole-text result (the tests check every split). The stream holds
back only text that could still become a call: a trailing tag prefix (``<tool``), an open
``<tool_call>`` block until it closes (a JSON scanner tells as soon as it cannot be a call), a
Llama reply that starts with ``{`` until the output ends, and leading whitespace (content that is
only whitespace is None). A call is emitted once it is certain: a first delta with the id and
name (arguments ""), then one delta with the arguments. A call that repeats an earlier one of
the same output is dropped, and `dropped_spans` says where it lay in the text, so the caller
can take it out of the reply's token ids too.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection
from dataclasses import dataclass

from .generic_tool_calls import CALLS_END, GENERIC, GenericReader
from .json_scanner import (
    COMPLETE,
    INVALID,
    PARTIAL,
    WS_RUN,
    JsonObjectScanner,
    finite_float,
    run_end,
)

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
TOOL_CALL_FORMATS = (HERMES, LLAMA3_JSON, GENERIC)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# Where a call's arguments are looked up, in order.
_ARGUMENT_KEYS = {
    HERMES: ("arguments", "parameters"),
    LLAMA3_JSON: ("parameters", "arguments"),
    GENERIC: ("arguments",),
}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text (the OpenAI shape)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text outside calls; None if empty or whitespace only
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position among this output's calls
    id: str | None  # first delta of a call only
    name: str | None  # first delta of a call only
    arguments: str  # a fragment; a call's fragments concatenate to its arguments


StreamEvent = ContentDelta | ToolCallDelta


def new_tool_call_id() -> str:
    return "call_" + secrets.token_urlsafe(18)  # 18 bytes -> 24 url-safe characters


def detect_tool_call_format(template_source: str) -> str | None:
    """The format a chat template teaches its model to write calls in; None if unknown.

    `<tool_call>` in the template -> hermes; Llama 3.1/3.2 markers (`<|python_tag|>`, the
    `ipython` role, or the `"parameters"` response format) -> llama3_json.
    """
    if _OPEN in template_source:
        return HERMES
    if _PYTHON_TAG in template_source or "ipython" in template_source:
        return LLAMA3_JSON
    if '"parameters"' in template_source and "<|start_header_id|>" in template_source:
        return LLAMA3_JSON
    return None


def parse_tool_calls(
    text: str, fmt: str, tool_names: Collection[str] | None = None
) -> ParsedOutput:
    """The calls and the remaining content of a whole model output."""
    parser = ToolCallStreamParser(fmt, tool_names)
    parser.push(text)
    parser.finish()
    return parser.result()


def call_key(name: str, arguments: str) -> tuple[str, str]:
    """What makes two calls the same: the name and the arguments (a JSON object's text),
    their keys in any order."""
    return name, json.dumps(json.loads(arguments), sort_keys=True)


class ToolCallStreamParser:
    """Turns model output text, in pieces split anywhere, into content and tool-call deltas.

    `answered`: calls (call_key) the output must not make again, as if it had made them
    already (the calls the conversation's last turn made, whose results the model has)."""

    def __init__(
        self,
        fmt: str,
        tool_names: Collection[str] | None = None,
        answered: Collection[tuple[str, str]] = (),
    ) -> None:
        if fmt not in TOOL_CALL_FORMATS:
            raise ValueError(
                f"unknown tool-call format {fmt!r}; expected one of {', '.join(TOOL_CALL_FORMATS)}"
            )
        self.fmt = fmt
        self._tool_names = frozenset(tool_names) if tool_names is not None else None
        self._buffer = ""  # received, not yet emitted (always the end of what was received)
        self._num_received = 0  # characters pushed
        self._is_finished = False
        # Content that is only whitespace so far is held: it may stay that way (then None).
        self._held_space = ""
        self._has_content = False
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._made: set[tuple[str, str]] = set(answered)  # call_key of the calls made
        # Where dropped repeats lay in the whole output: [start, end) character offsets.
        self.dropped_spans: list[tuple[int, int]] = []
        # hermes: outside a block, inside one (buffer = text after <tool_call>), or inside
        # one known to be content whose end (the first </tool_call>) is not yet seen.
        self._mode = "start" if fmt == LLAMA3_JSON else "outside"
        self._scanner: JsonObjectScanner | None = None
        self._close_search_from = 0
        self._num_emitted = 0
        # llama3_json: calls found so far (with their spans: a call's `;` is its own), the
        # position after them, and whether a `;` follows.
        self._pending: list[tuple[str, str, tuple[int, int]]] = []
        self._position = 0
        self._call_from = 0
        self._after_semicolon = False
        self._generic = GenericReader(self) if fmt == GENERIC else None

    def push(self, text_delta: str) -> list[StreamEvent]:
        if self._is_finished:
            raise RuntimeError("push() after finish()")
        self._num_received += len(text_delta)
        if self._generic is not None:
            out: list[StreamEvent] = []
            self._generic.push(out, text_delta, final=False)
            return _merged(out)
        self._buffer += text_delta
        return self._advance(final=False)

    def finish(self) -> list[StreamEvent]:
        """End of output: everything still held is decided (an open block is content)."""
        if self._is_finished:
            raise RuntimeError("finish() called twice")
        if self._generic is not None:
            out: list[StreamEvent] = []
            self._generic.push(out, "", final=True)
            events = _merged(out)
        else:
            events = self._advance(final=True)
        self._is_finished = True
        return events

    @property
    def closing(self) -> str:
        """What closes the output if it ends here, once `unfinished_from` is cut: in the
        generic format `"}` inside a response's string and `]}` inside the calls (the other
        formats' calls close themselves); "" when it is whole."""
        return self._generic.closing if self._generic is not None else ""

    @property
    def awaits_first_call(self) -> bool:
        """Whether the output so far opens the generic format's calls and holds no whole one
        (so nothing of it was sent)."""
        return self._generic is not None and self._generic.closing == CALLS_END and not self._calls

    @property
    def unfinished_from(self) -> int | None:
        """Where the unfinished call or escape the output ended in begins (the generic
        format's; the others' unfinished markup is content)."""
        return self._generic.unfinished_from if self._generic is not None else None

    def result(self) -> ParsedOutput:
        """Everything emitted so far, assembled (the same ids as the deltas)."""
        content = "".join(self._content)
        return ParsedOutput(content or None, list(self._calls))

    # -- emitting ----------------------------------------------------------------------------

    def _advance(self, final: bool) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self.fmt == HERMES:
            self._advance_hermes(out, final)
        else:
            self._advance_llama3(out, final)
        return _merged(out)

    def _at(self, index: int) -> int:
        """Where buffer[index] lies in the whole output."""
        return self._num_received - len(self._buffer) + index

    # The generic reader's sink (inference.text.generic_tool_calls.Sink).

    def on_content(self, out: list[StreamEvent], text: str) -> None:
        self._emit_content(out, text)

    def on_call(self, out: list[StreamEvent], json_text: str, span: tuple[int, int]) -> bool:
        call = self._as_call(json_text)
        if call is None:
            return False
        self._emit_call(out, *call, span)
        return True

    def _emit_content(self, out: list[StreamEvent], text: str) -> None:
        if not text:
            return
        if not self._has_content:
            if not text.strip():
                self._held_space += text
                return
            text, self._held_space, self._has_content = self._held_space + text, "", True
        self._content.append(text)
        out.append(ContentDelta(text))

    def _emit_call(
        self, out: list[StreamEvent], name: str, arguments: str, span: tuple[int, int]
    ) -> None:
        """A complete call, unless the output already made the same one (same name and
        arguments, keys in any order): a client would run the tool twice. Small models under
        a grammar that allows several calls repeat the first one. `span`: where the call
        lies in the whole output."""
        same = call_key(name, arguments)
        if same in self._made:
            self.dropped_spans.append(span)
            return
        self._made.add(same)
        call = ToolCall(new_tool_call_id(), name, arguments)
        index = len(self._calls)
        self._calls.append(call)
        out.append(ToolCallDelta(index, call.id, name, ""))
        out.append(ToolCallDelta(index, None, None, arguments))

    def _as_call(self, json_text: str) -> tuple[str, str] | None:
        """(name, arguments) of a complete JSON object, or None if it is not a valid call."""
        try:
            value = json.loads(json_text, parse_float=finite_float)
        except (ValueError, RecursionError):  # also: a float beyond double range, deep nesting
            return None
        if not isinstance(value, dict):
            return None
        name = value.get("name")
        if not isinstance(name, str) or not name:
            return None
        if self._tool_names is not None and name not in self._tool_names:
            return None
        keys = [key for key in _ARGUMENT_KEYS[self.fmt] if key in value]
        arguments = value[keys[0]] if keys else {}
        if not isinstance(arguments, dict):
            return None
        try:
            text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
            # "\ud800" parses to a lone surrogate, which no response could carry.
            (name + text).encode("utf-8")
        except (UnicodeEncodeError, RecursionError):
            return None
        return name, text

    # -- hermes --------------------------------------------------------------------------------

    def _advance_hermes(self, out: list[StreamEvent], final: bool) -> None:
        while True:
            if self._mode == "outside":
                start = self._buffer.find(_OPEN)
                if start < 0:
                    keep = 0 if final else _partial_suffix_len(self._buffer, _OPEN)
                    self._emit_content(out, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return
                self._emit_content(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(_OPEN) :]
                self._mode, self._scanner = "block", None
            elif self._mode == "block":
                if not self._decide_block(out, final):
                    return
            elif not self._stream_content_block(out, final):
                return

    def _decide_block(self, out: list[StreamEvent], final: bool) -> bool:
        """Decides the open block (buffer: the text after <tool_call>) if the text allows.

        A call: a JSON object, then optional whitespace and </tool_call>. Anything else is
        content up to the first </tool_call> after the object (or after the tag, when there is
        no complete object), or to the end of output.
        """
        block = self._buffer
        start = run_end(WS_RUN, block)
        if start == len(block):
            if final:
                self._end_content_block(out, len(block))
            return final
        if block[start] != "{":
            return self._content_block(out, 0, final)
        if self._scanner is None:
            self._scanner = JsonObjectScanner(start)
        scanner = self._scanner
        scanner.advance(block)
        if scanner.status == INVALID or (scanner.status == PARTIAL and final):
            return self._content_block(out, 0, final)
        if scanner.status == PARTIAL:
            return False
        end = scanner.end
        after = run_end(WS_RUN, block, end)
        rest = block[after:]
        if rest.startswith(_CLOSE):
            call = self._as_call(block[start:end])
            if call is None:
                self._end_content_block(out, after + len(_CLOSE))
            else:
                span = (self._at(0) - len(_OPEN), self._at(after + len(_CLOSE)))
                self._emit_call(out, *call, span)
                self._buffer, self._mode = block[after + len(_CLOSE) :], "outside"
            return True
        if not final and _CLOSE.startswith(rest):
            return False
        return self._content_block(out, end, final)

    def _content_block(self, out: list[StreamEvent], search_from: int, final: bool) -> bool:
        """The open block is content; it ends at the first </tool_call> from `search_from`."""
        self._emit_content(out, _OPEN)
        self._mode, self._close_search_from, self._num_emitted = "content_block", search_from, 0
        return self._stream_content_block(out, final)

    def _stream_content_block(self, out: list[StreamEvent], final: bool) -> bool:
        block = self._buffer
        close = block.find(_CLOSE, self._close_search_from)
        if close >= 0:
            self._end_content_block(out, close + len(_CLOSE))
            return True
        # All of it is content whether or not a </tool_call> completes later; keep only
        # the tail a later </tool_call> could start in.
        self._emit_content(out, block[self._num_emitted :])
        keep_from = max(self._close_search_from, len(block) - len(_CLOSE) + 1, 0)
        self._buffer = block[keep_from:]
        self._close_search_from, self._num_emitted = 0, len(block) - keep_from
        if final:
            self._buffer, self._mode = "", "outside"
        return final

    def _end_content_block(self, out: list[StreamEvent], end: int) -> None:
        if self._mode == "block":
            self._emit_content(out, _OPEN)
            self._num_emitted = 0
        self._emit_content(out, self._buffer[self._num_emitted : end])
        self._buffer, self._mode = self._buffer[end:], "outside"

    # -- llama3_json ---------------------------------------------------------------------------

    def _advance_llama3(self, out: list[StreamEvent], final: bool) -> None:
        text = self._buffer
        if self._mode == "start":
            start = run_end(WS_RUN, text)
            rest = text[start:]
            if rest.startswith(_PYTHON_TAG):
                start = run_end(WS_RUN, text, start + len(_PYTHON_TAG))
                rest = text[start:]
            if not rest or _PYTHON_TAG.startswith(rest):  # maybe still a call
                if final:
                    self._llama3_content(out)
                return
            if rest[0] != "{":
                self._llama3_content(out)
                return
            self._mode, self._scanner = "calls", JsonObjectScanner(start)
            self._call_from = start
        if self._mode == "content":
            self._emit_content(out, text)
            self._buffer = ""
            return
        while True:  # "calls": objects joined by `;`
            scanner = self._scanner
            if scanner is not None:
                scanner.advance(text)
                if scanner.status == PARTIAL and not final:
                    return
                call = None
                if scanner.status == COMPLETE:
                    call = self._as_call(text[scanner.start : scanner.end])
                if call is None:
                    self._llama3_content(out)
                    return
                span = (self._at(self._call_from), self._at(scanner.end))
                self._pending.append((*call, span))
                self._scanner, self._position = None, scanner.end
            after = run_end(WS_RUN, text, self._position)
            if after == len(text):
                if final:
                    for name, arguments, span in self._pending:
                        self._emit_call(out, name, arguments, span)
                    self._buffer = ""
                return
            if text[after] == ";" and not self._after_semicolon:
                self._position, self._after_semicolon = after + 1, True
                self._call_from = after
            elif text[after] == "{" and self._after_semicolon:
                self._scanner, self._after_semicolon = JsonObjectScanner(after), False
            else:
                self._llama3_content(out)
                return

    def _llama3_content(self, out: list[StreamEvent]) -> None:
        self._mode, self._pending = "content", []
        self._emit_content(out, self._buffer)
        self._buffer = ""


def _merged(events: list[StreamEvent]) -> list[StreamEvent]:
    """Adjacent content deltas joined."""
    merged: list[StreamEvent] = []
    for event in events:
        previous = merged[-1] if merged else None
        if isinstance(event, ContentDelta) and isinstance(previous, ContentDelta):
            merged[-1] = ContentDelta(previous.text + event.text)
        else:
            merged.append(event)
    return merged


def _partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
