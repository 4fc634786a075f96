"""In-process coordination: the embedded default (one process, no Redis), and what the Redis
back end falls back to while Redis is away."""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from app.coord.base import (
    Coordinator,
    IdempotencyRecord,
    LockHolder,
    ProcessIdentity,
    RateDecision,
    StopHandler,
    sliding_window_count,
)

END_EVENTS = ("done", "error")


class LocalCoordinator(Coordinator):
    """`clock` (monotonic seconds) decides when locks, leases and records expire; tests pass
    their own to move time without waiting."""

    name = "local"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._locks: dict[str, tuple[LockHolder, float]] = {}  # key -> (holder, expires at)
        self._fence = 0
        self._idempotency: dict[str, tuple[IdempotencyRecord, float]] = {}
        self._stop_handlers: dict[str, list[StopHandler]] = {}
        self._windows: dict[tuple[str, int], float] = {}  # (key, window index) -> units
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
        holder = LockHolder(token=token, owner=identity.replica_id, host=identity.host,
                            pid=identity.pid, instance=identity.instance, fence=self._fence,
                            purpose=purpose, data=dict(data or {}))
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
        return [(k, h) for k in list(self._locks) if k.startswith(prefix)
                and (h := self._live_lock(k)) is not None]

    def _hold(self, table: dict[str, tuple[str, float]], key: str, token: str,
              ttl: float) -> bool:
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
        return None

    def _running(self, key: str, attempt_id: str) -> tuple[IdempotencyRecord, float] | None:
        record = self._live(key)
        if record is None or record.is_done or record.attempt.get("id") != attempt_id:
            return None
        return record, self._idempotency[key][1]

    async def idempotency_progress(
        self, key: str, attempt_id: str, fields: dict[str, Any]
    ) -> bool:
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

    async def idempotency_finish(self, key: str, result: dict[str, Any], ttl: float) -> None:
        record = self._live(key)
        fingerprint = record.fingerprint if record is not None else ""
        attempt = record.attempt if record is not None else {}
        self._idempotency[key] = (IdempotencyRecord(fingerprint, result, attempt),
                                  self.clock() + ttl)

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
        now = time.time()
        index = math.floor(now / window_s)
        elapsed = now / window_s - index
        self._expire_windows(index)
        used = sliding_window_count(
            self._windows.get((key, index - 1), 0.0),
            self._windows.get((key, index), 0.0),
            elapsed,
        )
        return self._decide(key, index, used, limit, window_s, elapsed, cost)

    def _decide(
        self,
        key: str,
        index: int,
        used: float,
        limit: int,
        window_s: float,
        elapsed: float,
        cost: int,
    ) -> RateDecision:
        reset = (1.0 - elapsed) * window_s
        if used + cost > limit:
            return RateDecision(False, limit, max(0, int(limit - used)), reset, max(reset, 1.0))
        if cost:
            self._windows[(key, index)] = self._windows.get((key, index), 0.0) + cost
        return RateDecision(True, limit, max(0, int(limit - used - cost)), reset, 0.0)

    async def rate_add(self, key: str, window_s: float, cost: int) -> None:
        index = math.floor(time.time() / window_s)
        self._windows[(key, index)] = self._windows.get((key, index), 0.0) + cost

    def _expire_windows(self, index: int) -> None:
        for stale in [k for k in self._windows if k[1] < index - 1]:
            del self._windows[stale]

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
