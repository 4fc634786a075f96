"""SegmentRenderer: a conversation's per-message token segments, each turn computing only what
is new. Exactly `ChatTemplate.render_segments` (a test compares them on every template the
project supports, tools included), without its cost: render_segments renders one prefix per
message, so a conversation of n messages costs n renders of growing prefixes.

Two ways, chosen per template when it is loaded:
- **Local templates** (ChatML and what renders like it): each message after the leading
  system messages renders the same alone as in any conversation, which probes of every
  message shape check at load. A message's segment is then computed once, from the message
  alone, and kept (an LRU keyed by the message's content); a turn renders only its new
  messages and the small head (system prompt, summary, tools).
- **Other templates** (Llama 3's, Qwen2.5's: a BOS, a default system prompt, results merged
  by look-ahead): the last segments of each conversation are kept (`state_key`), and when the
  next call extends those messages and their text is a prefix of the new render, only the
  new messages' segments are computed: a few whole renders (Jinja, linear and cheap) and the
  new text tokenized, instead of a render per message and the whole history tokenized. When
  the messages changed at the front (the history was trimmed) it renders them afresh once.

Thread-safe: the service computes segments on worker threads."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from kvchat.inference.text.chat_template import (
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    MessageKey,
    RenderedSegments,
    Segment,
    message_key,
)
from kvchat.inference.text.chat_template import (
    tools_key as _tools_key,
)

Tools = Sequence[Mapping[str, Any]] | None
MAX_HEADS = 4096  # heads (system prompt, summary, tools) kept

# Conversation shapes the locality probes render (with and without tools).
_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
_PROBE_TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
)


class SegmentRenderer:
    def __init__(
        self,
        template: ChatTemplate,
        *,
        max_cached_tokens: int = 1_000_000,
        max_states: int = 1024,
        max_state_chars: int = 16_000_000,
    ) -> None:
        self.template = template
        self.max_cached_tokens = max_cached_tokens
        self.max_states = max_states
        self.max_state_chars = max_state_chars  # the kept renders' text, all conversations
        self._state_chars = 0
        self._lock = threading.Lock()
        self._segments: OrderedDict[MessageKey, array[int]] = OrderedDict()
        self._cached_tokens = 0
        self._states: OrderedDict[Hashable, RenderedSegments] = OrderedDict()
        self._heads: OrderedDict[Hashable, tuple[Segment, ...]] = OrderedDict()
        self._generation_prompt: tuple[int, ...] | None = None
        self.is_local = self._probe_locality()

    # -- the one entry point ---------------------------------------------------------------------

    def render_segments(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Tools = None,
        state_key: Hashable | None = None,
    ) -> list[Segment]:
        """`template.render_segments(messages, ...)`. `state_key` names the conversation
        (other templates keep its last segments under it; local ones need none)."""
        if not messages:
            return self.template.render_segments(messages)  # raises its error
        if self.is_local:
            return self._local(messages, add_generation_prompt, tools)
        return self._incremental(messages, add_generation_prompt, tools, state_key)

    def render_ids(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Tools = None,
        state_key: Hashable | None = None,
    ) -> list[int]:
        if self.is_local and messages:
            return self._local_ids(messages, add_generation_prompt, tools)
        segments = self.render_segments(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, state_key=state_key
        )
        return [token_id for segment in segments for token_id in segment.token_ids]

    def forget(self, state_key: Hashable) -> None:
        """Drop a conversation's kept segments (it was deleted)."""
        with self._lock:
            dropped = self._states.pop(state_key, None)
            self._state_chars -= len(dropped.text) if dropped is not None else 0

    # -- local templates -------------------------------------------------------------------------

    def _head_length(self, messages: Sequence[ChatMessage], tools: Tools) -> int:
        """How many leading messages render together (the system messages; with tools and no
        system message, the first message, which the tools go before)."""
        head = 0
        while head < len(messages) and messages[head].role == "system":
            head += 1
        return head if head or not tools else 1

    def _local(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool, tools: Tools
    ) -> list[Segment]:
        head = self._head_length(messages, tools)
        segments = list(self._head(messages[:head], tools)) if head else []
        for index in range(head, len(messages)):
            segments.append(Segment(index, tuple(self._alone(messages[index]))))
        if add_generation_prompt:
            segments.append(Segment(None, self._prompt_ids()))
        return segments

    def _local_ids(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool, tools: Tools
    ) -> list[int]:
        """The local segments' ids, concatenated from what is kept (no per-token Python)."""
        head = self._head_length(messages, tools)
        ids: list[int] = []
        for segment in self._head(messages[:head], tools) if head else ():
            ids.extend(segment.token_ids)
        for message in messages[head:]:
            ids.extend(self._alone(message))
        if add_generation_prompt:
            ids.extend(self._prompt_ids())
        return ids

    def last_length(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Tools = None,
        state_key: Hashable | None = None,
    ) -> int:
        """Tokens of the last message's segment (no generation prompt): what measuring a new
        message costs, its own rendering only on local templates."""
        if not messages:
            return len(self.render_segments(messages))  # raises its error
        if self.is_local and len(messages) - 1 >= self._head_length(messages, tools):
            return len(self._alone(messages[-1]))
        last = len(messages) - 1
        segments = self.render_segments(
            messages, add_generation_prompt=False, tools=tools, state_key=state_key
        )
        return sum(len(s.token_ids) for s in segments if s.message_index == last)

    def _head(self, head: Sequence[ChatMessage], tools: Tools) -> tuple[Segment, ...]:
        """The leading messages' segments (the system prompt, a summary, with the tools),
        kept by what they are: a conversation's head is the same turn after turn."""
        key = (tuple(message_key(m) for m in head), _tools_key(tools))
        with self._lock:
            cached = self._heads.get(key)
            if cached is not None:
                self._heads.move_to_end(key)
                return cached
        segments = tuple(
            self.template.render_segments(head, add_generation_prompt=False, tools=tools)
        )
        with self._lock:
            self._heads[key] = segments
            while len(self._heads) > MAX_HEADS:
                self._heads.popitem(last=False)
        return segments

    def _alone(self, message: ChatMessage) -> array[int]:
        key = message_key(message)
        with self._lock:
            cached = self._segments.get(key)
            if cached is not None:
                self._segments.move_to_end(key)
                return cached
        self.template._validate([message])
        segments = self.template.render_segments([message], add_generation_prompt=False)
        ids = array("l", (t for s in segments for t in s.token_ids))
        with self._lock:
            if key not in self._segments:
                self._segments[key] = ids
                self._cached_tokens += len(ids)
                while self._cached_tokens > self.max_cached_tokens and len(self._segments) > 1:
                    _, dropped = self._segments.popitem(last=False)
                    self._cached_tokens -= len(dropped)
        return ids

    def _prompt_ids(self) -> tuple[int, ...]:
        if self._generation_prompt is None:
            probe = [ChatMessage("user", "x")]
            segments = self.template.render_segments(probe, add_generation_prompt=True)
            self._generation_prompt = segments[-1].token_ids
        return self._generation_prompt

    def _probe_locality(self) -> bool:
        """Whether every probe conversation's segments are its head's plus each later message
        rendered alone (plus the generation prompt): then so are all conversations of those
        shapes, and segments can be kept per message."""
        system = ChatMessage("system", "You are terse.")
        user, other = ChatMessage("user", "Hi <|im_end|> there"), ChatMessage("user", "More?")
        reply = ChatMessage("assistant", "Hello.")
        calls = ChatMessage("assistant", None, tool_calls=(_CALL,))
        result = ChatMessage("tool", '{"temp": 21}', tool_call_id="call_1")
        result2 = ChatMessage("tool", '{"temp": 22}', tool_call_id="call_2")
        generated = ChatMessage(
            "assistant", None, token_ids=tuple(self.template._tokenize("Generated."))
        )
        probes: list[list[ChatMessage]] = [
            [user],
            [system, user],
            [system, user, reply, other],
            [user, reply, other, generated, other],
            [system, system, user, reply],
            [system, user, calls, result, reply, other],
            [user, calls, result, result2, other],
        ]
        try:
            for probe in probes:
                for tools in (None, _PROBE_TOOLS):
                    for prompt in (True, False):
                        whole = self.template.render_segments(
                            probe, add_generation_prompt=prompt, tools=tools
                        )
                        if whole != self._local(probe, prompt, tools):
                            return False
        except ChatTemplateError:
            return False
        finally:
            with self._lock:
                self._segments.clear()
                self._heads.clear()
                self._cached_tokens = 0
            self._generation_prompt = None
        return True

    # -- other templates -------------------------------------------------------------------------

    def _incremental(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool,
        tools: Tools,
        state_key: Hashable | None,
    ) -> list[Segment]:
        previous = None
        if state_key is not None:
            with self._lock:
                previous = self._states.get(state_key)
        rendered = self.template.extend_segments(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, previous=previous
        )
        if state_key is not None:
            with self._lock:
                old = self._states.pop(state_key, None)
                self._state_chars -= len(old.text) if old is not None else 0
                self._states[state_key] = rendered
                self._state_chars += len(rendered.text)
                while len(self._states) > 1 and (
                    len(self._states) > self.max_states or self._state_chars > self.max_state_chars
                ):
                    _, dropped = self._states.popitem(last=False)
                    self._state_chars -= len(dropped.text)
        return rendered.segments
