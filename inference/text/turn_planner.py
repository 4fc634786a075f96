"""The one planning step of a conversation's turn, for the service (app/turns/pipeline.py) and
the in-process Conversation alike: the branch (each message with the counts stored for it),
the new message, the history policy, the budgets and the running summary become the new
message's counts, the plan (what is kept, dropped, capped, to summarize) and the prompt's ids.
Budgets are resolved by the history package (`context_budget`, `reply_budget`): one rule for
everyone. CPU-bound; the service runs it on a worker thread."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvchat.history import ContextPlan, HistoryPolicy, SummaryState, plan_context, reply_budget
from kvchat.inference.text.chat_template import ChatMessage
from kvchat.inference.text.context_builder import ContextBuilder, MessageCounts, history_message
from kvchat.memory.stats import HistoryStats

NEW = "__new__"  # the plan's id for the message being added

Tools = Sequence[Mapping[str, Any]] | None


@dataclass(frozen=True)
class TurnPlan:
    new_counts: MessageCounts | None  # the new message's counts (store them with it)
    plan: ContextPlan
    prompt_ids: list[int]
    max_tokens: int  # the reply's budget

    @property
    def history_stats(self) -> HistoryStats:
        plan = self.plan
        return HistoryStats(
            trims=int(plan.trimmed),
            dropped_tokens=plan.num_dropped_tokens,
            tool_results_capped=len(plan.capped),
        )


def branch_key(conversation: Hashable) -> tuple[Hashable, str]:
    """The renderer's state of a conversation's branch as measured (message counts)."""
    return (conversation, "branch")


def prompt_key(conversation: Hashable) -> tuple[Hashable, str]:
    """The renderer's state of a conversation's prompt (its kept messages)."""
    return (conversation, "prompt")


def plan_turn(
    builder: ContextBuilder,
    *,
    system: str | None,
    branch: Sequence[tuple[str, ChatMessage, MessageCounts]],
    new_message: ChatMessage | None,
    tools: Tools,
    policy: HistoryPolicy,
    max_context_tokens: int,
    requested_max_tokens: int | None,
    default_max_tokens: int | None,
    summary: SummaryState | None,
    start_id: str | None,
    generation_prompt_tokens: int,
    conversation: Hashable | None = None,
) -> TurnPlan:
    """Plan a turn. `branch`: (id, message, counts) oldest first; `new_message` None
    regenerates the reply to the branch's last message. `conversation` names the
    conversation's kept renders (so only what is new is rendered). Raises the planner's
    errors (ContextLengthExceeded, InvalidHistoryError)."""
    history = [history_message(i, m, c) for i, m, c in branch]
    chat = [m for _, m, _ in branch]
    new_counts = None
    if new_message is not None:
        new_counts = builder.count_last(
            system,
            [*chat, new_message],
            tools,
            branch_key(conversation) if conversation is not None else None,
        )
        history.append(history_message(NEW, new_message, new_counts))
    max_tokens = reply_budget(requested_max_tokens, max_context_tokens, default_max_tokens)
    plan = plan_context(
        messages=history,
        system_tokens=builder.system_tokens(system, tools=tools),
        max_context_tokens=max_context_tokens,
        max_tokens=max_tokens,
        policy=policy,
        summary=summary,
        start_id=start_id,
        generation_prompt_tokens=generation_prompt_tokens,
    )
    by_id: dict[str, ChatMessage] = {i: m for i, m, _ in branch}
    if new_message is not None:
        by_id[NEW] = new_message
    prompt = builder.build(
        system,
        by_id,
        plan,
        tools=tools,
        state_key=prompt_key(conversation) if conversation is not None else None,
    )
    return TurnPlan(new_counts, plan, prompt, max_tokens)
