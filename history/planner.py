"""History planning: which stored messages go into a turn's prompt under a token budget.

Pure Python over token counts (no torch, no HTTP, no SQL), so the service and its tests call
it cheaply on every turn. The caller stores each message's segment length once (its tokens
under the model's chat template, markup included) and passes back, each turn, the trim point
and running summary this module planned before.

The rules:

- need(start) = system + summary (if one applies) + kept messages (tool results capped)
  + generation prompt + max_tokens, and need <= max_context_tokens always.
- The kept messages are a suffix of the branch (only the oldest units are dropped) and always
  hold the newest message. A unit is a user message, a plain assistant message, or an
  assistant message with tool_calls together with the tool messages answering it.
- After the system prompt and summary the prompt starts on a user message (LangChain's
  start_on="human"); the one exception is the whole branch, nothing dropped, as the client
  wrote it. So in an agent loop the newest tool result keeps its call, every earlier round of
  the loop and the user message that started it: a loop that alone outgrows the budget is
  refused (only the tool-result cap can help it), never cut in the middle.
- Watermarks (`drop`, `summarize`): the trim point stays put while need <= high x budget;
  when need crosses it, the trim point jumps in one go to where need <= low x budget, so the
  prompt prefix, and the KV cache pinned for it, stays stable for many turns. `drop_oldest`
  drops the minimum each time (the naive baseline); `none` never drops.
- `summarize` places a running summary of the dropped messages after the system prompt. The
  caller generates it off the critical path and passes it back: the turn that drops uses the
  previous summary and lists the rest in `to_summarize`; a later turn gets the new one.
- A summary is generated to at most its share of the budget (`summary_share_tokens`: a
  quarter of max_context_tokens as placed, markup included; `summary_max_new_tokens` says how
  many tokens to generate). One that does not fit beside the system prompt, the latest valid
  start and max_tokens (the budget was lowered after it was made) is left out: the turn is
  planned without it, trimming as usual, and the next summary, generated within the share,
  replaces it. So under every policy but `none` a turn is refused only when the system prompt,
  the latest valid start and max_tokens alone do not fit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from types import MappingProxyType

from kvchat.history.errors import ContextLengthExceeded, InvalidHistoryError
from kvchat.history.policy import ROLES, HistoryPolicy
from kvchat.history.summaries import SummaryState

# Filled in by the renderer between the head and tail of a capped tool result.
TOOL_CUT_MARKER = "\n[... {n} tokens cut ...]\n"


@dataclass(frozen=True)
class HistoryMessage:
    """One stored message of the branch, with its token counts (computed once, stored)."""

    message_id: str
    role: str  # user | assistant | tool (the system prompt is not a message here)
    num_tokens: int  # segment length under the chat template, markup included
    content_tokens: int = 0  # the content alone (what the tool-result cap cuts)
    tool_call_ids: tuple[str, ...] = ()  # assistant with tool_calls: its call ids
    tool_call_id: str | None = None  # tool: the call it answers

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_call_ids", tuple(self.tool_call_ids))
        who = f"message {self.message_id!r}"
        if self.role not in ROLES:
            raise InvalidHistoryError(
                f"{who} has role {self.role!r}; roles are {', '.join(ROLES)} "
                "(the system prompt is passed as system_tokens)"
            )
        if not 0 <= self.content_tokens <= self.num_tokens:
            raise InvalidHistoryError(
                f"{who} needs 0 <= content_tokens <= num_tokens, got {self.content_tokens} "
                f"and {self.num_tokens}"
            )
        if self.tool_call_ids and self.role != "assistant":
            raise InvalidHistoryError(f"{who}: only assistant messages carry tool_call_ids")
        if len(set(self.tool_call_ids)) != len(self.tool_call_ids):
            raise InvalidHistoryError(f"{who} repeats a tool call id: {self.tool_call_ids}")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise InvalidHistoryError(f"{who}: tool messages, and only they, need tool_call_id")


@dataclass(frozen=True)
class ContextPlan:
    """What goes into this turn's prompt, and what the caller stores for the next turn."""

    kept: tuple[str, ...]  # ids in the prompt, in order: a suffix of the branch
    start_id: str | None  # first kept id: the trim point to pass back next turn
    dropped: tuple[str, ...]  # ids before the trim point
    summary: SummaryState | None  # placed after the system prompt (policy summarize only)
    # The summary passed applies to the branch but did not fit beside the system prompt, the
    # latest valid start and max_tokens: not placed (the budget was lowered after it was made).
    summary_left_out: SummaryState | None
    to_summarize: tuple[str, ...]  # running_summary.covers + to_summarize == dropped (summarize)
    capped: Mapping[str, int]  # kept tool message id -> content tokens it is cut to
    num_prompt_tokens: int  # system + placed summary + kept (capped) + generation prompt
    trimmed: bool  # this turn moved the trim point (a trim event)
    num_dropped_tokens: int  # prompt tokens newly dropped by this turn's trim event

    @property
    def running_summary(self) -> SummaryState | None:
        """The summary the next one extends (placed or left out): it covers the dropped
        messages before `to_summarize`."""
        return self.summary if self.summary is not None else self.summary_left_out


def units(messages: Sequence[HistoryMessage]) -> list[tuple[int, int]]:
    """The droppable units as half-open index ranges [start, end), oldest first.

    Also checks what the planner relies on: unique ids, and each tool message directly after
    the assistant message whose call it answers (or after that call's other results). Calls
    not answered (yet) are allowed: an agent loop's results may be stored one by one.
    """
    if len({m.message_id for m in messages}) != len(messages):
        raise InvalidHistoryError("message ids must be unique within the branch")
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(messages):
        call = messages[i]
        if call.role == "tool":
            raise _orphan(call)
        end = i + 1
        answered: set[str] = set()
        while end < len(messages) and messages[end].role == "tool" and call.tool_call_ids:
            result = messages[end]
            if result.tool_call_id not in call.tool_call_ids:
                raise _orphan(result)
            if result.tool_call_id in answered:
                raise InvalidHistoryError(
                    f"tool message {result.message_id!r} answers tool call "
                    f"{result.tool_call_id!r} a second time"
                )
            answered.add(result.tool_call_id)
            end += 1
        spans.append((i, end))
        i = end
    return spans


def plan_context(
    *,
    messages: Sequence[HistoryMessage],
    system_tokens: int,
    max_context_tokens: int,
    max_tokens: int,
    policy: HistoryPolicy,
    summary: SummaryState | None = None,
    start_id: str | None = None,
    generation_prompt_tokens: int = 0,
) -> ContextPlan:
    """Plan this turn's prompt from the branch (oldest first, no system prompt), the trim
    point and summary planned before, and the budget.

    A summary that applies is placed only if it fits beside the system prompt, the latest
    valid start and max_tokens; otherwise it is left out and the turn planned without it.
    Raises ContextLengthExceeded when even the smallest allowed prompt (system prompt, latest
    valid start, max_tokens; no summary) does not fit, and under `none` when the prompt from
    the trim point does not fit."""
    _check_budget(system_tokens, max_context_tokens, max_tokens, generation_prompt_tokens)
    units(messages)  # validates the tool-call grouping
    ids = tuple(m.message_id for m in messages)
    sizes = [_prompt_size(m, policy.max_tool_result_tokens) for m in messages]
    tail = list(accumulate(reversed(sizes), initial=0))[::-1]  # tail[s]: tokens from s on
    starts = _valid_starts(messages)
    previous = _previous_start(ids, starts, start_id)
    running = summary if policy.policy == "summarize" else None
    if running is not None and not _summary_applies(running, ids, previous):
        running = None
    fixed = system_tokens + generation_prompt_tokens + max_tokens
    # Placed only where it leaves room for the smallest allowed prompt: a summary the budget
    # no longer holds must not lock the conversation out.
    smallest = fixed + tail[starts[-1]]
    applied = running
    if running is not None and smallest + running.num_tokens > max_context_tokens:
        applied = None
    fixed += applied.num_tokens if applied is not None else 0

    def need(start: int) -> int:
        return fixed + tail[start]

    start = _choose_start(policy, need, [s for s in starts if s >= previous], max_context_tokens)
    if need(start) > max_context_tokens:
        raise ContextLengthExceeded(need(start), max_context_tokens, max_tokens)
    cap = policy.max_tool_result_tokens
    capped = {m.message_id: cap for m in messages[start:] if cap is not None and _is_cut(m, cap)}
    covered = len(running.covers) if running is not None else 0
    return ContextPlan(
        kept=ids[start:],
        start_id=ids[start] if start < len(ids) else None,
        dropped=ids[:start],
        summary=applied,
        summary_left_out=running if applied is None else None,
        to_summarize=ids[covered:start] if policy.policy == "summarize" else (),
        capped=MappingProxyType(capped),
        num_prompt_tokens=need(start) - max_tokens,
        trimmed=start != previous,
        num_dropped_tokens=tail[previous] - tail[start],
    )


def tool_cap_split(num_content_tokens: int, cap: int, marker_tokens: int) -> tuple[int, int]:
    """(head, tail) content tokens to keep of a tool result cut to `cap`, with
    head + marker_tokens + tail <= cap and head - tail in {0, 1}. A result within the cap is
    kept whole: (num_content_tokens, 0), no marker.

    marker_tokens: the marker's length as rendered. The count cut is only known after the
    split, so measure TOOL_CUT_MARKER filled with num_content_tokens (the most that can be
    cut): a smaller number has no more digits, and in common tokenizers no more tokens.
    """
    if min(num_content_tokens, cap, marker_tokens) < 0:
        raise InvalidHistoryError("token counts must be >= 0", "cap")
    if num_content_tokens <= cap:
        return num_content_tokens, 0
    room = cap - marker_tokens
    if room < 0:
        raise InvalidHistoryError(
            f"a cap of {cap} tokens leaves no room for a {marker_tokens}-token cut marker", "cap"
        )
    return (room + 1) // 2, room // 2


def _choose_start(
    policy: HistoryPolicy, need: Callable[[int], int], starts: list[int], limit: int
) -> int:
    """The trim point for this turn among the valid starts from the previous one on (the
    first is the previous trim point). need() falls as the start moves later."""
    previous = starts[0]
    if policy.policy == "none":
        return previous
    if policy.policy == "drop_oldest":
        return _first(starts, need, limit)
    if need(previous) <= policy.high_watermark_tokens(limit):
        return previous
    low = policy.low_watermark_tokens(limit)
    at_low = next((s for s in starts if need(s) <= low), None)
    return at_low if at_low is not None else _first(starts, need, limit)


def _first(starts: list[int], need: Callable[[int], int], limit: int) -> int:
    """The first start whose need fits `limit`; the last start (the smallest prompt) when
    none does, for the caller to refuse."""
    return next((s for s in starts if need(s) <= limit), starts[-1])


def _valid_starts(messages: Sequence[HistoryMessage]) -> list[int]:
    """Where a prompt may begin: the whole branch, or any user message (always at a unit
    boundary: tool messages only follow their call)."""
    return [0] + [i for i, m in enumerate(messages) if m.role == "user" and i > 0]


def _previous_start(ids: tuple[str, ...], starts: list[int], start_id: str | None) -> int:
    """The trim point passed back, if it is still a valid start of this branch; else the
    beginning (a branch switch or a first turn)."""
    index = ids.index(start_id) if start_id in ids else 0
    return index if index in starts else 0


def _summary_applies(summary: SummaryState, ids: tuple[str, ...], start: int) -> bool:
    """A summary is honoured only if it covers a non-empty leading run of the branch that
    lies wholly before the trim point (a branch switch or a stale summary fails this)."""
    n = len(summary.covers)
    return 0 < n <= start and ids[:n] == summary.covers


def _is_cut(message: HistoryMessage, cap: int) -> bool:
    """A tool result longer than the cap is cut to it in the prompt (stored whole)."""
    return message.role == "tool" and message.content_tokens > cap


def _prompt_size(message: HistoryMessage, cap: int | None) -> int:
    """A message's tokens in the prompt: a cut tool result counts its content at the cap."""
    if cap is not None and _is_cut(message, cap):
        return message.num_tokens - message.content_tokens + cap
    return message.num_tokens


def _check_budget(
    system_tokens: int, max_context_tokens: int, max_tokens: int, generation_prompt_tokens: int
) -> None:
    """The planning arguments a caller (or a user's request) controls."""
    if max_context_tokens < 1:
        raise InvalidHistoryError(
            f"max_context_tokens must be >= 1, got {max_context_tokens}", "max_context_tokens"
        )
    if max_tokens < 1:
        raise InvalidHistoryError(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    for field, value in (
        ("system_tokens", system_tokens),
        ("generation_prompt_tokens", generation_prompt_tokens),
    ):
        if value < 0:
            raise InvalidHistoryError(f"{field} must be >= 0, got {value}", field)


def _orphan(message: HistoryMessage) -> InvalidHistoryError:
    return InvalidHistoryError(
        f"tool message {message.message_id!r} answers tool call {message.tool_call_id!r}, "
        "which the assistant message before it did not make: messages with role 'tool' must "
        "be a response to a preceding message with 'tool_calls'"
    )
