"""ContextBuilder: between the history planner (pure token counts) and the chat template (token
ids). It measures what the planner needs once per message (its segment length as rendered in
the conversation, its content length) and turns a plan back into the prompt's ids: system
prompt, running summary, kept messages with tool results cut to their cap, generation prompt.

Assistant messages that carry the ids the model generated are spliced in verbatim, so a turn's
prompt is a token-exact extension of the previous one whenever the planner kept the prefix.

Per-turn work is proportional to what is new: segments come from a SegmentRenderer (a message
rendered once, or a conversation's last render extended), named by the caller's `state_key`
(one for the conversation's branch as measured, one for its prompt); cut tool results are
kept too. Safe to call from several threads (the service runs it off the event loop).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvchat.history import (
    TOOL_CUT_MARKER,
    ContextPlan,
    HistoryMessage,
    HistoryPolicy,
    SummaryState,
    end_at_sentence,
    extract_lines,
    facts,
    merge_summary,
    sentences,
    summarization_messages,
    summary_defect,
    summary_max_new_tokens,
    tool_cap_split,
    with_period,
)

from .chat_template import ChatMessage, ChatTemplate, MessageKey, message_key
from .segment_renderer import SegmentRenderer
from .tokenizer import Tokenizer

SUMMARY_PREFIX = "Summary of the earlier conversation:\n"
EXTRACT_PREFIX = "The user said: "  # a line of an extracted summary: one dropped user message
Tools = Sequence[Mapping[str, Any]] | None  # OpenAI tool objects offered to the template


@dataclass(frozen=True)
class SettledSummary:
    """The running summary that replaces the previous one, and how it was made."""

    state: SummaryState
    extracted: bool  # the dropped user messages' sentences, not the generated text
    defect: str | None  # why the generated text was not kept (None: it was, or none was made)


@dataclass(frozen=True)
class MessageCounts:
    num_tokens: int  # the message's segment in the conversation, markup included
    content_tokens: int  # its content alone, as plain text


MAX_CUT_RESULTS = 4096  # tool results kept cut to their cap


class ContextBuilder:
    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.renderer = SegmentRenderer(template)
        self._cut: OrderedDict[tuple[MessageKey, int], ChatMessage] = OrderedDict()
        self._cut_lock = threading.Lock()

    # -- measuring (once per message; the caller stores the counts) ------------------------------

    def count(
        self,
        system: str | None,
        messages: Sequence[ChatMessage],
        tools: Tools = None,
        state_key: Hashable | None = None,
    ) -> list[MessageCounts]:
        """Counts of each of `messages` as rendered after the system prompt and each other."""
        lengths = self._lengths(system, messages, tools, state_key)
        return [MessageCounts(n, self.content_tokens(m)) for n, m in zip(lengths, messages)]

    def count_last(
        self,
        system: str | None,
        messages: Sequence[ChatMessage],
        tools: Tools = None,
        state_key: Hashable | None = None,
    ) -> MessageCounts:
        """The counts of the last of `messages` (a new one) as rendered after the others:
        with the `state_key` of the conversation's branch, only the new message is
        rendered and tokenized."""
        head = [ChatMessage("system", system)] if system else []
        length = self.renderer.last_length([*head, *messages], tools=tools, state_key=state_key)
        return MessageCounts(length, self.content_tokens(messages[-1]))

    def _lengths(
        self,
        system: str | None,
        messages: Sequence[ChatMessage],
        tools: Tools,
        state_key: Hashable | None,
    ) -> list[int]:
        head = [ChatMessage("system", system)] if system else []
        segments = self.renderer.render_segments(
            [*head, *messages], add_generation_prompt=False, tools=tools, state_key=state_key
        )
        lengths = [0] * (len(head) + len(messages))
        for segment in segments:
            if segment.message_index is not None:
                lengths[segment.message_index] += len(segment.token_ids)
        return lengths[len(head) :]

    def content_tokens(self, message: ChatMessage) -> int:
        if message.token_ids is not None:
            return len(message.token_ids)
        return len(self.tokenizer.encode(message.content or ""))

    def system_tokens(self, system: str | None, tools: Tools = None) -> int:
        """The system prompt's tokens, with the tools the template puts there (a template may
        render tools without any system message)."""
        if not system and not tools:
            return 0
        if not system:  # what the tools alone add before the first message
            probe = [ChatMessage("user", "x")]
            with_tools = self.template.render_ids(probe, add_generation_prompt=False, tools=tools)
            plain = self.template.render_ids(probe, add_generation_prompt=False)
            return len(with_tools) - len(plain)
        segments = self.template.render_segments(
            [ChatMessage("system", system)], add_generation_prompt=False, tools=tools
        )
        return sum(len(s.token_ids) for s in segments)

    def generation_prompt_tokens(self) -> int:
        """Tokens the template adds to open the assistant's turn (ChatML: 3)."""
        probe = [ChatMessage("user", "x")]
        with_prompt = self.template.render_ids(probe, add_generation_prompt=True)
        return len(with_prompt) - len(self.template.render_ids(probe, add_generation_prompt=False))

    def summary_state(
        self,
        system: str | None,
        text: str,
        covers: Sequence[str],
        max_num_tokens: int | None = None,
    ) -> SummaryState:
        """A summary with its segment length as placed after the system prompt. With
        `max_num_tokens`, its text is cut at the end until it takes at most that many (the
        generated ids, decoded and tokenized again, can come out a token or two longer)."""
        state = self._summary_state(system, text, covers)
        if max_num_tokens is None:
            return state
        ids = self.tokenizer.encode(text)
        while state.num_tokens > max_num_tokens and ids:
            # Each text token removed saves about one placed token.
            ids = ids[: max(0, len(ids) - (state.num_tokens - max_num_tokens))]
            state = self._summary_state(system, self.tokenizer.decode(ids).strip(), covers)
        return state

    def summary_max_tokens(
        self, system: str | None, policy: HistoryPolicy, max_context_tokens: int
    ) -> int:
        """max_tokens for generating a running summary that, placed after `system`, stays
        within its share of the budget (policy.summary_share_tokens); 0: no room for one.
        Measure what is generated with summary_state(..., max_num_tokens=the share)."""
        markup = self._summary_state(system, "", ()).num_tokens
        return summary_max_new_tokens(policy, max_context_tokens, markup)

    def settle_summary(
        self,
        system: str | None,
        previous: SummaryState | None,
        newly: Sequence[tuple[str, ChatMessage]],
        generated: str | None,
        cut_by_length: bool,
        max_num_tokens: int,
        earlier: Sequence[tuple[str, ChatMessage]] | None = None,
    ) -> SettledSummary | None:
        """The running summary that replaces `previous` and the newly dropped `(id, message)`
        pairs, oldest first, within `max_num_tokens` as placed (history.summaries says what
        one must keep): the `generated` text (None: none was made) when it passes
        summary_defect, ended at its last whole sentence if `cut_by_length` or cut to fit;
        otherwise extracted, covering the dropped messages, oldest first, whose facts fit.
        `earlier`, the messages `previous` covers: when the previous summary's facts no longer
        fit (the budget was lowered), the extract starts afresh from them. None when not one
        more message can be covered."""
        if not newly:
            raise ValueError("a running summary needs newly dropped messages")
        ids = [message_id for message_id, _ in newly]
        pairs = [(m.role, self._text(m)) for _, m in newly]
        before = previous.text if previous is not None else None
        defect = None
        if generated is not None:
            text = end_at_sentence(generated) if cut_by_length else with_period(generated)
            measured = self.summary_state(system, text, (), max_num_tokens=max_num_tokens)
            if measured.text != text:  # cut to fit: end it at a sentence again
                measured = self._summary_state(system, end_at_sentence(measured.text), ())
            defect = summary_defect(measured.text, before, pairs)
            if defect is None:
                state = merge_summary(previous, measured.text, measured.num_tokens, ids)
                return SettledSummary(state, extracted=False, defect=None)
        # The extract: the previous summary's lines, then one line per dropped user message.
        # When a line does not fit, sentences that state no fact make room (_make_room).
        lines = [_line(text) for text in before.split("\n")] if before else []
        if self._fit(system, lines, max_num_tokens) > max_num_tokens:
            # The previous summary's facts alone no longer fit: the budget was lowered.
            if previous is None or earlier is None:
                return None
            if [i for i, _ in earlier] != list(previous.covers):
                raise ValueError("earlier must be the messages the previous summary covers")
            fresh = self.settle_summary(system, None, [*earlier, *newly], None, False,
                                        max_num_tokens)  # fmt: skip
            return replace(fresh, defect=defect) if fresh is not None else None
        covered: list[str] = []
        for message_id, (role, content) in zip(ids, pairs):
            kept = extract_lines(role, content)
            if kept:
                candidate = [(p, list(said)) for p, said in lines] + [(EXTRACT_PREFIX, kept)]
                if self._fit(system, candidate, max_num_tokens) > max_num_tokens:
                    break  # its facts do not fit: the summary covers what came before
                lines = candidate
            covered.append(message_id)
        if not covered:
            return None
        text = _render(lines)
        num_tokens = self._summary_state(system, text, ()).num_tokens
        state = merge_summary(previous, text, num_tokens, covered)
        return SettledSummary(state, extracted=True, defect=defect)

    def _fit(self, system: str | None, lines: list[Line], max_num_tokens: int) -> int:
        """Make room in an extract's `lines` (_make_room) until, placed, they take at most
        `max_num_tokens` or no sentence without a fact is left; their size as placed."""
        size = self._summary_state(system, _render(lines), ()).num_tokens
        while size > max_num_tokens and _make_room(lines):
            size = self._summary_state(system, _render(lines), ()).num_tokens
        return size

    def _summary_state(self, system: str | None, text: str, covers: Sequence[str]) -> SummaryState:
        head = [ChatMessage("system", system)] if system else []
        summary = ChatMessage("system", SUMMARY_PREFIX + text)
        segments = self.template.render_segments([*head, summary], add_generation_prompt=False)
        num = sum(len(s.token_ids) for s in segments if s.message_index == len(head))
        return SummaryState(text=text, num_tokens=num, covers=tuple(covers))

    # -- building the prompt ----------------------------------------------------------------------

    def build(
        self,
        system: str | None,
        messages: Mapping[str, ChatMessage],
        plan: ContextPlan,
        tools: Tools = None,
        state_key: Hashable | None = None,
    ) -> list[int]:
        """The prompt's ids for a plan: `messages` maps the planned ids to their messages.
        `state_key` names the conversation's prompt (its last render is extended)."""
        chat: list[ChatMessage] = []
        if system:
            chat.append(ChatMessage("system", system))
        if plan.summary is not None:
            chat.append(ChatMessage("system", SUMMARY_PREFIX + plan.summary.text))
        for message_id in plan.kept:
            message = messages[message_id]
            cap = plan.capped.get(message_id)
            chat.append(self.cut_tool_result(message, cap) if cap is not None else message)
        return self.renderer.render_ids(
            chat, add_generation_prompt=True, tools=tools, state_key=state_key
        )

    def cut_tool_result(self, message: ChatMessage, cap: int) -> ChatMessage:
        """A tool result shortened to about `cap` content tokens: its head, a marker saying
        how many tokens were cut, its tail. The stored message stays whole."""
        key = (message_key(message), cap)
        with self._cut_lock:
            if key in self._cut:
                self._cut.move_to_end(key)
                return self._cut[key]
        cut = self._cut_tool_result(message, cap)
        with self._cut_lock:
            self._cut[key] = cut
            while len(self._cut) > MAX_CUT_RESULTS:
                self._cut.popitem(last=False)
        return cut

    def _cut_tool_result(self, message: ChatMessage, cap: int) -> ChatMessage:
        ids = self.tokenizer.encode(message.content or "")
        marker_tokens = len(self.tokenizer.encode(TOOL_CUT_MARKER.format(n=len(ids))))
        head, tail = tool_cap_split(len(ids), cap, marker_tokens)
        if tail == 0 and head == len(ids):
            return message
        cut = len(ids) - head - tail
        text = (
            self.tokenizer.decode(ids[:head])
            + TOOL_CUT_MARKER.format(n=cut)
            + (self.tokenizer.decode(ids[len(ids) - tail :]) if tail else "")
        )
        return ChatMessage(
            role=message.role,
            content=text,
            name=message.name,
            tool_call_id=message.tool_call_id,
        )

    def summarization_prompt(
        self, previous_summary: str | None, dropped: Sequence[ChatMessage]
    ) -> list[int]:
        """The prompt that folds `dropped` (and the previous summary) into a new summary."""
        pairs = [(m.role, self._text(m)) for m in dropped]
        chat = [
            ChatMessage(role, content)
            for role, content in summarization_messages(previous_summary, pairs)
        ]
        return self.template.render_ids(chat, add_generation_prompt=True)

    def _text(self, message: ChatMessage) -> str:
        if message.content is not None:
            text = message.content
        elif message.token_ids is not None:
            ids = [t for t in message.token_ids if t not in self.tokenizer.eos_token_ids]
            text = self.tokenizer.decode(ids)
        else:
            text = ""
        if message.tool_calls:
            calls = ", ".join(
                f"{c.get('function', {}).get('name')}({c.get('function', {}).get('arguments')})"
                for c in message.tool_calls
            )
            text = f"{text}\n[called {calls}]" if text else f"[called {calls}]"
        return text


def history_message(message_id: str, message: ChatMessage, counts: MessageCounts) -> HistoryMessage:
    """The planner's view of a stored message."""
    call_ids = tuple(str(c.get("id")) for c in message.tool_calls or ())
    return HistoryMessage(
        message_id=message_id,
        role=message.role,
        num_tokens=counts.num_tokens,
        content_tokens=counts.content_tokens,
        tool_call_ids=call_ids if message.role == "assistant" else (),
        tool_call_id=message.tool_call_id if message.role == "tool" else None,
    )


Line = tuple[str, list[str]]  # a line of an extracted summary: its prefix and its sentences


def _line(text: str) -> Line:
    prefix = EXTRACT_PREFIX if text.startswith(EXTRACT_PREFIX) else ""
    return prefix, sentences(text[len(prefix) :])


def _render(lines: Sequence[Line]) -> str:
    return "\n".join(prefix + " ".join(said) for prefix, said in lines if said)


def _make_room(lines: list[Line]) -> bool:
    """Drop the oldest question that states no fact, else the oldest such statement (what was
    asked was answered; what was stated may matter later). False: every sentence states one."""
    for wanted in (True, False):
        for _, said in lines:
            for i, sentence in enumerate(said):
                if sentence.endswith("?") == wanted and not facts(sentence):
                    del said[i]
                    return True
    return False
