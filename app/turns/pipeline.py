"""The planning step of a conversation's turn (TurnPlanner): the branch read from the store
(token counts of messages stored before counts existed are written back, once), the context
planned under the conversation's budget and history policy (the history package), the prompt's
ids built (generated replies spliced back by their ids), the request checked. The turn itself
is committed and run by the turn service (app/turns/service.py). Under the `summarize` policy,
what the plan dropped is folded into the running summary by a low-priority background request
(`summary_job`), which stores it; the next turns get it.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvchat.app.coord.locks import HeldLock, Locks
from kvchat.app.errors import invalid_request, not_found
from kvchat.app.ops.limits import Limits
from kvchat.app.runtime import Runtime
from kvchat.app.schemas.chat import SamplingFields
from kvchat.app.schemas.conversations import (
    ROOT,
    InvalidSessionSettings,
    check_session_settings,
)
from kvchat.app.session_settings import SessionSettings
from kvchat.app.settings import Settings
from kvchat.app.store import (
    NEW_USER,
    ConversationRecord,
    MessageRecord,
    Store,
    SummaryRecord,
)
from kvchat.app.turns.branches import BranchCache
from kvchat.app.turns.prompting import offered_tools
from kvchat.app.turns.requests import AnswerFallback, answer_fallback, offer, prepare_request
from kvchat.history import (
    ContextLengthExceeded,
    ContextPlan,
    HistoryPolicy,
    SummaryState,
    summary_targets,
)
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
    fallback: AnswerFallback | None
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


def _with_counts(m: MessageRecord, num_tokens: int, content_tokens: int) -> MessageRecord:
    return replace(m, num_tokens=num_tokens, content_tokens=content_tokens)


def _counts(m: MessageRecord) -> MessageCounts:
    return MessageCounts(m.num_tokens or 0, m.content_tokens or 0)


MAX_UNSUMMARIZED = 4096  # conversations whose last summary job could not make one, remembered


class TurnPlanner:
    """Plans the turns of this process's conversations, from what it is given: the store, the
    runtime (tokenizer, templates, the engine client, worker threads), the settings, the
    session defaults (operators change them at run time), the branch cache, the summary locks
    and the admission limits."""

    def __init__(
        self,
        *,
        settings: Settings,
        defaults: SessionSettings,
        store: Store,
        runtime: Runtime,
        locks: Locks,
        limits: Limits,
    ) -> None:
        self.settings = settings
        self.defaults = defaults  # of sessions that set none of their own
        self.store = store
        self.runtime = runtime
        self.locks = locks
        self.limits = limits
        self.branches = BranchCache()
        # Conversation id -> the (covered, newly dropped) ids its last summary job could not
        # fold into a summary: the same job is not run again until a trim changes them.
        self.unsummarized: OrderedDict[str, tuple[tuple[str, ...], tuple[str, ...]]] = OrderedDict()

    # -- a conversation's settings ------------------------------------------------------------

    def check_settings(self, conv: ConversationRecord) -> None:
        """Refuse a turn (400 naming the field) on a conversation whose settings, over the
        defaults, make no budget and policy a turn can run: a row stored before settings were
        checked together, or by hand, or left behind by a change of the defaults."""
        try:
            check_session_settings(conv.overrides, {}, self.defaults.model_dump())
        except InvalidSessionSettings as e:
            raise invalid_request(
                f"This conversation's settings cannot run a turn: {e}. Change them with PATCH "
                f"/v1/conversations/{conv.id}.",
                e.field,
                code="invalid_session_settings",
            ) from None

    # The three below never raise, whatever a row holds (listings and the admin view read
    # them): a value out of its field's range reads as unset, and a policy whose values do not
    # fit together reads as the defaults' policy. A turn refuses such a row first.

    def session(self, conv: ConversationRecord) -> SessionSettings:
        """The settings the conversation's turns run under."""
        return self.defaults.under(conv.overrides)

    def history_policy(self, conv: ConversationRecord) -> HistoryPolicy:
        return self.session(conv).policy()

    def context_budget(self, conv: ConversationRecord) -> int:
        return self.session(conv).context_budget(self.runtime.max_model_len)

    def session_budget(self, conv: ConversationRecord) -> SessionBudget:
        """The engine-side budget of the conversation's session, sent with each of its turns
        (an operator's change applies at the next turn)."""
        return self.session(conv).budget(self.runtime.max_model_len)

    # -- a turn ---------------------------------------------------------------------------------

    async def prepare_turn(
        self,
        conv: ConversationRecord,
        fields: SamplingFields,
        *,
        new_message: ChatMessage | None,
        parent_id: str | None,
        instructions: str | None = None,
        truncation: bool = True,
        retention_ttl_s: float | None = None,
    ) -> PreparedTurn:
        """Plan a turn (the caller holds the conversation's turn lock). `new_message` None
        regenerates the reply to `parent_id` (a user or tool message). Raises the request's
        errors (APIError, the planner's and the engine's) before anything is stored.

        `instructions`: this turn's system prompt in place of the conversation's (not stored).
        `truncation` False: the whole branch must fit the budget, or ContextLengthExceeded
        (the Responses API's `truncation: "disabled"`); True plans under the history policy.
        `retention_ttl_s`: the client's retention hint, sent in the session's budget.

        The branch is read in one query, or not at all when this process ran the conversation's
        last turn and its tree has not changed since (BranchCache); everything CPU-bound (tools
        and schemas, the new message's segment, the plan, the prompt's ids, the engine's checks)
        runs on the runtime's worker threads, never on the event loop."""
        runtime, store = self.runtime, self.store
        self.check_settings(conv)
        parent = (
            conv.current_leaf_id
            if parent_id is None
            else (None if parent_id == ROOT else parent_id)
        )
        known = self.branches.get(conv, parent)
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
                runtime.builder.count,
                turn_system(conv, instructions),
                chat,
                tools,
                branch_key(conv.id),
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
            SummaryState(
                summary_record.text, summary_record.num_tokens, tuple(summary_record.covers)
            )
            if summary_record is not None
            else None
        )
        prepared = await runtime.run_cpu(
            self._plan,
            conv,
            fields,
            branch,
            chat,
            new_message,
            summary,
            parent,
            instructions,
            truncation,
            retention_ttl_s,
        )
        self.limits.check_capacity()
        return replace(prepared, path=tuple(stored), summary_record=summary_record)

    def _plan(
        self,
        conv: ConversationRecord,
        fields: SamplingFields,
        branch: list[MessageRecord],
        chat: list[ChatMessage],
        new_message: ChatMessage | None,
        summary: SummaryState | None,
        parent: str | None,
        instructions: str | None = None,
        truncation: bool = True,
        retention_ttl_s: float | None = None,
    ) -> PreparedTurn:
        """The CPU-bound part of prepare_turn (a worker thread runs it): the request's tools and
        schema, then the one planning step (inference.text.turn_planner), then the engine's
        checks."""
        runtime = self.runtime
        offered = offer(runtime, fields)
        tools, tool_format = offered.tools, offered.tool_format
        policy = self.history_policy(conv)
        start_id = conv.trim_start_id
        if not truncation:  # the whole branch, or nothing: plan without trimming, cuts, summary
            policy = replace(policy, policy="drop", high_watermark=1.0, max_tool_result_tokens=None)
            start_id, summary = None, None
        system = turn_system(conv, instructions)
        budget = self.context_budget(conv)
        planned = plan_turn(
            runtime.builder,
            system=system,
            branch=[(m.id, c, _counts(m)) for m, c in zip(branch, chat)],
            new_message=new_message,
            tools=tools,
            policy=policy,
            max_context_tokens=budget,
            requested_max_tokens=fields.reply_budget,
            default_max_tokens=self.settings.default_max_tokens,
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
        request = prepare_request(
            runtime,
            fields,
            offered,
            planned.prompt_ids,
            max_tokens=planned.max_tokens,
            session_id=conv.id,
            budget=self.session_budget(conv),
            retention_ttl_s=retention_ttl_s,
        )
        turn_chat = [*chat, *([new_message] if new_message is not None else [])]
        fallback = answer_fallback(runtime, fields, offered, turn_chat, request)
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
            tool_names=offered.tool_names,
            fallback=fallback,
            instructions=instructions,
        )

    def reply_counts(
        self,
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
        return self.runtime.builder.count_last(
            prepared.system, [*chat, reply], prepared.tools, branch_key(prepared.conversation.id)
        )

    # -- the running summary ----------------------------------------------------------------

    def summary_job(
        self,
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
        if self.unsummarized.get(conv.id) == inputs:
            return None  # the same inputs made no summary last time (none would fit its share)

        async def job() -> None:
            held = await self.locks.acquire(f"summary:{conv.id}", purpose="summary")
            if not isinstance(held, HeldLock):
                return  # a summary of this conversation is already being made
            try:
                await self.summarize(conv, policy, previous, list(newly), by_id)
            except Exception:
                log.exception("summary of %s failed", conv.id)
            finally:
                await held.release()

        return job

    async def summarize(
        self,
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
        runtime = self.runtime
        builder = runtime.builder
        # Within its share of the budget, so the summary that lands fits beside the next turns.
        budget = self.context_budget(conv)
        max_tokens = await runtime.run_cpu(
            builder.summary_max_tokens, conv.system_prompt, policy, budget
        )
        if max_tokens < 1:
            return  # the budget leaves no room for a summary
        generated: str | None = None
        cut_by_length, num_generated = False, 0
        if self.settings.summarizer == "model":
            prompt = await runtime.run_cpu(
                builder.summarization_prompt, previous.text if previous else None, messages
            )
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            async for out in runtime.engine_client.generate(
                f"summary-{uuid.uuid4().hex}",
                runtime.engine_client.check(prompt, params),
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
        unsummarized = self.unsummarized
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
            await self.store.add_summary(
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
