"""Turn: one reply being generated for a conversation, in this process. Its events are kept
in order (a client may leave and come back), it ends with exactly one terminal event, and it
knows its watchers: when the last one leaves, a grace period starts after which an unwatched
reply is stopped (a client that comes back in time cancels it)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvchat.app.errors import APIError
from kvchat.app.store import MessageRecord
from kvchat.app.turns.events import TurnEvent, TurnFailed, is_terminal
from kvchat.app.turns.generation import Generation

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Turn:
    conversation_id: str
    owner: str
    user_message: MessageRecord | None
    assistant_message: MessageRecord
    generation: Generation
    lock_token: str | None = None  # the token of the turn lock it holds
    lock_lost: bool = False  # its lock expired or was taken over: another process may run one
    log: list[TurnEvent] = field(default_factory=list)
    text: str = ""  # the text published so far
    text_sent: int = 0  # len(text): the next delta's offset
    final: MessageRecord | None = None  # the stored reply, once stored
    failure: APIError | None = None  # why there is no stored reply, when there is none
    # Called with each event as it is published (the Redis buffer, for other processes).
    on_event: Callable[[Turn, TurnEvent], None] | None = None
    watchers: int = 0
    task: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _ended: asyncio.Event = field(default_factory=asyncio.Event)
    _released: asyncio.Event = field(default_factory=asyncio.Event)  # its lock is released
    _grace: asyncio.TimerHandle | None = None

    @property
    def message_id(self) -> str:
        return self.assistant_message.id

    @property
    def is_done(self) -> bool:
        return self._ended.is_set()

    def publish(self, event: TurnEvent) -> None:
        """Add an event; nothing is added after the terminal one."""
        if self.is_done:
            log.error(
                "turn %s: %s published after its end; dropped",
                self.message_id,
                type(event).__name__,
            )
            return
        self.log.append(event)
        if is_terminal(event):
            self._ended.set()
            self.cancel_grace()
        self._changed.set()
        if self.on_event is not None:
            try:
                self.on_event(self, event)
            except Exception:
                log.exception("buffering an event of turn %s failed", self.message_id)

    def stop(self) -> None:
        """End the generation at the next engine step; the reply is stored with what it has."""
        self.generation.stop()

    def lose_lock(self) -> None:
        """Its turn lock was lost (this process hung past its TTL, say): stop, and let a retry
        under its Idempotency-Key run it again rather than replay the cut-off reply."""
        self.lock_lost = True
        self.stop()

    async def events(self) -> AsyncIterator[TurnEvent]:
        """Every event of the turn from its start, live, up to the terminal one."""
        index = 0
        while True:
            while index < len(self.log):
                event = self.log[index]
                index += 1
                yield event
                if is_terminal(event):
                    return
            self._changed.clear()
            if index < len(self.log):
                continue
            await self._changed.wait()

    async def ended(self) -> None:
        await self._ended.wait()

    def mark_released(self) -> None:
        self._released.set()

    async def released(self) -> None:
        """Its turn lock is released: a moment after its terminal event, once the end hooks
        have run (a client that has its reply may already be sending the next turn)."""
        await self._released.wait()

    async def wait(self) -> MessageRecord:
        """The stored reply once the turn ends; the turn's APIError when it ended without one
        (e.g. 404 when the conversation was deleted under it)."""
        await self._ended.wait()
        if self.final is not None:
            return self.final
        last = self.log[-1]
        raise self.failure or APIError(
            500,
            last.message if isinstance(last, TurnFailed) else "the turn failed",
            code=last.code if isinstance(last, TurnFailed) else "internal_error",
        )

    # -- watchers and the grace period -----------------------------------------------------------

    def watch(self) -> None:
        self.watchers += 1
        self.cancel_grace()

    def unwatch(self, grace: float | None) -> None:
        """A watcher left. With `grace` (seconds), an unwatched reply is stopped that long
        after its last watcher left, unless one came back."""
        self.watchers = max(0, self.watchers - 1)
        if grace is None or self.watchers or self.is_done:
            return
        self.cancel_grace()
        self._grace = asyncio.get_running_loop().call_later(grace, self._grace_over)

    @property
    def in_grace_period(self) -> bool:
        """Unwatched, with its grace period running."""
        return self._grace is not None

    def cancel_grace(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None

    def _grace_over(self) -> None:
        self._grace = None
        if not self.watchers and not self.is_done:
            log.info(
                "turn %s: no client came back within the grace period; stopping it", self.message_id
            )
            self.stop()
