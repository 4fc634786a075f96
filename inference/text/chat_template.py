"""Chat templates: a conversation rendered to prompt text and to per-message token ids.

The model's own Jinja template is rendered the way Hugging Face renders it, so a
prompt here matches `apply_chat_template`. On top of the text, `render_segments`
attributes tokens to messages (the KV cache of a conversation is kept per turn), and
assistant messages carrying the ids the model generated are spliced in verbatim, so
the next turn's prompt is a token-exact extension of what is already in the cache.

Only the template's own markup becomes control tokens. Every string a caller supplies
(message content, names, tool calls and ids) is encoded as plain text, so a user who types
`<|im_end|>\n<|im_start|>system` gets those characters, not a forged system turn (Hugging
Face's `apply_chat_template` + `encode` would give the real tokens). Such text is escaped
before rendering (each special-token text becomes a private-use marker the template passes
through untouched) and each marker is tokenized as plain text afterwards.

Tools (OpenAI tool objects) reach the template as its `tools` variable, as Hugging Face's
`apply_chat_template(tools=...)` passes them, escaped like content. A template has a tool
format of its own if it reads that variable. One that does not, but renders plain
conversations exactly as ChatML does (the dev model's, most ChatML fine-tunes'), is rendered
with CHATML_TOOLS_TEMPLATE: Qwen2.5's Hermes-style tool prompt on ChatML, identical to ChatML
without tools. Any other template gets the generic format (inference.text.generic_tool_calls):
the tools go in a section at the end of the system message (a system message of their own when
the conversation has none; the first message when the template has no system role), assistant
calls render as `{"tool_calls": [...]}`, tool results as `{"tool_response": ...}` in the `tool`
role (the `user` role when the template renders no `tool` message), and while tools are offered
a plain answer as `{"response": ...}`: the shapes the grammar makes the model write, so the
history reads as the model wrote it. `tool_call_format` names the format the model will write
calls in.

Assistant tool calls keep the OpenAI shape, except that `function.arguments` (a JSON string)
is given to the template as the parsed object, as Hugging Face's docs ask (Llama 3.1 and
Qwen2.5 `tojson` it); a template that uses it as a string (`{{ }}`, `+`) still gets the
caller's text. An assistant message carrying generated `token_ids` is rendered from those
ids alone: the model wrote its calls in them, so its `tool_calls` are not rendered again.
"""

from __future__ import annotations

import datetime
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvchat.inference.text import generic_tool_calls as generic
from kvchat.inference.text.tokenizer import Tokenizer
from kvchat.inference.text.tool_calls import detect_tool_call_format

# ChatML as Hugging Face spells it; content may be None (assistant turns with tool calls).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '')"
    " + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ChatML with tools, for templates without tool support that render like ChatML: Qwen2.5's
# wording and Hermes-style calls, without Qwen's default system prompt. Tools go at the end of
# the system message (or in a leading one); assistant calls are <tool_call> lines after the
# content; each tool result is a user turn wrapping <tool_response> (Qwen2.5 merges a run of
# results into one turn, which needs look-ahead and would blur per-message segments).
# Without tools and tool messages it renders exactly as CHATML_TEMPLATE.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{{ '\\n<tool_call>\\n{\"name\": ' + function['name'] | tojson + ', \"arguments\": ' }}"
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{% else %}{{ function['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content']"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '')"
    " + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Render the same under a template as under ChatML only if the template is ChatML (the
# second catches a default system prompt, as Qwen's templates add).
_CHATML_PROBES = (
    (
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "V"},
    ),
    ({"role": "user", "content": "U"},),
)

ROLES = frozenset({"system", "user", "assistant", "tool"})

# Caller-supplied special-token text is rendered as ESC<index>END (private-use characters), so
# the template cannot turn it into control tokens; index 0 stands for ESC itself.
_ESC, _END = "\ue000", "\ue001"
_MARKER = re.compile(_ESC + r"(\d+)" + _END)


class ChatTemplateError(ValueError):
    """A conversation or template that cannot be rendered; the message says which part."""


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | user | assistant | tool
    content: str | None = None
    # The exact ids the model generated for an assistant turn; spliced in instead of
    # re-tokenizing `content` (which may tokenize differently).
    token_ids: tuple[int, ...] | None = None
    name: str | None = None
    tool_calls: tuple[dict[str, Any], ...] | None = None
    tool_call_id: str | None = None


@dataclass(frozen=True)
class Segment:
    message_index: int | None  # index into the messages; None for the generation prompt
    token_ids: tuple[int, ...]


MessageKey = tuple[Any, ...]


def message_key(message: ChatMessage) -> MessageKey:
    """What a message's rendering depends on, hashable (to tell whether two are the same)."""
    calls = json.dumps(message.tool_calls, sort_keys=True) if message.tool_calls else None
    return (
        message.role,
        message.content,
        message.token_ids,
        message.name,
        calls,
        message.tool_call_id,
    )


def tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str | None:
    """What a `tools` argument renders from, hashable."""
    return json.dumps(list(tools), sort_keys=True, default=str) if tools else None


_tools_key = tools_key


@dataclass(frozen=True)
class RenderedSegments:
    """What `extend_segments` computed, and what a later call for more of the same
    conversation reuses: the messages' keys and escaped dicts, the text their segments cover
    (the render without the generation prompt), their segments and the prompt's."""

    keys: tuple[MessageKey, ...]
    tools_key: str | None
    dicts: tuple[dict[str, Any], ...]
    text: str
    message_segments: tuple[Segment, ...]
    prompt: Segment | None
    complete: bool  # the last message has its own segment ending at `text`: reusable

    @property
    def segments(self) -> list[Segment]:
        return [*self.message_segments, *([self.prompt] if self.prompt is not None else [])]


class ChatTemplate:
    """One compiled Jinja chat template bound to the tokenizer whose ids it produces."""

    def __init__(self, source: str, tokenizer: Tokenizer) -> None:
        # How much work rendering took: whole-template renders and characters tokenized
        # (tests check a turn's work does not grow with the conversation).
        self.num_renders = 0
        self.num_tokenized_chars = 0
        self.is_generic = False  # decided below, once the template's own renders are probed
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
            reads_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"chat template does not compile: {e.message} (line {e.lineno})"
            ) from e
        self.source = source
        self._tokenizer = tokenizer
        # The source actually rendered: the model's own, or ChatML with tools in its place.
        self._rendered_source: str | None = source if reads_tools else None
        if not reads_tools and self._renders_like_chatml(env):
            self._template = env.from_string(CHATML_TOOLS_TEMPLATE)
            self._rendered_source = CHATML_TOOLS_TEMPLATE
        # Longest first, so a special text that contains another is matched whole.
        self._escaped = [_ESC, *sorted(tokenizer.special_token_texts, key=len, reverse=True)]
        self._escape_index = {text: i for i, text in enumerate(self._escaped)}
        self._escape_re = re.compile("|".join(re.escape(t) for t in self._escaped))
        # Stands in for an assistant's content to find where the template puts it.
        self._sentinel = f"KVCHATCONTENT{uuid.uuid4().hex}"
        # The generic tool format: where its tools section and tool results can go.
        self.is_generic = self._rendered_source is None
        self._has_system_role = self.is_generic and self._renders_role("system")
        self._tool_role = "tool" if self.is_generic and self._renders_role("tool") else "user"

    @property
    def tool_call_format(self) -> str | None:
        """The format the model writes tool calls in (see inference.text.tool_calls): the
        template's own, the generic one for a template without one, None for a template that
        reads `tools` in a format the server does not know."""
        if self._rendered_source is None:
            return generic.GENERIC
        return detect_tool_call_format(self._rendered_source)

    def render_text(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        self._validate(messages)
        tools_variable = self._tools_variable(tools)
        dicts = self._as_dicts(messages, 0, tools_variable)
        text = self._render(dicts, add_generation_prompt, tools_variable)
        return _MARKER.sub(lambda m: self._escaped[int(m.group(1))], text)

    def render_ids(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        segments = self.render_segments(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )
        return [token_id for segment in segments for token_id in segment.token_ids]

    def render_segments(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[Segment]:
        """Token ids per message, in order, then the generation prompt (index None).

        Message i's text is render(messages[:i+1]) minus the text of the segments before
        it, tokenized on its own with special tokens parsed. A template that looks ahead
        (rendering an earlier message differently once later ones exist) or refuses a
        prefix (Llama 3.1 with tools wants a user message) breaks that prefix chain at some
        messages: they get no segment, and their text goes to the next message whose
        prefix lines up again, else to the last message. The tools are rendered with the
        first segment that holds them. With add_generation_prompt the last segment is
        always the generation prompt, possibly empty.
        """
        return self.extend_segments(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        ).segments

    def extend_segments(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        previous: RenderedSegments | None = None,
    ) -> RenderedSegments:
        """`render_segments`, reusing `previous` (this template's result for the first of
        these messages, with the same tools) when the new render still starts with its text:
        then only the new messages' segments are computed (a few whole renders and the new
        text tokenized, instead of a render per message). Falls back to computing all of
        them when the earlier messages render differently now (a look-ahead template)."""
        self._validate(messages)
        tools_variable = self._tools_variable(tools)
        keys = tuple(message_key(m) for m in messages)
        tools_key = _tools_key(tools_variable)
        reused = 0
        if (
            previous is not None
            and previous.tools_key == tools_key
            and len(previous.keys) <= len(keys)
            and keys[: len(previous.keys)] == previous.keys
            and previous.complete
        ):
            reused = len(previous.keys)
        dicts = [
            *(previous.dicts if reused and previous else ()),
            *self._as_dicts(messages, reused, tools_variable),
        ]
        without = self._render(dicts, False, tools_variable)
        full = self._render(dicts, True, tools_variable) if add_generation_prompt else without
        if reused and previous is not None and not full.startswith(previous.text):
            reused = 0  # the new messages changed how the earlier ones render
        segments: list[Segment] = list(previous.message_segments) if reused and previous else []
        start = len(previous.text) if reused and previous else 0  # chars already in segments
        num_messages = len(messages)
        for index in range(reused, num_messages):
            if index == num_messages - 1:
                rendered: str | None = without
            else:
                rendered = self._render_prefix(dicts[: index + 1], tools_variable)
            if rendered is None or len(rendered) < start or not full.startswith(rendered):
                continue
            before = full[:start]
            segments.append(
                self._message_segment(messages, dicts, index, before, rendered, tools_variable)
            )
            start = len(rendered)
        complete = bool(segments) and segments[-1].message_index == num_messages - 1
        if not complete:
            end = len(without)
            if end < start or not full.startswith(without):
                end = len(full)
            segments.append(Segment(num_messages - 1, self._tokenize(full[start:end])))
            start = end
        prompt = Segment(None, self._tokenize(full[start:])) if add_generation_prompt else None
        return RenderedSegments(
            keys=keys,
            tools_key=tools_key,
            dicts=tuple(dicts),
            text=full[:start] if complete else without,
            message_segments=tuple(segments),
            prompt=prompt,
            complete=complete and full.startswith(without),
        )

    def _message_segment(
        self,
        messages: Sequence[ChatMessage],
        dicts: list[dict[str, Any]],
        index: int,
        before: str,
        rendered: str,
        tools: list[dict[str, Any]] | None,
    ) -> Segment:
        """Segment of messages[index], whose text is `rendered` minus `before`."""
        token_ids = messages[index].token_ids
        if token_ids is not None:
            spliced = self._splice_generated(dicts, index, before, token_ids, tools)
            if spliced is not None:
                return Segment(index, spliced)
        return Segment(index, self._tokenize(rendered[len(before) :]))

    def _splice_generated(
        self,
        dicts: list[dict[str, Any]],
        index: int,
        before: str,
        token_ids: tuple[int, ...],
        tools: list[dict[str, Any]] | None,
    ) -> tuple[int, ...] | None:
        """tokenize(prefix) + token_ids + tokenize(suffix) for a generated assistant turn.

        None when the template does not place the content exactly once, unchanged
        (then the caller re-tokenizes the content text).
        """
        probe = dict(dicts[index], content=self._sentinel)
        rendered = self._render_prefix([*dicts[:index], probe], tools)
        if rendered is None or not rendered.startswith(before):
            return None
        pieces = rendered[len(before) :].split(self._sentinel)
        if len(pieces) != 2:
            return None
        prefix, suffix = pieces
        if token_ids and token_ids[-1] in self._tokenizer.eos_token_ids:
            # The model already closed its turn; the template's closing text would
            # double it (`<|im_end|><|im_end|>`).
            end_text = self._tokenizer.decode([token_ids[-1]])
            suffix = suffix.removeprefix(end_text)
        return self._tokenize(prefix) + token_ids + self._tokenize(suffix)

    def tokenize(self, text: str) -> tuple[int, ...]:
        """Text as this template tokenizes what it renders (special-token text parsed)."""
        return self._tokenize(text)

    def _tokenize(self, text: str) -> tuple[int, ...]:
        """Rendered text -> ids: markup may hold special tokens, escaped text is plain."""
        self.num_tokenized_chars += len(text)
        encode = self._tokenizer.encode
        ids: list[int] = []
        start = 0
        for marker in _MARKER.finditer(text):
            ids += encode(text[start : marker.start()], allow_special=True)
            ids += encode(self._escaped[int(marker.group(1))], allow_special=False)
            start = marker.end()
        ids += encode(text[start:], allow_special=True)
        return tuple(ids)

    def _escape(self, value: Any) -> Any:
        """`value` (a string, or lists/dicts of them) with special-token text escaped."""
        if isinstance(value, str):
            return self._escape_re.sub(
                lambda m: f"{_ESC}{self._escape_index[m.group()]}{_END}", value
            )
        if isinstance(value, Mapping):
            return {self._escape(key): self._escape(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self._escape(item) for item in value]
        return value

    def _tools_variable(
        self, tools: Sequence[Mapping[str, Any]] | None
    ) -> list[dict[str, Any]] | None:
        """The template's `tools`: escaped copies; None for none (an empty list too)."""
        if not tools:
            return None
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise ChatTemplateError(f"tools[{i}] must be an object")
        return [self._escape(tool) for tool in tools]

    def _renders_like_chatml(self, env: jinja2.Environment) -> bool:
        chatml = env.from_string(CHATML_TEMPLATE)
        try:
            return all(
                self._render(dicts, prompt, None)
                == self._render(dicts, prompt, None, template=chatml)
                for dicts in ([dict(m) for m in probe] for probe in _CHATML_PROBES)
                for prompt in (False, True)
            )
        except ChatTemplateError:
            return False

    def _render_prefix(
        self, dicts: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> str | None:
        """The text of the first messages alone, None if the template refuses them."""
        try:
            return self._render(dicts, False, tools)
        except ChatTemplateError:
            return None

    def _render(
        self,
        dicts: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        *,
        template: jinja2.Template | None = None,
    ) -> str:
        if self.is_generic and template is None:
            dicts, tools = self._generic_view(dicts, tools), None
        variables: dict[str, Any] = {
            "messages": dicts,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
        }
        # Left undefined (renders as "") rather than None (renders as "None"), like HF.
        if self._tokenizer.bos_token is not None:
            variables["bos_token"] = self._tokenizer.bos_token
        if self._tokenizer.eos_token is not None:
            variables["eos_token"] = self._tokenizer.eos_token
        self.num_renders += 1
        try:
            return (template or self._template).render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e

    def _as_dicts(
        self,
        messages: Sequence[ChatMessage],
        start: int,
        tools: list[dict[str, Any]] | None,
    ) -> list[dict[str, Any]]:
        """The template's dicts of messages[start:] (the earlier ones give the names of the
        calls their tool results answer, for the generic format)."""
        if not self.is_generic:
            return [self._as_dict(m) for m in messages[start:]]
        names: dict[str, str] = {}
        dicts = []
        for i, message in enumerate(messages):
            for call in message.tool_calls or ():
                function = call.get("function")
                name = function.get("name") if isinstance(function, Mapping) else None
                if isinstance(name, str) and isinstance(call.get("id"), str):
                    names[call["id"]] = name
            if i >= start:
                dicts.append(self._as_generic_dict(message, names, answers=tools is not None))
        return dicts

    def _as_generic_dict(
        self, message: ChatMessage, call_names: Mapping[str, str], *, answers: bool
    ) -> dict[str, Any]:
        """A message in the generic tool format: calls, results, and (with `answers`, while
        tools are offered) a plain answer as the JSON the model writes. Generated replies
        keep their ids."""
        result = self._as_dict(message)
        if message.token_ids is not None:
            return result
        if message.role == "assistant" and message.tool_calls:
            text = generic.calls_text([self._escape(c) for c in message.tool_calls])
            if message.content:  # never written by the model in this format, but kept
                text = text[:-1] + ", " + generic.response_text(result["content"])[1:]
            result = {"role": "assistant", "content": text}
        elif message.role == "assistant" and answers and message.content is not None:
            result["content"] = generic.response_text(result["content"])
        elif message.role == "tool":
            name = message.name or call_names.get(message.tool_call_id or "")
            text = generic.tool_result_text(
                None if name is None else self._escape(name), result["content"]
            )
            result = {"role": "tool", "content": text}
        return result

    def _generic_view(
        self, dicts: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]]:
        """The messages as a template without tool support is given them: tool results in
        the `user` role unless it renders `tool` (a run of them as one message, since such
        templates tend to insist that roles alternate), and the tools section where the
        model reads it: at the end of the leading system message, else in a system message
        of its own, else (no system role) before the first message's content."""
        if self._tool_role != "tool":
            merged: list[dict[str, Any]] = []
            for d in dicts:
                if d["role"] != "tool":
                    merged.append(d)
                elif merged and merged[-1].get("_results"):
                    last = merged[-1]
                    merged[-1] = dict(last, content=f"{last['content']}\n{d['content']}")
                else:
                    merged.append({"role": "user", "content": d["content"], "_results": True})
            dicts = merged
        if not tools or not dicts:
            return dicts
        section = generic.tools_section(tools)
        first = dicts[0]
        if first["role"] == "system" and self._has_system_role:
            joined = f"{first['content']}\n\n{section}" if first["content"] else section
            return [dict(first, content=joined), *dicts[1:]]
        if self._has_system_role:
            return [{"role": "system", "content": section}, *dicts]
        joined = f"{section}\n\n{first['content']}" if first["content"] else section
        return [dict(first, content=joined), *dicts[1:]]

    def _renders_role(self, role: str) -> bool:
        """Whether the template renders a message of `role` with its content (probed)."""
        marker = f"KVCHATROLE{uuid.uuid4().hex}"
        probe = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        probe = [{"role": role, "content": marker}, *probe] if role == "system" else probe
        if role != "system":
            probe.append({"role": role, "content": marker})
        try:
            text = self._render(probe, False, None, template=self._template)
        except ChatTemplateError:
            return False
        return marker in text

    def _as_dict(self, message: ChatMessage) -> dict[str, Any]:
        content = message.content
        # Generated calls are in the ids, as the model wrote them; rendered from there only.
        from_ids = message.token_ids is not None and bool(message.tool_calls)
        if message.token_ids is not None and (content is None or from_ids):
            ids = list(message.token_ids)
            while ids and ids[-1] in self._tokenizer.eos_token_ids:
                ids.pop()
            content = self._tokenizer.decode(ids)
        result: dict[str, Any] = {"role": message.role, "content": self._escape(content)}
        if message.name is not None:
            result["name"] = self._escape(message.name)
        if message.tool_calls is not None and not from_ids:
            result["tool_calls"] = [self._tool_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            result["tool_call_id"] = self._escape(message.tool_call_id)
        return result

    def _tool_call(self, call: Mapping[str, Any]) -> dict[str, Any]:
        """An escaped OpenAI tool call whose JSON-text arguments also act as the object."""
        escaped: dict[str, Any] = self._escape(call)
        function = escaped.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            arguments = function["arguments"]
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):
                parsed = None
            if isinstance(parsed, dict):
                escaped["function"] = dict(function, arguments=_ToolArguments(parsed, arguments))
        return escaped

    def _validate(self, messages: Sequence[ChatMessage]) -> None:
        if not messages:
            raise ChatTemplateError("messages is empty; a chat needs at least one message")
        for i, message in enumerate(messages):
            if message.role not in ROLES:
                raise ChatTemplateError(
                    f"messages[{i}].role is {message.role!r}; expected one of "
                    f"{', '.join(sorted(ROLES))}"
                )
            if message.token_ids is not None:
                if message.role != "assistant":
                    raise ChatTemplateError(
                        f"messages[{i}].token_ids is only allowed on assistant messages"
                    )
                unknown = [t for t in message.token_ids if not self._tokenizer.is_known_id(t)]
                if unknown:
                    raise ChatTemplateError(
                        f"messages[{i}].token_ids has ids outside the vocabulary: {unknown[:5]}"
                    )
            elif message.content is None and message.role != "assistant":
                raise ChatTemplateError(
                    f"messages[{i}].content is required for role {message.role!r}"
                )


class _ToolArguments(dict[str, Any]):
    """A tool call's arguments as a template sees them: the parsed object (for `tojson`,
    `items`, `is mapping`), and the caller's JSON text where a template uses it as a string
    (`{{ arguments }}`, `'...' + arguments`)."""

    def __init__(self, parsed: dict[str, Any], text: str) -> None:
        super().__init__(parsed)
        self._text = text

    def __str__(self) -> str:
        return self._text

    def __add__(self, other: object) -> str:
        if isinstance(other, str):
            return self._text + other
        return NotImplemented

    def __radd__(self, other: object) -> str:
        if isinstance(other, str):
            return other + self._text
        return NotImplemented


def load_chat_template(model_dir: str | Path, tokenizer: Tokenizer) -> ChatTemplate:
    """The model's own template, else ChatML.

    Looks in chat_template.jinja (newer Hugging Face checkpoints), then in
    tokenizer_config.json's `chat_template`: a string, or a list of
    {"name", "template"} of which "default" is used.
    """
    model_dir = Path(model_dir)
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return ChatTemplate(jinja_path.read_text(encoding="utf-8"), tokenizer)
    config_path = model_dir / "tokenizer_config.json"
    if not config_path.is_file():
        return ChatTemplate(CHATML_TEMPLATE, tokenizer)
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChatTemplateError(f"{config_path}: not readable JSON ({e})") from e
    raw = config.get("chat_template") if isinstance(config, dict) else None
    if raw is None:
        return ChatTemplate(CHATML_TEMPLATE, tokenizer)
    if isinstance(raw, str):
        return ChatTemplate(raw, tokenizer)
    if isinstance(raw, list):
        named = {
            entry.get("name"): entry.get("template") for entry in raw if isinstance(entry, dict)
        }
        default = named.get("default")
        if isinstance(default, str):
            return ChatTemplate(default, tokenizer)
    raise ChatTemplateError(
        f"{config_path}: chat_template must be a string or a list of "
        "{'name', 'template'} objects including one named 'default'"
    )


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON, as in HF.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
