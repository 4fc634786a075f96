"""The turn pipeline of the conversations API: store -> plan -> render -> engine -> store.

1. The user's (or tool's) message is checked, the turn planned (memory.history, under the
   conversation's budget and policy) and the message committed before anything is generated.
2. The assistant message is created as `generating`; the prompt's ids are built (generated
   replies spliced back by their ids) and run in the conversation's engine session, so its
   KV stays pinned between turns and only the new tokens are prefilled.
3. The turn runs as a task of its own, decoupled from the client: events (start, deltas, tool
   calls, done) are buffered per turn, so a client can leave and come back (`events(offset)`);
   stop ends it within one engine step. However it ends (complete, cancelled, error), the
   assistant message is updated with what was produced.
4. Under the `summarize` policy, what the plan dropped is folded into the running summary by a
   low-priority background request; the next turns get it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from inference.chat_template import ChatMessage
from inference.context_builder import history_message
from inference.sampling_params import SamplingParams
from inference.scheduler import PRIORITY_LOW
from memory.history import (
    ContextPlan,
    HistoryPolicy,
    SummaryState,
    plan_context,
)
from memory.config import SessionBudget
from memory.stats import HistoryStats

from app.errors import APIError, busy, invalid_request, not_found, unavailable
from app.turns.generation import Done, Generation, TextDelta, ToolDelta
from app.turns.prompting import offered_tools, sampling_params
from app.turns.structured import output_grammar
from app.schemas.chat import SamplingFields
from app.schemas.conversations import ROOT
from app.state import AppState
from app.store import NEW_USER, ConversationRecord, MessageRecord

log = logging.getLogger(__name__)

NEW = "__new__"  # the planner's id for the message being added
LOCK_TTL = 3600.0
USABLE = ("complete", "cancelled")  # assistant replies that count as history


# -- events a turn produces (the WebSocket frames and the SSE events of the conversations API) --


@dataclass(frozen=True)
class TurnEvent:
    type: str  # start | delta | tool_call | done | error
    data: dict[str, Any]

    def frame(self) -> dict[str, Any]:
        return {"type": self.type, **self.data}


@dataclass
class Turn:
    """One reply being generated for a conversation."""

    conversation_id: str
    owner: str
    user_message: MessageRecord | None
    assistant_message: MessageRecord
    generation: Generation
    events_log: list[TurnEvent] = field(default_factory=list)
    text_sent: int = 0  # characters of deltas so far (the offset of the next delta)
    final: MessageRecord | None = None
    task: asyncio.Task[None] | None = None
    # Also buffered elsewhere (Redis Streams when configured), for a client of another process.
    on_event: Any = None
    watchers: int = 0  # sockets streaming this turn right now
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def publish(self, event: TurnEvent) -> None:
        self.events_log.append(event)
        self._changed.set()
        if self.on_event is not None:
            self.on_event(self, event)

    @property
    def is_done(self) -> bool:
        return bool(self.events_log) and self.events_log[-1].type in ("done", "error")

    def stop(self) -> None:
        self.generation.stop()

    async def events(self, offset: int = 0) -> AsyncIterator[TurnEvent]:
        """Every event of the turn, live. With `offset` (characters of text already seen), the
        start event is skipped and text before the offset is not sent again."""
        index, seen = 0, 0
        while True:
            while index < len(self.events_log):
                event = self.events_log[index]
                index += 1
                if event.type == "start" and offset:
                    continue
                if event.type == "delta":
                    text = event.data["text"]
                    start = event.data["offset"]
                    seen = start + len(text)
                    if seen <= offset:
                        continue
                    if start < offset:
                        event = TurnEvent("delta", {**event.data, "text": text[offset - start :],
                                                    "offset": offset})
                yield event
                if event.type in ("done", "error"):
                    return
            self._changed.clear()
            if index < len(self.events_log):
                continue
            await self._changed.wait()

    async def wait(self) -> MessageRecord:
        async for _ in self.events():
            pass
        assert self.final is not None
        return self.final


# -- the pipeline ----------------------------------------------------------------------------


def history_policy(state: AppState, conv: ConversationRecord) -> HistoryPolicy:
    default = state.defaults
    return HistoryPolicy(
        policy=conv.history_policy or default.history_policy,
        high_watermark=_pick(conv.high_watermark, default.high_watermark),
        low_watermark=_pick(conv.low_watermark, default.low_watermark),
        max_tool_result_tokens=_pick(conv.max_tool_result_tokens, default.max_tool_result_tokens),
        max_summary_tokens=_pick(conv.max_summary_tokens, default.max_summary_tokens),
    )


def context_budget(state: AppState, conv: ConversationRecord) -> int:
    limit = state.runtime.max_model_len
    budget = _pick(conv.max_context_tokens, state.defaults.max_context_tokens)
    return min(limit, budget) if budget else limit


def session_budget(state: AppState, conv: ConversationRecord) -> SessionBudget:
    """The engine-side budget of the conversation's session, set before each of its turns
    (an operator's change applies at the next turn)."""
    return SessionBudget(
        max_kv_tokens=_pick(conv.max_kv_tokens, state.defaults.max_kv_tokens),
        max_context_tokens=context_budget(state, conv),
    )


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


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


async def start_turn(
    state: AppState,
    owner: str,
    conv: ConversationRecord,
    fields: SamplingFields,
    *,
    new_message: ChatMessage | None,
    parent_id: str | None,
    key_id: str | None = None,
) -> Turn:
    """Plan and start a turn (the caller holds the conversation's turn lock). `new_message`
    None regenerates the reply to `parent_id` (a user or tool message)."""
    runtime, store = state.runtime, state.store
    runtime.engine.set_session_budget(conv.id, session_budget(state, conv))
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
    runtime.engine.validate_prompt(prompt, params)
    if runtime.num_waiting >= state.settings.max_queued_requests:
        raise unavailable("The server is at capacity (too many queued requests).", 2)

    # Committed before anything is generated: what the user sent is never lost.
    user_fields = None
    if new_message is not None and new_counts is not None:
        user_fields = dict(
            role=new_message.role, content=new_message.content, name=new_message.name,
            tool_call_id=new_message.tool_call_id, num_tokens=new_counts.num_tokens,
            content_tokens=new_counts.content_tokens,
        )
    user, assistant = await store.start_reply(
        conv.id, parent_id=parent if user_fields is not None else branch[-1].id,
        user=user_fields, trim_start_id=NEW_USER if plan.start_id == NEW else plan.start_id,
    )
    reply_parent = assistant.parent_id
    runtime.engine.record_history(conv.id, HistoryStats(
        trims=int(plan.trimmed), dropped_tokens=plan.num_dropped_tokens,
        tool_results_capped=len(plan.capped),
    ))
    generation = Generation(
        runtime, prompt, params, session_id=conv.id, cache_salt=owner,
        tool_format=tool_format, tool_names=tool_names, request_id=f"turn-{assistant.id}",
        on_finish=_spend(state, key_id),
    )
    turn = Turn(conv.id, owner, user, assistant, generation)
    if state.coord.name != "local":
        turn.on_event = _buffer_in(state)
    turn.publish(TurnEvent("start", {"message_id": assistant.id, "parent_id": reply_parent}))
    summary_job = _summary_job(state, conv, policy, plan, branch, chat, summary)
    turn.task = asyncio.ensure_future(_run(state, turn, [*chat] + ([new_message] if new_message
                                                                  else []), system, tools,
                                           summary_job))
    return turn


EVENTS_TTL = 3600.0


def events_stream(message_id: str) -> str:
    return f"reply:{message_id}"


def _buffer_in(state: AppState) -> Any:
    """Copy a turn's events to the coordination back end, in order (one task per turn)."""
    queues: dict[str, asyncio.Queue[TurnEvent | None]] = {}

    def on_event(turn: Turn, event: TurnEvent) -> None:
        name = events_stream(turn.assistant_message.id)
        queue = queues.get(name)
        if queue is None:
            queue = queues[name] = asyncio.Queue()

            async def drain() -> None:
                while (item := await queue.get()) is not None:
                    try:
                        await state.coord.append_event(name, item.frame(), EVENTS_TTL)
                    except Exception:
                        log.exception("buffering a reply's event failed")
                    if item.type in ("done", "error"):
                        queues.pop(name, None)
                        return

            state.spawn(drain())
        queue.put_nowait(event)

    return on_event


def _spend(state: AppState, key_id: str | None) -> Any:
    """Count a finished generation's tokens against its key's tokens-per-minute limit."""
    if key_id is None:
        return None

    def finished(result: Any) -> None:
        from app.ops.limits import spend_tokens

        state.spawn(spend_tokens(state, key_id, result.prompt_tokens + result.completion_tokens))

    return finished


def _with_counts(m: MessageRecord, num_tokens: int, content_tokens: int) -> MessageRecord:
    from dataclasses import replace

    return replace(m, num_tokens=num_tokens, content_tokens=content_tokens)


def _counts(m: MessageRecord) -> Any:
    from inference.context_builder import MessageCounts

    return MessageCounts(m.num_tokens or 0, m.content_tokens or 0)


async def _run(
    state: AppState,
    turn: Turn,
    chat: list[ChatMessage],
    system: str | None,
    tools: list[dict[str, Any]] | None,
    summary_job: Any,
) -> None:
    """Generate, publish events, store the reply however the generation ends."""
    store = state.store
    result = None
    error: BaseException | None = None
    try:
        async for event in turn.generation.events():
            if isinstance(event, TextDelta) and event.text:
                turn.publish(TurnEvent("delta", {
                    "message_id": turn.assistant_message.id, "text": event.text,
                    "offset": turn.text_sent,
                }))
                turn.text_sent += len(event.text)
            elif isinstance(event, ToolDelta):
                turn.publish(TurnEvent("tool_call", {
                    "message_id": turn.assistant_message.id, "index": event.index,
                    "id": event.id, "name": event.name, "arguments": event.arguments,
                }))
            elif isinstance(event, Done):
                result = event.result
    except asyncio.CancelledError:
        turn.generation.stop()
        error = None
        raise
    except Exception as e:  # the engine died mid-turn: store what there is
        log.exception("turn failed")
        error = e
    finally:
        result = result or turn.generation.result
        fields: dict[str, Any] = dict(
            content=(result.content if result.content is not None else result.text)
            if result.token_ids else None,
            token_ids=result.token_ids or None,
            tool_calls=[
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in result.tool_calls
            ] or None,
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            cached_tokens=result.cached_tokens,
            ttft_ms=result.ttft_ms,
            total_ms=result.total_ms,
        )
        if error is not None:
            fields.update(status="error", error=str(error))
        elif result.finish_reason == "cancelled":
            fields["status"] = "interrupted" if result.abort_reason == "shutdown" else "cancelled"
        else:
            fields["status"] = "complete"
        if result.token_ids:
            reply = ChatMessage("assistant", None, token_ids=tuple(result.token_ids))
            counts = state.runtime.builder.count(system, [*chat, reply], tools=tools)[-1]
            fields.update(num_tokens=counts.num_tokens, content_tokens=counts.content_tokens)
        final = await asyncio.shield(store.update_message(turn.assistant_message.id, **fields))
        turn.final = final
        if error is not None:
            turn.publish(TurnEvent("error", {"code": "engine_error", "message": str(error),
                                             "message_id": final.id}))
        else:
            turn.publish(TurnEvent("done", done_frame(final)))
        if summary_job is not None and error is None:
            state.spawn(summary_job())


def done_frame(message: MessageRecord) -> dict[str, Any]:
    prompt = message.prompt_tokens or 0
    completion = message.completion_tokens or 0
    reason = message.finish_reason
    return {
        "message_id": message.id,
        "finish_reason": "cancelled" if reason == "cancelled" else reason,
        "status": message.status,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion,
                  "cached_tokens": message.cached_tokens or 0},
        "timings": {"ttft_ms": message.ttft_ms, "total_ms": message.total_ms},
    }


def _summary_job(
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
        key = f"summary:{conv.id}"
        token = uuid.uuid4().hex
        if not await state.coord.try_lock(key, token, LOCK_TTL):
            return  # a summary of this conversation is already being made
        try:
            await summarize(state, conv, policy, summary, newly, [by_id[i] for i in newly])
        except Exception:
            log.exception("summary of %s failed", conv.id)
        finally:
            await state.coord.unlock(key, token)

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
    # Within its share of the budget, so the summary that lands fits beside the next turns.
    budget = context_budget(state, conv)
    max_tokens = runtime.builder.summary_max_tokens(conv.system_prompt, policy, budget)
    if max_tokens < 1:
        return  # the budget leaves no room for a summary
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    text, num_generated = "", 0
    async for out in runtime.async_engine.generate(
        f"summary-{uuid.uuid4().hex}", prompt, params, cache_salt=conv.owner,
        priority=PRIORITY_LOW,
    ):
        if out.finished:
            text, num_generated = (out.text or "").strip(), out.num_output_tokens
    covers = [*(previous.covers if previous else ()), *newly]
    measured = runtime.builder.summary_state(conv.system_prompt, text, covers,
                                             max_num_tokens=policy.summary_share_tokens(budget))
    await state.store.add_summary(conv.id, text=measured.text, num_tokens=measured.num_tokens,
                                  covers=list(covers))
    runtime.engine.record_history(conv.id, HistoryStats(summaries=1,
                                                        summary_tokens=num_generated))


# -- locks -------------------------------------------------------------------------------------


async def lock_conversation(state: AppState, conversation_id: str) -> str:
    """Take the conversation's turn lock; 409 when a turn is already running."""
    token = uuid.uuid4().hex
    if not await state.coord.try_lock(f"turn:{conversation_id}", token, LOCK_TTL):
        raise busy("A reply is already being generated in this conversation; wait for it or "
                   "stop it.")
    return token


async def unlock_conversation(state: AppState, conversation_id: str, token: str) -> None:
    await state.coord.unlock(f"turn:{conversation_id}", token)


async def run_turn_holding_lock(state: AppState, turn: Turn, token: str) -> None:
    """Keep the turn findable and stoppable (from any process) while it runs; when it ends,
    release the conversation's lock and hold the lease on its pinned session."""
    state.turns[turn.conversation_id] = turn
    unsubscribe = await state.coord.subscribe_stop(turn.conversation_id,
                                                   lambda _: turn.stop())

    async def release() -> None:
        try:
            assert turn.task is not None
            await asyncio.shield(turn.task)
        except BaseException:
            pass
        finally:
            unsubscribe()
            if state.turns.get(turn.conversation_id) is turn:
                del state.turns[turn.conversation_id]
            await unlock_conversation(state, turn.conversation_id, token)
            if state.leases is not None:
                await state.leases.hold(turn.conversation_id)

    state.spawn(release())


def now_ms(start: float) -> float:
    return (time.monotonic() - start) * 1e3


# -- posting a message (idempotency, the lock, the turn) ------------------------------------------

IDEMPOTENCY_TTL = 24 * 3600.0


def fingerprint(body: dict[str, Any]) -> str:
    import hashlib
    import json

    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Replayed:
    """The stored result of an earlier request with the same Idempotency-Key."""

    message: dict[str, Any]


async def post_turn(
    state: AppState,
    owner: str,
    conversation_id: str,
    fields: SamplingFields,
    *,
    new_message: ChatMessage | None,
    parent_id: str | None,
    idempotency_key: str | None,
    raw_body: dict[str, Any],
    key_id: str | None = None,
) -> Turn | Replayed:
    """Start a turn in a conversation, or replay the first result of a retried request."""
    conv = await state.store.get_conversation(owner, conversation_id)
    if conv is None:
        raise not_found(f"conversation {conversation_id!r}")
    idem = None
    if idempotency_key is not None:
        if not 1 <= len(idempotency_key) <= 255:
            raise invalid_request("Idempotency-Key must be 1-255 characters", "Idempotency-Key")
        idem = f"idem:{owner}:{conversation_id}:{idempotency_key}"
        digest = fingerprint(raw_body)
        first = await state.coord.idempotency_begin(idem, digest, IDEMPOTENCY_TTL)
        if first is not None:
            if first.fingerprint != digest:
                raise invalid_request(
                    "this Idempotency-Key was used with a different request body",
                    "Idempotency-Key", code="idempotency_key_reused",
                )
            return Replayed(await wait_idempotent(state, idem))
    try:
        token = await lock_conversation(state, conversation_id)
        try:
            turn = await start_turn(state, owner, conv, fields, new_message=new_message,
                                    parent_id=parent_id, key_id=key_id)
        except BaseException:
            await unlock_conversation(state, conversation_id, token)
            raise
    except BaseException:
        if idem is not None:
            await state.coord.idempotency_abandon(idem)
        raise
    await run_turn_holding_lock(state, turn, token)
    if idem is not None:
        state.spawn(_finish_idempotent(state, turn, idem))
    return turn


async def _finish_idempotent(state: AppState, turn: Turn, key: str) -> None:
    from app.schemas.present import message_out

    final = await turn.wait()
    await state.coord.idempotency_finish(
        key, message_out(final).model_dump(mode="json"), IDEMPOTENCY_TTL
    )


async def wait_idempotent(state: AppState, key: str, timeout: float = 3600.0) -> dict[str, Any]:
    """The first request's stored message, waiting while it is still being generated."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = await state.coord.idempotency_get(key)
        if record is None:
            raise APIError(409, "The first request with this Idempotency-Key failed; retry "
                           "with a new key.", code="idempotency_key_failed")
        if record.result is not None:
            return record.result
        await asyncio.sleep(0.05)
    raise APIError(409, "The first request with this Idempotency-Key is still running.",
                   code="conversation_busy")
