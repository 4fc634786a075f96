"""The planning step of a conversation's turn: the branch read from the store, the context
planned under the conversation's budget and history policy (memory.history), the prompt's
ids built (generated replies spliced back by their ids), the request checked. Nothing is
stored or generated here: the turn service (app/turns/service.py) commits the turn and runs
it. Under the `summarize` policy, what the plan dropped is folded into the running summary by
a low-priority background request (`summary_job`); the next turns get it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from inference import (
    PRIORITY_LOW,
    ChatMessage,
    CheckedRequest,
    MessageCounts,
    SamplingParams,
    history_message,
)
from memory import (
    ContextPlan,
    HistoryPolicy,
    HistoryPolicyError,
    HistoryStats,
    SessionBudget,
    SummaryState,
    plan_context,
)

from app.coord.locks import HeldLock
from app.errors import invalid_request, not_found, unavailable
from app.turns.prompting import offered_tools, sampling_params
from app.turns.structured import output_grammar
from app.schemas.chat import SamplingFields
from app.schemas.conversations import (
    ROOT,
    InvalidSessionSettings,
    check_session_settings,
    setting_in_range,
)
from app.state import AppState
from app.store import NEW_USER, ConversationRecord, MessageRecord

log = logging.getLogger(__name__)

NEW = "__new__"  # the planner's id for the message being added
USABLE = ("complete", "cancelled")  # assistant replies that count as history


@dataclass(frozen=True)
class PreparedTurn:
    """A planned turn, ready to be committed and run."""

    conversation: ConversationRecord
    request: CheckedRequest  # the prompt and its sampling, checked once (engine.check_request)
    plan: ContextPlan
    policy: HistoryPolicy
    summary: SummaryState | None
    branch: list[MessageRecord]  # the usable history, oldest first
    chat: list[ChatMessage]  # the branch as the template renders it
    new_message: ChatMessage | None  # None: a regenerate
    user_fields: dict[str, Any] | None  # the new message as the store takes it
    reply_parent_id: str | None  # where the user message (or, regenerating, the reply) goes
    tools: list[dict[str, Any]] | None
    tool_format: str | None
    tool_names: set[str] | None

    @property
    def system(self) -> str | None:
        return self.conversation.system_prompt

    @property
    def trim_start_id(self) -> str | None:
        return NEW_USER if self.plan.start_id == NEW else self.plan.start_id

    @property
    def history_stats(self) -> HistoryStats:
        plan = self.plan
        return HistoryStats(trims=int(plan.trimmed), dropped_tokens=plan.num_dropped_tokens,
                            tool_results_capped=len(plan.capped))

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
            f"/v1/conversations/{conv.id}.", e.field, code="invalid_session_settings",
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
            policy=default.history_policy, high_watermark=default.high_watermark,
            low_watermark=default.low_watermark,
            max_tool_result_tokens=default.max_tool_result_tokens,
            max_summary_tokens=default.max_summary_tokens,
        )


def context_budget(state: AppState, conv: ConversationRecord) -> int:
    limit = state.runtime.max_model_len
    budget = _setting(state, conv, "max_context_tokens")
    return min(limit, budget) if budget else limit


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


def as_chat(message: MessageRecord) -> ChatMessage:
    """A stored message as the template renders it: a generated reply by its exact ids (its
    calls go along, so the history planner pairs them with their results; the template does
    not render them again)."""
    tool_calls = tuple(message.tool_calls) if message.tool_calls else None
    if message.role == "assistant" and message.token_ids:
        return ChatMessage("assistant", None, token_ids=tuple(message.token_ids),
                           tool_calls=tool_calls)
    return ChatMessage(
        message.role, message.content, name=message.name, tool_calls=tool_calls,
        tool_call_id=message.tool_call_id,
    )


def usable(branch: Sequence[MessageRecord]) -> list[MessageRecord]:
    """The branch as history: replies that were interrupted or failed before producing
    anything are left out."""
    return [
        m for m in branch
        if m.role != "assistant" or (m.status in USABLE and (m.token_ids or m.content
                                                             or m.tool_calls))
    ]


async def prepare_turn(
    state: AppState,
    conv: ConversationRecord,
    fields: SamplingFields,
    *,
    new_message: ChatMessage | None,
    parent_id: str | None,
) -> PreparedTurn:
    """Plan a turn (the caller holds the conversation's turn lock). `new_message` None
    regenerates the reply to `parent_id` (a user or tool message). Raises the request's
    errors (APIError, the planner's and the engine's) before anything is stored."""
    runtime, store = state.runtime, state.store
    check_settings(state, conv)
    tools = offered_tools(fields)
    tool_names = {t.function.name for t in fields.tools} if fields.tools else None
    tool_format = runtime.template.tool_call_format if tools else None
    grammar = output_grammar(fields, tool_format, runtime.grammars)
    parent = conv.current_leaf_id if parent_id is None else (None if parent_id == ROOT
                                                             else parent_id)
    stored, summary_record = await store.turn_context(conv.id, parent)
    if parent is not None and not stored:
        raise not_found(f"message {parent!r}", "parent_id")
    branch = usable(stored)
    if new_message is None and (not branch or branch[-1].role not in ("user", "tool")):
        raise invalid_request(
            "regenerating needs parent_id to name a user or tool message", "parent_id"
        )
    chat = [as_chat(m) for m in branch]
    system = conv.system_prompt
    builder = runtime.builder
    counts = {m.id: m for m in branch if m.num_tokens is not None}
    if len(counts) != len(branch):  # stored before counts existed: measure the branch once
        measured = builder.count(system, chat, tools=tools)
        for m, c in zip(branch, measured):
            await store.update_message(m.id, num_tokens=c.num_tokens,
                                       content_tokens=c.content_tokens)
        branch = [
            m if m.num_tokens is not None else _with_counts(m, c.num_tokens, c.content_tokens)
            for m, c in zip(branch, measured)
        ]
    history = [
        history_message(m.id, chat_m, _counts(m)) for m, chat_m in zip(branch, chat)
    ]
    new_counts = None
    if new_message is not None:
        new_counts = builder.count(system, [*chat, new_message], tools=tools)[-1]
        history.append(history_message(NEW, new_message, new_counts))

    policy = history_policy(state, conv)
    budget = context_budget(state, conv)
    reply_budget = fields.reply_budget or min(state.settings.default_max_tokens, budget // 4)
    summary = (
        SummaryState(summary_record.text, summary_record.num_tokens, tuple(summary_record.covers))
        if summary_record is not None else None
    )
    plan = plan_context(
        messages=history,
        system_tokens=builder.system_tokens(system, tools=tools),
        max_context_tokens=budget,
        max_tokens=reply_budget,
        policy=policy,
        summary=summary,
        start_id=conv.trim_start_id,
        generation_prompt_tokens=runtime.generation_prompt_tokens,
    )
    params = sampling_params(fields, max_tokens=reply_budget, grammar=grammar)
    by_id: dict[str, ChatMessage] = {m.id: c for m, c in zip(branch, chat)}
    if new_message is not None:
        by_id[NEW] = new_message
    prompt = builder.build(system, by_id, plan, tools=tools)
    request = runtime.engine.check_request(prompt, params, session_id=conv.id,
                                           budget=session_budget(state, conv))
    if runtime.num_waiting >= state.settings.max_queued_requests:
        raise unavailable("The server is at capacity (too many queued requests).", 2)
    user_fields = None
    if new_message is not None and new_counts is not None:
        user_fields = dict(
            role=new_message.role, content=new_message.content, name=new_message.name,
            tool_call_id=new_message.tool_call_id, num_tokens=new_counts.num_tokens,
            content_tokens=new_counts.content_tokens,
        )
    return PreparedTurn(
        conversation=conv, request=request, plan=plan, policy=policy,
        summary=summary, branch=branch, chat=chat, new_message=new_message,
        user_fields=user_fields,
        reply_parent_id=parent if user_fields is not None else branch[-1].id,
        tools=tools, tool_format=tool_format, tool_names=tool_names,
    )


def reply_counts(
    state: AppState, prepared: PreparedTurn, token_ids: Sequence[int]
) -> MessageCounts:
    """The stored reply's token counts (its segment as the next turn renders it)."""
    chat = [*prepared.chat, *([prepared.new_message] if prepared.new_message else [])]
    reply = ChatMessage("assistant", None, token_ids=tuple(token_ids))
    return state.runtime.builder.count(prepared.system, [*chat, reply],
                                       tools=prepared.tools)[-1]


def _with_counts(m: MessageRecord, num_tokens: int, content_tokens: int) -> MessageRecord:
    from dataclasses import replace

    return replace(m, num_tokens=num_tokens, content_tokens=content_tokens)


def _counts(m: MessageRecord) -> MessageCounts:
    return MessageCounts(m.num_tokens or 0, m.content_tokens or 0)


def summary_job(
    state: AppState,
    conv: ConversationRecord,
    policy: HistoryPolicy,
    plan: ContextPlan,
    branch: list[MessageRecord],
    chat: list[ChatMessage],
    summary: SummaryState | None,
) -> Any:
    """What to run after the turn when the plan dropped messages no summary covers yet."""
    if policy.policy != "summarize" or not plan.to_summarize:
        return None
    covered = summary.covers if summary is not None else ()
    by_id = {m.id: c for m, c in zip(branch, chat)}
    newly = [i for i in plan.to_summarize if i in by_id]
    if not newly or plan.dropped[: len(covered)] != covered:
        return None

    async def job() -> None:
        held = await state.turns.locks.acquire(f"summary:{conv.id}", purpose="summary")
        if not isinstance(held, HeldLock):
            return  # a summary of this conversation is already being made
        try:
            await summarize(state, conv, policy, summary, newly, [by_id[i] for i in newly])
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
    messages: list[ChatMessage],
) -> None:
    runtime = state.runtime
    prompt = runtime.builder.summarization_prompt(previous.text if previous else None, messages)
    params = SamplingParams(max_tokens=policy.max_summary_tokens, temperature=0.0)
    text, num_generated = "", 0
    async for out in runtime.async_engine.generate(
        f"summary-{uuid.uuid4().hex}", runtime.engine.check_request(prompt, params),
        cache_salt=conv.owner, priority=PRIORITY_LOW,
    ):
        if out.finished:
            text, num_generated = (out.text or "").strip(), out.num_output_tokens
    covers = [*(previous.covers if previous else ()), *newly]
    measured = runtime.builder.summary_state(conv.system_prompt, text, covers)
    try:
        await state.store.add_summary(conv.id, text=text, num_tokens=measured.num_tokens,
                                      covers=list(covers))
    except LookupError:  # deleted while its summary was being made: nothing left to keep
        log.debug("summary of %s dropped: the conversation was deleted", conv.id)
        return
    runtime.history.record(conv.id, HistoryStats(summaries=1, summary_tokens=num_generated))
