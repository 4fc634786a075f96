"""The planning step of a conversation's turn: the branch read from the store, the context
planned under the conversation's budget and history policy (the history package), the prompt's
ids built (generated replies spliced back by their ids), the request checked. Nothing is
stored or generated here: the turn service (app/turns/service.py) commits the turn and runs
it. Under the `summarize` policy, what the plan dropped is folded into the running summary by
a low-priority background request (`summary_job`); the next turns get it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvchat.app.coord.locks import HeldLock
from kvchat.app.errors import invalid_request, not_found
from kvchat.app.ops.limits import check_capacity
from kvchat.app.schemas.chat import SamplingFields
from kvchat.app.schemas.conversations import (
    ROOT,
    InvalidSessionSettings,
    check_session_settings,
    setting_in_range,
)
from kvchat.app.state import AppState
from kvchat.app.store import NEW_USER, ConversationRecord, MessageRecord, SummaryRecord
from kvchat.app.turns.prompting import offered_tools, sampling_params
from kvchat.app.turns.structured import output_grammar
from kvchat.history import (
    ContextLengthExceeded,
    ContextPlan,
    HistoryPolicy,
    HistoryPolicyError,
    SummaryState,
    summary_targets,
)
from kvchat.history import context_budget as resolve_context_budget
from kvchat.inference import (
    NEW,
    PRIORITY_LOW,
    ChatMessage,
    CheckedRequest,
    MessageCounts,
    SamplingParams,
    branch_key,
    plan_turn,
)
from kvchat.memory import HistoryStats, SessionBudget

log = logging.getLogger(__name__)

USABLE = ("complete", "cancelled")  # assistant replies that count as history


@dataclass(frozen=True)
class PreparedTurn:
    """A planned turn, ready to be committed and run."""

    conversation: ConversationRecord
    request: CheckedRequest  # the prompt and its sampling, checked once (engine.check_request)
    plan: ContextPlan
    policy: HistoryPolicy
    branch: list[MessageRecord]  # the usable history, oldest first
    chat: list[ChatMessage]  # the branch as the template renders it
    new_message: ChatMessage | None  # None: a regenerate
    user_fields: dict[str, Any] | None  # the new message as the store takes it
    reply_parent_id: str | None  # where the user message (or, regenerating, the reply) goes
    tools: list[dict[str, Any]] | None
    tool_format: str | None
    tool_names: set[str] | None
    # The stored path root..parent as read (every status) and the running summary read with
    # it: the branch cache keeps them, with the new messages, once the turn is stored.
    path: tuple[MessageRecord, ...] = ()
    summary_record: SummaryRecord | None = None
    instructions: str | None = None  # this turn's system prompt instead of the conversation's

    @property
    def system(self) -> str | None:
        return turn_system(self.conversation, self.instructions)

    @property
    def trim_start_id(self) -> str | None:
        return NEW_USER if self.plan.start_id == NEW else self.plan.start_id

    @property
    def history_stats(self) -> HistoryStats:
        plan = self.plan
        return HistoryStats(
            trims=int(plan.trimmed),
            dropped_tokens=plan.num_dropped_tokens,
            tool_results_capped=len(plan.capped),
        )


# -- the pipeline ----------------------------------------------------------------------------


def check_settings(state: AppState, conv: ConversationRecord) -> None:
    """Refuse a turn (400 naming the field) on a conversation whose settings, over the
    defaults, make no budget and policy a turn can run: a row stored before settings were
    checked together, or by hand, or left behind by a change of the defaults."""
    try:
        check_session_settings(conv.overrides, {}, asdict(state.defaults))
    except InvalidSessionSettings as e:
        raise invalid_request(
            f"This conversation's settings cannot run a turn: {e}. Change them with PATCH "
            f"/v1/conversations/{conv.id}.",
            e.field,
            code="invalid_session_settings",
        ) from None


# The three below never raise, whatever a row holds (listings and the admin view read them):
# a value out of its field's range reads as unset, and a policy whose values do not fit
# together reads as the defaults' policy. A turn refuses such a row first (check_settings).


def history_policy(state: AppState, conv: ConversationRecord) -> HistoryPolicy:
    default = state.defaults
    try:
        return HistoryPolicy(
            policy=_setting(state, conv, "history_policy"),
            high_watermark=_setting(state, conv, "high_watermark"),
            low_watermark=_setting(state, conv, "low_watermark"),
            max_tool_result_tokens=_setting(state, conv, "max_tool_result_tokens"),
            max_summary_tokens=_setting(state, conv, "max_summary_tokens"),
        )
    except HistoryPolicyError:
        return HistoryPolicy(
            policy=default.history_policy,
            high_watermark=default.high_watermark,
            low_watermark=default.low_watermark,
            max_tool_result_tokens=default.max_tool_result_tokens,
            max_summary_tokens=default.max_summary_tokens,
        )


def context_budget(state: AppState, conv: ConversationRecord) -> int:
    return resolve_context_budget(
        _setting(state, conv, "max_context_tokens"), state.runtime.max_model_len
    )


def session_budget(state: AppState, conv: ConversationRecord) -> SessionBudget:
    """The engine-side budget of the conversation's session, set before each of its turns
    (an operator's change applies at the next turn)."""
    return SessionBudget(
        max_kv_tokens=_setting(state, conv, "max_kv_tokens"),
        max_context_tokens=context_budget(state, conv),
    )


def _setting(state: AppState, conv: ConversationRecord, name: str) -> Any:
    value = getattr(conv, name)
    if value is None or not setting_in_range(name, value):
        return getattr(state.defaults, name)
    return value


def turn_system(conv: ConversationRecord, instructions: str | None) -> str | None:
    """The system prompt of a turn: its own `instructions` (the Responses API's, for that
    turn only) when given, else the conversation's."""
    return instructions if instructions is not None else conv.system_prompt


def as_chat(message: MessageRecord) -> ChatMessage:
    """A stored message as the template renders it: a generated reply by its exact ids (its
    calls go along, so the history planner pairs them with their results; the template does
    not render them again)."""
    tool_calls = tuple(message.tool_calls) if message.tool_calls else None
    if message.role == "assistant" and message.token_ids:
        return ChatMessage(
            "assistant", None, token_ids=tuple(message.token_ids), tool_calls=tool_calls
        )
    return ChatMessage(
        message.role,
        message.content,
        name=message.name,
        tool_calls=tool_calls,
        tool_call_id=message.tool_call_id,
    )


def usable(branch: Sequence[MessageRecord]) -> list[MessageRecord]:
    """The branch as history: replies that were interrupted or failed before producing
    anything are left out."""
    return [
        m
        for m in branch
        if m.role != "assistant"
        or (m.status in USABLE and (m.token_ids or m.content or m.tool_calls))
    ]


async def prepare_turn(
    state: AppState,
    conv: ConversationRecord,
    fields: SamplingFields,
    *,
    new_message: ChatMessage | None,
    parent_id: str | None,
    instructions: str | None = None,
    truncation: bool = True,
) -> PreparedTurn:
    """Plan a turn (the caller holds the conversation's turn lock). `new_message` None
    regenerates the reply to `parent_id` (a user or tool message). Raises the request's
    errors (APIError, the planner's and the engine's) before anything is stored.

    `instructions`: this turn's system prompt in place of the conversation's (not stored).
    `truncation` False: the whole branch must fit the budget, or ContextLengthExceeded
    (the Responses API's `truncation: "disabled"`); True plans under the history policy.

    The branch is read in one query, or not at all when this process ran the conversation's
    last turn and its tree has not changed since (BranchCache); everything CPU-bound (tools
    and schemas, the new message's segment, the plan, the prompt's ids, the engine's checks)
    runs on the runtime's worker threads, never on the event loop."""
    runtime, store = state.runtime, state.store
    check_settings(state, conv)
    parent = (
        conv.current_leaf_id if parent_id is None else (None if parent_id == ROOT else parent_id)
    )
    known = state.turns.branches.get(conv, parent)
    if known is not None:  # nothing changed since this process's last turn here
        stored, summary_record = known
    else:
        stored, summary_record = await store.turn_context(conv.id, parent)
    if parent is not None and not stored:
        raise not_found(f"message {parent!r}", "parent_id")
    branch = usable(stored)
    if new_message is None and (not branch or branch[-1].role not in ("user", "tool")):
        raise invalid_request(
            "regenerating needs parent_id to name a user or tool message", "parent_id"
        )
    chat = [as_chat(m) for m in branch]
    if any(m.num_tokens is None for m in branch):  # stored before counts existed: once
        tools = await runtime.run_cpu(offered_tools, fields)
        measured = await runtime.run_cpu(
            runtime.builder.count, turn_system(conv, instructions), chat, tools, branch_key(conv.id)
        )
        for m, c in zip(branch, measured):
            if m.num_tokens is None:
                await store.update_message(
                    m.id, num_tokens=c.num_tokens, content_tokens=c.content_tokens
                )
        branch = [
            m if m.num_tokens is not None else _with_counts(m, c.num_tokens, c.content_tokens)
            for m, c in zip(branch, measured)
        ]
    summary = (
        SummaryState(summary_record.text, summary_record.num_tokens, tuple(summary_record.covers))
        if summary_record is not None
        else None
    )
    prepared = await runtime.run_cpu(
        _plan,
        state,
        conv,
        fields,
        branch,
        chat,
        new_message,
        summary,
        parent,
        instructions,
        truncation,
    )
    check_capacity(state)
    return replace(prepared, path=tuple(stored), summary_record=summary_record)


def _plan(
    state: AppState,
    conv: ConversationRecord,
    fields: SamplingFields,
    branch: list[MessageRecord],
    chat: list[ChatMessage],
    new_message: ChatMessage | None,
    summary: SummaryState | None,
    parent: str | None,
    instructions: str | None = None,
    truncation: bool = True,
) -> PreparedTurn:
    """The CPU-bound part of prepare_turn (a worker thread runs it): the request's tools and
    schema, then the one planning step (inference.turn_planner), then the engine's checks."""
    runtime = state.runtime
    tools = offered_tools(fields)
    tool_names = {t.function.name for t in fields.tools} if fields.tools else None
    tool_format = runtime.template.tool_call_format if tools else None
    grammar = output_grammar(fields, tool_format, runtime.grammars)
    policy = history_policy(state, conv)
    start_id = conv.trim_start_id
    if not truncation:  # the whole branch, or nothing: plan without trimming, cuts, summary
        policy = replace(policy, policy="drop", high_watermark=1.0, max_tool_result_tokens=None)
        start_id, summary = None, None
    system = turn_system(conv, instructions)
    budget = context_budget(state, conv)
    planned = plan_turn(
        runtime.builder,
        system=system,
        branch=[(m.id, c, _counts(m)) for m, c in zip(branch, chat)],
        new_message=new_message,
        tools=tools,
        policy=policy,
        max_context_tokens=budget,
        requested_max_tokens=fields.reply_budget,
        default_max_tokens=state.settings.default_max_tokens,
        summary=summary,
        start_id=start_id,
        generation_prompt_tokens=runtime.generation_prompt_tokens,
        conversation=conv.id,
    )
    if not truncation and planned.plan.dropped:
        whole = (
            runtime.builder.system_tokens(system, tools=tools)
            + sum(m.num_tokens or 0 for m in branch)
            + runtime.generation_prompt_tokens
            + (planned.new_counts.num_tokens if planned.new_counts else 0)
        )
        raise ContextLengthExceeded(whole + planned.max_tokens, budget, planned.max_tokens)
    params = sampling_params(fields, max_tokens=planned.max_tokens, grammar=grammar)
    request = runtime.engine.check_request(
        planned.prompt_ids, params, session_id=conv.id, budget=session_budget(state, conv)
    )
    user_fields = None
    new_counts = planned.new_counts
    if new_message is not None and new_counts is not None:
        user_fields = dict(
            role=new_message.role,
            content=new_message.content,
            name=new_message.name,
            tool_call_id=new_message.tool_call_id,
            num_tokens=new_counts.num_tokens,
            content_tokens=new_counts.content_tokens,
        )
    return PreparedTurn(
        conversation=conv,
        request=request,
        plan=planned.plan,
        policy=policy,
        branch=branch,
        chat=chat,
        new_message=new_message,
        user_fields=user_fields,
        reply_parent_id=parent if user_fields is not None else branch[-1].id,
        tools=tools,
        tool_format=tool_format,
        tool_names=tool_names,
        instructions=instructions,
    )


def reply_counts(
    state: AppState,
    prepared: PreparedTurn,
    token_ids: Sequence[int],
    tool_calls: Sequence[dict[str, Any]] | None,
) -> MessageCounts:
    """The stored reply's token counts (its segment as the next turn renders it); CPU-bound,
    for a worker thread. The reply is the message as_chat() will make of it next turn, so
    the branch's kept render extends."""
    chat = [*prepared.chat, *([prepared.new_message] if prepared.new_message else [])]
    reply = ChatMessage(
        "assistant",
        None,
        token_ids=tuple(token_ids),
        tool_calls=tuple(tool_calls) if tool_calls else None,
    )
    return state.runtime.builder.count_last(
        prepared.system, [*chat, reply], prepared.tools, branch_key(prepared.conversation.id)
    )


def _with_counts(m: MessageRecord, num_tokens: int, content_tokens: int) -> MessageRecord:
    return replace(m, num_tokens=num_tokens, content_tokens=content_tokens)


def _counts(m: MessageRecord) -> MessageCounts:
    return MessageCounts(m.num_tokens or 0, m.content_tokens or 0)


MAX_UNSUMMARIZED = 4096  # conversations whose last summary job could not make one, remembered


def summary_job(
    state: AppState,
    conv: ConversationRecord,
    policy: HistoryPolicy,
    plan: ContextPlan,
    branch: list[MessageRecord],
    chat: list[ChatMessage],
) -> Any:
    """What to run after the turn when the plan dropped messages no summary covers yet
    (history.summary_targets decides which)."""
    if policy.policy != "summarize":
        return None
    previous, newly = summary_targets(plan)
    by_id = {m.id: c for m, c in zip(branch, chat)}
    if not newly or any(i not in by_id for i in newly):
        return None
    inputs = (previous.covers if previous is not None else (), tuple(newly))
    if state.turns.unsummarized.get(conv.id) == inputs:
        return None  # the same inputs made no summary last time (none would fit its share)

    async def job() -> None:
        held = await state.turns.locks.acquire(f"summary:{conv.id}", purpose="summary")
        if not isinstance(held, HeldLock):
            return  # a summary of this conversation is already being made
        try:
            await summarize(state, conv, policy, previous, list(newly), by_id)
        except Exception:
            log.exception("summary of %s failed", conv.id)
        finally:
            await held.release()

    return job


async def summarize(
    state: AppState,
    conv: ConversationRecord,
    policy: HistoryPolicy,
    previous: SummaryState | None,
    newly: list[str],
    by_id: dict[str, ChatMessage],
) -> None:
    """Fold the newly dropped messages (and the previous summary) into a new running summary
    and store it (history.summaries: the model's, if it keeps what it covers, else the
    extract); `by_id` holds the branch's messages."""
    messages = [by_id[i] for i in newly]
    runtime = state.runtime
    builder = runtime.builder
    # Within its share of the budget, so the summary that lands fits beside the next turns.
    budget = context_budget(state, conv)
    max_tokens = await runtime.run_cpu(
        builder.summary_max_tokens, conv.system_prompt, policy, budget
    )
    if max_tokens < 1:
        return  # the budget leaves no room for a summary
    generated: str | None = None
    cut_by_length, num_generated = False, 0
    if state.settings.summarizer == "model":
        prompt = await runtime.run_cpu(
            builder.summarization_prompt, previous.text if previous else None, messages
        )
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        async for out in runtime.async_engine.generate(
            f"summary-{uuid.uuid4().hex}",
            runtime.engine.check_request(prompt, params),
            cache_salt=conv.owner,
            priority=PRIORITY_LOW,
        ):
            if out.finished:
                generated, num_generated = out.text or "", out.num_output_tokens
                cut_by_length = out.finish_reason == "length"
    covers = previous.covers if previous is not None else ()
    earlier = [(i, by_id[i]) for i in covers] if all(i in by_id for i in covers) else None
    settled = await runtime.run_cpu(
        builder.settle_summary,
        conv.system_prompt,
        previous,
        list(zip(newly, messages)),
        generated,
        cut_by_length,
        policy.summary_share_tokens(budget),
        earlier,
    )
    unsummarized = state.turns.unsummarized
    unsummarized.pop(conv.id, None)
    if settled is None:  # not one more message fits the summary's share
        unsummarized[conv.id] = (covers, tuple(newly))
        while len(unsummarized) > MAX_UNSUMMARIZED:
            unsummarized.popitem(last=False)
        return
    if settled.defect is not None:
        log.info("summary of %s extracted: the generated one %s", conv.id, settled.defect)
    merged = settled.state
    try:
        await state.store.add_summary(
            conv.id, text=merged.text, num_tokens=merged.num_tokens, covers=list(merged.covers)
        )
    except LookupError:  # deleted while its summary was being made: nothing left to keep
        log.debug("summary of %s dropped: the conversation was deleted", conv.id)
        return
    runtime.history.record(
        conv.id,
        HistoryStats(
            summaries=1,
            summary_tokens=num_generated,
            summaries_extracted=int(settled.extracted),
        ),
    )
