"""In-process coordination: the embedded default (one process, no Redis), and what the Redis
back end falls back to while Redis is away."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from kvchat.app.coord.base import (
    Coordinator,
    IdempotencyRecord,
    LockHolder,
    ProcessIdentity,
    RateDecision,
    StopHandler,
    sliding_window_decision,
    window_ms,
)

END_EVENTS = ("done", "error")


@dataclass
class RateCounts:
    """One key's two fixed windows: what the Redis back end keeps in a hash (fields w, p, c)
    and its script rolls forward the same way."""

    window_ms: int
    index: int  # the fixed window `current` counts: now_ms // window_ms when last rolled
    previous: int  # units counted in window index - 1
    current: int

    def roll(self, now_ms: int) -> int:
        """Move to the window `now_ms` falls in; returns how far (ms) into it that is. A
        clock that stepped back stays in the newest window seen, as if at its start (the
        previous window then weighs fully: never fewer units than were counted)."""
        index = now_ms // self.window_ms
        if index < self.index:
            return 0
        if index > self.index:
            self.previous = self.current if index == self.index + 1 else 0
            self.current = 0
            self.index = index
        return now_ms - index * self.window_ms

    def is_stale(self, now_ms: int) -> bool:
        """Both windows have slid out: nothing counted weighs any more."""
        return now_ms // self.window_ms > self.index + 1


class LocalCoordinator(Coordinator):
    """`clock` (monotonic seconds) decides when locks, leases and records expire; tests pass
    their own to move time without waiting."""

    name = "local"

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        rate_clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.clock = clock  # monotonic seconds: when locks, leases and records expire
        self.rate_clock = rate_clock  # the wall clock (ns) rate-limit windows are aligned to
        self._locks: dict[str, tuple[LockHolder, float]] = {}  # key -> (holder, expires at)
        self._fence = 0
        self._idempotency: dict[str, tuple[IdempotencyRecord, float]] = {}
        self._stop_handlers: dict[str, list[StopHandler]] = {}
        self._rates: dict[str, RateCounts] = {}
        self._leases: dict[str, tuple[str, float]] = {}
        self._events: dict[str, tuple[list[dict[str, Any]], float]] = {}
        self._event_added = asyncio.Event()

    async def healthy(self) -> bool:
        return True

    # -- locks -------------------------------------------------------------------------------------

    def _live_lock(self, key: str) -> LockHolder | None:
        held = self._locks.get(key)
        if held is None:
            return None
        if held[1] <= self.clock():
            del self._locks[key]
            return None
        return held[0]

    async def lock_acquire(
        self,
        key: str,
        identity: ProcessIdentity,
        token: str,
        ttl: float,
        *,
        purpose: str,
        fence_floor: int = 0,
        data: dict[str, Any] | None = None,
    ) -> tuple[bool, LockHolder]:
        held = self._live_lock(key)
        if held is not None and held.token != token:
            return False, held
        if held is not None:  # the same token again: a renewal
            self._locks[key] = (held, self.clock() + ttl)
            return True, held
        self._fence = max(self._fence, fence_floor) + 1
        holder = LockHolder(
            token=token,
            owner=identity.replica_id,
            host=identity.host,
            pid=identity.pid,
            instance=identity.instance,
            fence=self._fence,
            purpose=purpose,
            data=dict(data or {}),
        )
        self._locks[key] = (holder, self.clock() + ttl)
        return True, holder

    async def lock_renew(self, key: str, token: str, ttl: float) -> bool:
        held = self._live_lock(key)
        if held is None or held.token != token:
            return False
        self._locks[key] = (held, self.clock() + ttl)
        return True

    async def lock_release(self, key: str, token: str) -> bool:
        held = self._live_lock(key)
        if held is None or held.token != token:
            return False
        del self._locks[key]
        return True

    async def lock_holder(self, key: str) -> LockHolder | None:
        return self._live_lock(key)

    async def lock_scan(self, prefix: str) -> list[tuple[str, LockHolder]]:
        return [
            (k, h)
            for k in list(self._locks)
            if k.startswith(prefix) and (h := self._live_lock(k)) is not None
        ]

    def _hold(self, table: dict[str, tuple[str, float]], key: str, token: str, ttl: float) -> bool:
        now = self.clock()
        held = table.get(key)
        if held is not None and held[1] > now and held[0] != token:
            return False
        table[key] = (token, now + ttl)
        return True

    # -- idempotency -------------------------------------------------------------------------------

    def _live(self, key: str) -> IdempotencyRecord | None:
        entry = self._idempotency.get(key)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            del self._idempotency[key]
            return None
        return entry[0]

    async def idempotency_begin(
        self, key: str, fingerprint: str, ttl: float, attempt: dict[str, Any] | None = None
    ) -> IdempotencyRecord | None:
        existing = self._live(key)
        if existing is not None:
            return existing
        record = IdempotencyRecord(fingerprint, attempt=dict(attempt or {}))
        self._idempotency[key] = (record, self.clock() + ttl)
        if len(self._idempotency) % 1024 == 0:  # now and then, drop the expired ones
            now = self.clock()
            for stale in [k for k, (_, expires) in self._idempotency.items() if expires <= now]:
                del self._idempotency[stale]
        return None

    def _running(self, key: str, attempt_id: str) -> tuple[IdempotencyRecord, float] | None:
        record = self._live(key)
        if record is None or record.is_done or record.attempt.get("id") != attempt_id:
            return None
        return record, self._idempotency[key][1]

    async def idempotency_progress(self, key: str, attempt_id: str, fields: dict[str, Any]) -> bool:
        running = self._running(key, attempt_id)
        if running is None:
            return False
        record, expires = running
        self._idempotency[key] = (replace(record, attempt={**record.attempt, **fields}), expires)
        return True

    async def idempotency_takeover(
        self, key: str, dead_attempt_id: str, attempt: dict[str, Any]
    ) -> IdempotencyRecord | None:
        running = self._running(key, dead_attempt_id)
        if running is None:
            return None
        record, expires = running
        new = replace(record, attempt=dict(attempt))
        self._idempotency[key] = (new, expires)
        return new

    async def idempotency_finish(
        self, key: str, result: dict[str, Any], ttl: float, attempt_id: str | None = None
    ) -> None:
        if attempt_id is not None and self._running(key, attempt_id) is None:
            return
        record = self._live(key)
        fingerprint = record.fingerprint if record is not None else ""
        attempt = record.attempt if record is not None else {}
        self._idempotency[key] = (
            IdempotencyRecord(fingerprint, result, attempt),
            self.clock() + ttl,
        )

    async def idempotency_abandon(self, key: str, attempt_id: str | None = None) -> None:
        if attempt_id is None or self._running(key, attempt_id) is not None:
            self._idempotency.pop(key, None)

    async def idempotency_get(self, key: str) -> IdempotencyRecord | None:
        return self._live(key)

    # -- stop signals ------------------------------------------------------------------------------

    async def publish_stop(self, conversation_id: str) -> None:
        await self.deliver_stop(conversation_id)

    async def deliver_stop(self, conversation_id: str) -> None:
        for handler in list(self._stop_handlers.get(conversation_id, ())):
            result = handler(conversation_id)
            if inspect.isawaitable(result):
                await result

    async def subscribe_stop(
        self, conversation_id: str, handler: StopHandler
    ) -> Callable[[], None]:
        self._stop_handlers.setdefault(conversation_id, []).append(handler)

        def unsubscribe() -> None:
            handlers = self._stop_handlers.get(conversation_id, [])
            if handler in handlers:
                handlers.remove(handler)
            if not handlers:
                self._stop_handlers.pop(conversation_id, None)

        return unsubscribe

    # -- rate limits -------------------------------------------------------------------------------

    async def rate_check(self, key: str, limit: int, window_s: float, cost: int) -> RateDecision:
        counts, elapsed_ms = self._rate_counts(key, window_s)
        decision = sliding_window_decision(
            counts.previous, counts.current, elapsed_ms / counts.window_ms, window_s, limit, cost
        )
        if decision.allowed:
            counts.current += cost
        return decision

    async def rate_add(self, key: str, window_s: float, cost: int) -> None:
        counts, _ = self._rate_counts(key, window_s)
        counts.current += cost

    def _rate_counts(self, key: str, window_s: float) -> tuple[RateCounts, int]:
        """`key`'s counts rolled forward to now, and how far (ms) now is into their window."""
        now_ms = self.rate_clock() // 1_000_000
        for stale in [k for k, c in self._rates.items() if c.is_stale(now_ms)]:
            del self._rates[stale]
        counts = self._rates.setdefault(key, RateCounts(window_ms(window_s), 0, 0, 0))
        return counts, counts.roll(now_ms)

    # -- leases ------------------------------------------------------------------------------------

    async def acquire_lease(self, name: str, holder: str, ttl: float) -> bool:
        return self._hold(self._leases, name, holder, ttl)

    async def take_lease(self, name: str, holder: str, ttl: float) -> str | None:
        previous = await self.lease_holder(name)
        self._leases[name] = (holder, self.clock() + ttl)
        return previous

    async def release_lease(self, name: str, holder: str) -> None:
        held = self._leases.get(name)
        if held is not None and held[0] == holder:
            del self._leases[name]

    async def lease_holder(self, name: str) -> str | None:
        held = self._leases.get(name)
        if held is None or held[1] <= self.clock():
            return None
        return held[0]

    # -- event buffers -----------------------------------------------------------------------------

    async def append_event(self, stream: str, event: dict[str, Any], ttl: float) -> None:
        now = self.clock()
        for name in [n for n, (_, expires) in self._events.items() if expires <= now]:
            del self._events[name]
        events = self._events.setdefault(stream, ([], now + ttl))[0]
        events.append(event)
        self._events[stream] = (events, now + ttl)
        self._event_added.set()
        self._event_added = asyncio.Event()

    async def buffered_events(self, stream: str) -> list[dict[str, Any]]:
        entry = self._events.get(stream)
        return list(entry[0]) if entry is not None and entry[1] > self.clock() else []

    async def read_events(self, stream: str, timeout: float) -> AsyncIterator[dict[str, Any]]:
        index = 0
        while True:
            entry = self._events.get(stream)
            events = entry[0] if entry else []
            while index < len(events):
                event = events[index]
                index += 1
                yield event
                if event.get("type") in END_EVENTS:
                    return
            waiter = self._event_added
            try:
                await asyncio.wait_for(waiter.wait(), timeout)
            except TimeoutError:
                return
