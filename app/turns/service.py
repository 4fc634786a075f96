"""The turn service: the one owner of a conversation's turns, for every transport (the
conversations REST API, its SSE stream, the WebSocket, the AI SDK's chat). Transports call
`start`, `stop`, `regenerate_parent`, `attach` and `delete`; they only translate shapes.

A turn, end to end:
1. The key is checked (a key revoked since its connection authenticated is refused), the
   conversation's turn lock taken (owned, fenced, renewed while the turn runs; 409 while
   another turn holds it, 404 while a delete does), the turn planned (app/turns/pipeline.py).
2. The user's message and the reply (`generating`) are committed in one transaction under the
   lock's fence, before anything is generated: what the user sent is never lost, and a turn
   whose lock was taken over cannot start.
3. The generation runs as a task of its own, decoupled from clients: its events are kept by
   the Turn (and copied to the coordination back end's buffer when that spans processes), the
   text streamed so far is written to the reply every `reply_checkpoint_interval` seconds (so
   a crash keeps what clients saw), stop ends it within one engine step.
4. However it ends, the reply is stored with what was produced, exactly one terminal event is
   published (done, or an error: e.g. 404 when the conversation was deleted under it), the
   end hooks run (idempotency records), and only then is the lock released and the session's
   lease taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from kvchat.app.coord import Coordinator, ProcessIdentity
from kvchat.app.coord.leases import LeaseKeeper
from kvchat.app.coord.locks import HeldLock, Locks
from kvchat.app.errors import (
    APIError,
    busy,
    conversation_gone,
    engine_failure,
    invalid_request,
    not_found,
)
from kvchat.app.ops.limits import Limits
from kvchat.app.ops.tasks import BackgroundTasks
from kvchat.app.runtime import Runtime
from kvchat.app.schemas.chat import SamplingFields
from kvchat.app.session_settings import SessionSettings
from kvchat.app.settings import Settings
from kvchat.app.store import ConversationRecord, KeyRecord, MessageRecord, StaleFence, Store
from kvchat.app.store.column_types import utcnow
from kvchat.app.turns.branches import BranchCache
from kvchat.app.turns.events import (
    TurnDelta,
    TurnDone,
    TurnEvent,
    TurnFailed,
    TurnStarted,
    TurnToolCall,
    event_of,
    from_offset,
    stored_events,
    text_of,
)
from kvchat.app.turns.generation import Done, Generated, Generation, TextDelta, ToolDelta
from kvchat.app.turns.pipeline import PreparedTurn, TurnPlanner
from kvchat.app.turns.turn import Turn
from kvchat.inference import ChatMessage

log = logging.getLogger(__name__)

EVENTS_TTL = 3600.0  # how long a reply's buffered events stay (resume from another process)
RECENT_TURNS = 256  # ended turns whose events attach() still gives exactly as they were sent
# How long a new turn waits for the ended turn before it to release the lock (its end hooks:
# storing an idempotency record) before it is answered 409.
ENDING_TURN_WAIT_S = 10.0
BUSY = "A reply is already being generated in this conversation; wait for it or stop it."

EndHook = Callable[[Turn], Awaitable[None]]


def regenerated_parent(reply: MessageRecord | None, param: str) -> str:
    """The message a regenerated `reply` answers (its parent); 400 naming `param` unless it
    is an assistant reply that answers one."""
    if reply is None or reply.role != "assistant" or reply.parent_id is None:
        raise invalid_request(f"{param} must name an assistant reply", param)
    return reply.parent_id


def lock_key(conversation_id: str) -> str:
    return f"turn:{conversation_id}"


def events_stream(message_id: str) -> str:
    return f"reply:{message_id}"


def key_revoked() -> APIError:
    return APIError(
        401,
        "This API key was revoked.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


class TurnService:
    """Built by the composition root (app/main.py) from what a turn needs: the settings, the
    session defaults, the store, the runtime (the engine client, templates, worker threads),
    the coordination back end and this process's identity on it, the session leases, the
    admission limits and the background tasks."""

    def __init__(
        self,
        *,
        settings: Settings,
        defaults: SessionSettings,
        store: Store,
        runtime: Runtime,
        coord: Coordinator,
        identity: ProcessIdentity,
        limits: Limits,
        tasks: BackgroundTasks,
        leases: LeaseKeeper | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.store = store
        self.runtime = runtime
        self.coord = coord
        self.identity = identity
        self.limits = limits
        self.tasks = tasks
        self.leases = leases
        self.clock = clock
        self.locks = Locks(coord, identity, settings.turn_lock_ttl)
        self.planner = TurnPlanner(
            settings=settings,
            defaults=defaults,
            store=store,
            runtime=runtime,
            locks=self.locks,
            limits=limits,
        )
        self._running: dict[str, Turn] = {}  # conversation id -> its turn in this process
        # Reply id -> the latest turns that ended here, newest last: a client resuming one
        # gets its events as they were published, not the stored reply's summary of them.
        self._recent: OrderedDict[str, Turn] = OrderedDict()

    @property
    def branches(self) -> BranchCache:
        return self.planner.branches

    # -- lookups ---------------------------------------------------------------------------------

    def running(self, conversation_id: str) -> Turn | None:
        """The turn generating in this conversation in this process, if any."""
        turn = self._running.get(conversation_id)
        return turn if turn is not None and not turn.is_done else None

    def running_turns(self) -> Iterable[Turn]:
        """This process's turns, generating or ending (their locks not yet released)."""
        return list(self._running.values())

    async def conversation(self, owner: str, conversation_id: str) -> ConversationRecord:
        conv = await self.store.get_conversation(owner, conversation_id)
        if conv is None:
            raise not_found(f"conversation {conversation_id!r}")
        return conv

    async def check_key(self, key: KeyRecord) -> None:
        """401 when `key` was revoked after it authenticated: connections outlive requests,
        so every turn checks again (one indexed read, next to a turn's cost)."""
        if not await self.store.is_key_active(key.id):
            raise key_revoked()

    async def regenerate_parent(
        self, owner: str, conversation_id: str, message_id: str | None
    ) -> str:
        """The message a new reply regenerating `message_id` (default: the current leaf)
        answers: the assistant reply's parent."""
        conv = await self.conversation(owner, conversation_id)
        target = message_id or conv.current_leaf_id
        message = await self.store.get_message(conv.id, target) if target else None
        return regenerated_parent(message, "message_id")

    # -- starting a turn -------------------------------------------------------------------------

    async def start(
        self,
        key: KeyRecord,
        conversation_id: str,
        fields: SamplingFields,
        *,
        new_message: ChatMessage | None,
        parent_id: str | None,
        on_end: EndHook | None = None,
        instructions: str | None = None,
        truncation: bool = True,
        reply_fields: dict[str, Any] | None = None,
        key_verified: bool = False,
        retention_ttl_s: float | None = None,
    ) -> Turn:
        """Plan, commit and start a turn. `new_message` None regenerates the reply to
        `parent_id` (a user or tool message). `on_end` runs when the turn has ended, before
        its lock is released. `key_verified`: the request authenticated `key` just now (an
        HTTP route); a connection's key (a WebSocket's) is checked for revocation here.

        For the Responses API (the defaults change nothing): `instructions` is this turn's
        system prompt instead of the conversation's, `truncation` False refuses a turn whose
        history does not fit whole (pipeline.prepare_turn), `reply_fields` are stored with
        the reply when it is committed (its `response` record), `retention_ttl_s` is the
        client's retention hint for the session (app.turns.cache_hints)."""
        if not key_verified:
            await self.check_key(key)
        conv = await self.conversation(key.owner, conversation_id)
        ending = self._running.get(conv.id)
        if ending is not None and ending.is_done:
            # Its reply is out, so its client may already be sending this turn; its lock goes
            # once its end hooks have run: wait for that rather than answer 409.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ending.released(), ENDING_TURN_WAIT_S)
        held = await self.locks.acquire(
            lock_key(conv.id), purpose="turn", fence_floor=conv.turn_fence
        )
        if not isinstance(held, HeldLock):
            if held.purpose == "delete":
                raise conversation_gone(conv.id)
            raise busy(BUSY)
        try:
            prepared = await self.planner.prepare_turn(
                conv,
                fields,
                new_message=new_message,
                parent_id=parent_id,
                instructions=instructions,
                truncation=truncation,
                retention_ttl_s=retention_ttl_s,
            )
            try:
                user, reply = await self.store.start_reply(
                    conv.id,
                    parent_id=prepared.reply_parent_id,
                    user=prepared.user_fields,
                    trim_start_id=prepared.trim_start_id,
                    fence=held.fence,
                    reply=reply_fields,
                )
            except LookupError:
                raise conversation_gone(conv.id) from None
            except StaleFence:
                raise busy(BUSY) from None
            self.runtime.history.record(conv.id, prepared.history_stats)
            generation = Generation(
                self.runtime,
                prepared.request,
                cache_salt=key.owner,
                tool_format=prepared.tool_format,
                tool_names=prepared.tool_names,
                request_id=f"turn-{reply.id}",
                on_finish=self.limits.spend_on_finish(key.id),
                fallback=prepared.fallback,
            )
            turn = Turn(conv.id, key.owner, user, reply, generation, lock_token=held.token)
            if self.coord.name != "local":
                turn.on_event = self._buffer()
            unsubscribe = await self.coord.subscribe_stop(conv.id, lambda _: turn.stop())
        except BaseException:
            await held.release()
            raise
        held.on_lost = turn.lose_lock
        self._running[conv.id] = turn
        turn.publish(TurnStarted(reply.id, reply.parent_id))
        turn.task = self.tasks.spawn(self._run(turn, held, prepared, unsubscribe, on_end))
        return turn

    def _buffer(self) -> Callable[[Turn, TurnEvent], None]:
        """Copy a turn's events to the coordination back end, in order (one task per turn),
        for clients of other processes."""
        queue: asyncio.Queue[TurnEvent] = asyncio.Queue()

        async def drain(stream: str) -> None:
            while True:
                event = await queue.get()
                try:
                    await self.coord.append_event(stream, event.frame(), EVENTS_TTL)
                except Exception:
                    log.exception("buffering a reply's event failed")
                if isinstance(event, TurnDone | TurnFailed):
                    return

        def on_event(turn: Turn, event: TurnEvent) -> None:
            if isinstance(event, TurnStarted):
                self.tasks.spawn(drain(events_stream(turn.message_id)))
            queue.put_nowait(event)

        return on_event

    # -- running it ------------------------------------------------------------------------------

    async def _run(
        self,
        turn: Turn,
        held: HeldLock,
        prepared: PreparedTurn,
        unsubscribe: Callable[[], None],
        on_end: EndHook | None,
    ) -> None:
        result: Generated | None = None
        error: BaseException | None = None
        checkpoints = Checkpoints(self.store, self.settings.reply_checkpoint_interval, turn)
        shown = turn.generation.shown_logprobs()
        try:
            async for event in turn.generation.events():
                if isinstance(event, TextDelta):
                    logprobs = shown.of(event)
                    if not event.text:
                        continue
                    turn.publish(TurnDelta(turn.message_id, event.text, turn.text_sent, logprobs))
                    turn.text += event.text
                    turn.text_sent += len(event.text)
                    checkpoints.maybe()
                elif isinstance(event, ToolDelta):
                    turn.publish(
                        TurnToolCall(
                            turn.message_id, event.index, event.id, event.name, event.arguments
                        )
                    )
                elif isinstance(event, Done):
                    result = event.result
        except asyncio.CancelledError:
            turn.stop()
            raise
        except Exception as e:  # the engine died mid-turn: store what there is
            log.exception("turn %s failed", turn.message_id)
            error = e
        finally:
            await asyncio.shield(
                self._end(
                    turn,
                    held,
                    prepared,
                    result or turn.generation.result,
                    error,
                    checkpoints,
                    unsubscribe,
                    on_end,
                )
            )

    async def _end(
        self,
        turn: Turn,
        held: HeldLock,
        prepared: PreparedTurn,
        result: Generated,
        error: BaseException | None,
        checkpoints: Checkpoints,
        unsubscribe: Callable[[], None],
        on_end: EndHook | None,
    ) -> None:
        """Store the reply, publish the one terminal event, run the end hook, release the
        lock; whatever any step raises, the next ones run."""
        try:
            await checkpoints.settle()
            fields = self._reply_fields(result, error)
            if result.token_ids:
                counts = await self.runtime.run_cpu(
                    self.planner.reply_counts, prepared, result.token_ids, fields["tool_calls"]
                )
                fields.update(num_tokens=counts.num_tokens, content_tokens=counts.content_tokens)
            final = await self.store.update_message(turn.message_id, **fields)
            turn.final = final
            new = (turn.user_message, final) if turn.user_message is not None else (final,)
            self.branches.put(prepared.conversation, prepared.path, new, prepared.summary_record)
            if error is not None:
                failure = engine_failure(error)
                turn.publish(TurnFailed(final.id, failure.code or "engine_error", failure.message))
            else:
                turn.publish(TurnDone.of(final))
        except LookupError:  # the conversation was deleted under the turn
            turn.failure = conversation_gone(turn.conversation_id)
            turn.publish(
                TurnFailed(turn.message_id, "conversation_not_found", turn.failure.message, 404)
            )
        except Exception:
            log.exception("storing the reply of turn %s failed", turn.message_id)
            turn.failure = APIError(500, "The reply could not be stored.", code="internal_error")
            turn.publish(TurnFailed(turn.message_id, "internal_error", turn.failure.message))
        finally:
            if not turn.is_done:  # cancelled while storing: still exactly one terminal event
                turn.publish(TurnFailed(turn.message_id, "internal_error", "the turn ended"))
            if on_end is not None:
                try:
                    await on_end(turn)
                except Exception:
                    log.exception("the end hook of turn %s failed", turn.message_id)
            unsubscribe()
            self._recent[turn.message_id] = turn
            while len(self._recent) > RECENT_TURNS:
                self._recent.popitem(last=False)
            try:
                await held.release()
            finally:
                turn.mark_released()
                if self._running.get(turn.conversation_id) is turn:
                    del self._running[turn.conversation_id]
            try:
                if self.leases is not None:
                    await self.leases.hold(turn.conversation_id)
            except Exception:
                log.exception("taking the lease of %s failed", turn.conversation_id)
            if turn.final is not None and error is None:
                job = self.planner.summary_job(
                    prepared.conversation,
                    prepared.policy,
                    prepared.plan,
                    prepared.branch,
                    prepared.chat,
                )
                if job is not None:
                    self.tasks.spawn(job())

    def _reply_fields(self, result: Generated, error: BaseException | None) -> dict[str, Any]:
        fields: dict[str, Any] = dict(
            content=(result.content if result.content is not None else result.text)
            if result.token_ids
            else None,
            token_ids=result.token_ids or None,
            tool_calls=[
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in result.tool_calls
            ]
            or None,
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
        return fields

    # -- stop, resume, delete --------------------------------------------------------------------

    async def stop(self, owner: str, conversation_id: str) -> bool:
        """Stop the conversation's reply wherever it is generated (it is stored as cancelled
        with what it has). Whether a reply was being generated."""
        conv = await self.conversation(owner, conversation_id)
        turn = self.running(conv.id)
        if turn is not None:
            turn.stop()
        await self.coord.publish_stop(conv.id)
        if turn is not None:
            return True
        holder = await self.coord.lock_holder(lock_key(conv.id))
        return holder is not None and holder.purpose == "turn"

    async def attach(
        self, conversation_id: str, message_id: str, offset: int = 0
    ) -> AsyncIterator[TurnEvent]:
        """The events of reply `message_id` for a client that has seen `offset` characters of
        it: from this process's live turn (or one of the RECENT_TURNS that ended here, as
        they were published), else (a reply another process generates) from the
        coordination back end's buffer, else from the stored reply. The caller has checked
        the conversation's owner. 404 for no such reply."""
        running = self._running.get(conversation_id)
        turn = (
            running
            if running is not None and running.message_id == message_id
            else self._recent.get(message_id)
        )
        if turn is not None and turn.conversation_id == conversation_id:
            return from_offset(turn.events(), offset)
        stored = await self.store.get_message(conversation_id, message_id)
        if stored is None or stored.role != "assistant":
            raise not_found("reply in this conversation", "message_id")
        if stored.status != "generating":
            return from_offset(_iterate(stored_events(stored)), offset)
        if self.coord.name == "local":
            raise not_found("reply being generated", "message_id")
        frames = self.coord.read_events(events_stream(stored.id), 60.0)
        return from_offset(_events_of(frames), offset)

    async def delete(self, owner: str, conversation_id: str) -> None:
        """Delete a conversation: a reply being generated is stopped and stored first (the
        delete takes the turn lock, so no turn starts or runs while it deletes; a turn that
        tries meanwhile gets 404)."""
        conv = await self.conversation(owner, conversation_id)
        deadline = self.clock() + self.settings.drain_timeout + self.settings.turn_lock_ttl
        while True:
            held = await self.locks.acquire(lock_key(conv.id), purpose="delete")
            if isinstance(held, HeldLock):
                break
            if self.clock() > deadline:
                raise busy(
                    "The reply being generated in this conversation did not stop; "
                    "try deleting again."
                )
            turn = self._running.get(conv.id)
            if turn is not None:
                turn.stop()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(turn.ended(), 0.5)
            else:
                await self.coord.publish_stop(conv.id)
                await asyncio.sleep(0.05)
        try:
            if not await self.store.delete_conversation(owner, conv.id):
                raise not_found(f"conversation {conversation_id!r}")
            self.branches.forget(conv.id)
            await self.runtime.forget_session(conv.id)  # its KV freed now, its caches
            if self.leases is not None:
                await self.leases.release(conv.id)
        finally:
            await held.release()

    # -- start-up --------------------------------------------------------------------------------

    async def recover(self) -> list[MessageRecord]:
        """After a restart: break the locks of processes known dead, mark replies that were
        being generated by no live process `interrupted`, and give each the text its clients
        were sent (the buffered events, when the back end kept them and they say more than
        the last checkpoint). Returns the interrupted replies."""
        for key, holder in await self.locks.reclaim_dead():
            log.warning(
                "took over lock %s from %s (pid %d), which is gone", key, holder.owner, holder.pid
            )
        # A reply is dead when no turn lock covers it. Replies of turns that took their lock
        # after the scan are newer than `scanned`, and spared.
        scanned = utcnow()
        live = {
            key.removeprefix("turn:")
            for key, holder in await self.coord.lock_scan("turn:")
            if holder.purpose == "turn"
        }
        interrupted = await self.store.mark_interrupted(
            except_conversations=live, created_before=scanned
        )
        recovered = []
        for message in interrupted:
            try:
                frames = await self.coord.buffered_events(events_stream(message.id))
                text = text_of(_parsed(frames))
            except Exception:
                log.exception("reading the buffered events of %s failed", message.id)
                text = ""
            if len(text) > len(message.content or ""):
                message = await self.store.update_message(message.id, content=text)
            recovered.append(message)
        return recovered


class Checkpoints:
    """Writes a generating reply's text and ids so far every `reply_checkpoint_interval`
    seconds (0: never), one write at a time, never after the final one."""

    def __init__(self, store: Store, interval: float, turn: Turn) -> None:
        self.store = store
        self.turn = turn
        self.interval = interval
        self.last = time.monotonic()
        self.task: asyncio.Task[None] | None = None

    def maybe(self) -> None:
        if self.interval <= 0 or (self.task is not None and not self.task.done()):
            return
        now = time.monotonic()
        if now - self.last < self.interval:
            return
        self.last = now
        turn = self.turn
        self.task = asyncio.ensure_future(
            self._write(turn.text, list(turn.generation.result.token_ids))
        )

    async def _write(self, text: str, token_ids: list[int]) -> None:
        try:
            await self.store.update_message(
                self.turn.message_id, content=text, token_ids=token_ids or None
            )
        except Exception:
            log.warning("checkpointing reply %s failed", self.turn.message_id, exc_info=True)

    async def settle(self) -> None:
        if self.task is not None:
            await self.task


async def _iterate(events: list[TurnEvent]) -> AsyncIterator[TurnEvent]:
    for event in events:
        yield event


async def _events_of(frames: AsyncIterator[dict[str, Any]]) -> AsyncIterator[TurnEvent]:
    async for frame in frames:
        try:
            yield event_of(frame)
        except (KeyError, TypeError, ValueError):
            log.warning("skipping a buffered event that does not parse: %r", frame)


def _parsed(frames: list[dict[str, Any]]) -> list[TurnEvent]:
    events = []
    for frame in frames:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            events.append(event_of(frame))
    return events
