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
"""

from __future__ import annotations

import datetime
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inference.tokenizer import Tokenizer

# ChatML as Hugging Face spells it; content may be None (assistant turns with tool calls).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '')"
    " + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
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


class ChatTemplate:
    """One compiled Jinja chat template bound to the tokenizer whose ids it produces."""

    def __init__(self, source: str, tokenizer: Tokenizer) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"chat template does not compile: {e.message} (line {e.lineno})"
            ) from e
        self.source = source
        self._tokenizer = tokenizer
        # Longest first, so a special text that contains another is matched whole.
        self._escaped = [_ESC, *sorted(tokenizer.special_token_texts, key=len, reverse=True)]
        self._escape_index = {text: i for i, text in enumerate(self._escaped)}
        self._escape_re = re.compile("|".join(re.escape(t) for t in self._escaped))
        # Stands in for an assistant's content to find where the template puts it.
        self._sentinel = f"KVCHATCONTENT{uuid.uuid4().hex}"

    def render_text(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> str:
        self._validate(messages)
        text = self._render([self._as_dict(m) for m in messages], add_generation_prompt)
        return _MARKER.sub(lambda m: self._escaped[int(m.group(1))], text)

    def render_ids(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> list[int]:
        segments = self.render_segments(messages, add_generation_prompt=add_generation_prompt)
        return [token_id for segment in segments for token_id in segment.token_ids]

    def render_segments(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> list[Segment]:
        """Token ids per message, in order, then the generation prompt (index None).

        Message i's text is render(messages[:i+1]) minus the text of the segments before
        it, tokenized on its own with special tokens parsed. A template that looks ahead
        (rendering an earlier message differently once later ones exist) or refuses a
        prefix (say, one without a user message) breaks that prefix chain at some
        messages: they get no segment, and their text goes to the next message whose
        prefix lines up again, else to the last message. With add_generation_prompt the
        last segment is always the generation prompt, possibly empty.
        """
        self._validate(messages)
        dicts = [self._as_dict(m) for m in messages]
        full = self._render(dicts, add_generation_prompt)
        without_prompt = full if not add_generation_prompt else self._render(dicts, False)
        segments: list[Segment] = []
        start = 0  # chars of `full` already in segments
        num_messages = len(messages)
        for index in range(num_messages):
            if index == num_messages - 1:
                rendered: str | None = without_prompt
            else:
                rendered = self._render_prefix(dicts[: index + 1])
            if rendered is None or len(rendered) < start or not full.startswith(rendered):
                continue
            segments.append(self._message_segment(messages, dicts, index, full[:start], rendered))
            start = len(rendered)
        if not segments or segments[-1].message_index != num_messages - 1:
            end = len(without_prompt)
            if end < start or not full.startswith(without_prompt):
                end = len(full)
            segments.append(Segment(num_messages - 1, self._tokenize(full[start:end])))
            start = end
        if add_generation_prompt:
            segments.append(Segment(None, self._tokenize(full[start:])))
        return segments

    def _message_segment(
        self,
        messages: Sequence[ChatMessage],
        dicts: list[dict[str, Any]],
        index: int,
        before: str,
        rendered: str,
    ) -> Segment:
        """Segment of messages[index], whose text is `rendered` minus `before`."""
        token_ids = messages[index].token_ids
        if token_ids is not None:
            spliced = self._splice_generated(dicts, index, before, token_ids)
            if spliced is not None:
                return Segment(index, spliced)
        return Segment(index, self._tokenize(rendered[len(before) :]))

    def _splice_generated(
        self, dicts: list[dict[str, Any]], index: int, before: str, token_ids: tuple[int, ...]
    ) -> tuple[int, ...] | None:
        """tokenize(prefix) + token_ids + tokenize(suffix) for a generated assistant turn.

        None when the template does not place the content exactly once, unchanged
        (then the caller re-tokenizes the content text).
        """
        probe = dict(dicts[index], content=self._sentinel)
        rendered = self._render_prefix([*dicts[:index], probe])
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

    def _tokenize(self, text: str) -> tuple[int, ...]:
        """Rendered text -> ids: markup may hold special tokens, escaped text is plain."""
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
            return self._escape_re.sub(lambda m: f"{_ESC}{self._escape_index[m.group()]}{_END}",
                                       value)
        if isinstance(value, dict):
            return {key: self._escape(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self._escape(item) for item in value]
        return value

    def _render_prefix(self, dicts: list[dict[str, Any]]) -> str | None:
        """The text of the first messages alone, None if the template refuses them."""
        try:
            return self._render(dicts, False)
        except ChatTemplateError:
            return None

    def _render(self, dicts: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        variables: dict[str, Any] = {
            "messages": dicts,
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
        }
        # Left undefined (renders as "") rather than None (renders as "None"), like HF.
        if self._tokenizer.bos_token is not None:
            variables["bos_token"] = self._tokenizer.bos_token
        if self._tokenizer.eos_token is not None:
            variables["eos_token"] = self._tokenizer.eos_token
        try:
            return self._template.render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e

    def _as_dict(self, message: ChatMessage) -> dict[str, Any]:
        content = message.content
        if content is None and message.token_ids is not None:
            ids = list(message.token_ids)
            while ids and ids[-1] in self._tokenizer.eos_token_ids:
                ids.pop()
            content = self._tokenizer.decode(ids)
        result: dict[str, Any] = {"role": message.role, "content": self._escape(content)}
        if message.name is not None:
            result["name"] = self._escape(message.name)
        if message.tool_calls is not None:
            result["tool_calls"] = [self._escape(dict(call)) for call in message.tool_calls]
        if message.tool_call_id is not None:
            result["tool_call_id"] = self._escape(message.tool_call_id)
        return result

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
