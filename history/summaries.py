"""The running summary: what the dropped messages become under the `summarize` policy, the
prompt that makes it, how much of it to generate, and which messages a new one folds in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvchat.history.errors import InvalidHistoryError
from kvchat.history.policy import ROLES, HistoryPolicy

if TYPE_CHECKING:
    from kvchat.history.planner import ContextPlan

SUMMARY_INSTRUCTION = (
    "You keep the running summary of a conversation between a user and an assistant. "
    "The messages below are being removed from the conversation: your summary replaces "
    "them, and the previous summary if there is one, and is all that will remain of them. "
    "Write a concise summary that keeps the facts, names, numbers, decisions made and open "
    "tasks or questions; leave out greetings and filler. Answer with the summary only."
)


@dataclass(frozen=True)
class SummaryState:
    """The running summary of dropped messages, placed right after the system prompt."""

    text: str
    num_tokens: int  # its segment length as placed in the prompt
    covers: tuple[str, ...]  # ids of the messages it summarizes, oldest first

    def __post_init__(self) -> None:
        object.__setattr__(self, "covers", tuple(self.covers))
        if self.num_tokens < 0:
            raise InvalidHistoryError(
                f"summary num_tokens must be >= 0, got {self.num_tokens}", "summary"
            )
        if len(set(self.covers)) != len(self.covers):
            raise InvalidHistoryError("summary covers a message id twice", "summary")


def summary_targets(plan: ContextPlan) -> tuple[SummaryState | None, tuple[str, ...]]:
    """What a new summary after this turn folds together: the running summary it extends
    (None: the first) and the dropped messages no summary covers yet, oldest first; empty
    when there is nothing to summarize (not `summarize`, nothing new, or a running summary
    that does not lead this branch)."""
    previous = plan.running_summary
    covered = previous.covers if previous is not None else ()
    if not plan.to_summarize or plan.dropped[: len(covered)] != covered:
        return previous, ()
    return previous, plan.to_summarize


def summarization_messages(
    previous_summary: str | None, dropped: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """The (role, content) prompt that folds newly dropped messages into the summary:
    the instruction, then the previous summary and the messages as a transcript."""
    if not dropped:
        raise InvalidHistoryError("nothing to summarize: no dropped messages", "dropped")
    for role, _ in dropped:
        if role not in ROLES:
            raise InvalidHistoryError(f"dropped message has role {role!r}", "dropped")
    transcript = "\n\n".join(f"{role}: {content}" for role, content in dropped)
    parts = []
    if previous_summary:
        parts.append(f"Previous summary:\n{previous_summary}")
    parts.append(f"Messages to fold into the summary:\n{transcript}")
    return [("system", SUMMARY_INSTRUCTION), ("user", "\n\n".join(parts))]


def summary_max_new_tokens(
    policy: HistoryPolicy, max_context_tokens: int, markup_tokens: int
) -> int:
    """How many tokens to generate for a running summary: max_summary_tokens, bounded so the
    summary as placed (its text plus `markup_tokens`, what placing it adds: the prefix and the
    template's markup) stays within its share of the budget. 0 when the share cannot hold the
    markup: no summary is made."""
    if markup_tokens < 0:
        raise InvalidHistoryError(f"markup_tokens must be >= 0, got {markup_tokens}", "markup")
    room = policy.summary_share_tokens(max_context_tokens) - markup_tokens
    return max(0, min(policy.max_summary_tokens, room))


def merge_summary(
    previous: SummaryState | None, text: str, num_tokens: int, newly_covered: Sequence[str]
) -> SummaryState:
    """The new running summary: `text` (generated from the previous summary and the newly
    dropped messages) covering the previous summary's messages and then `newly_covered`."""
    before = previous.covers if previous is not None else ()
    if not newly_covered:
        raise InvalidHistoryError("a new summary must cover new messages", "newly_covered")
    if set(before) & set(newly_covered):
        raise InvalidHistoryError(
            "newly_covered repeats messages the previous summary covers", "newly_covered"
        )
    return SummaryState(text=text, num_tokens=num_tokens, covers=before + tuple(newly_covered))
