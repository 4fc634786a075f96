"""In-process coordination: the embedded default (one process, no Redis), and what the Redis
back end falls back to while Redis is away."""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from app.coord.base import (
    Coordinator,
    IdempotencyRecord,
    RateDecision,
    StopHandler,
    sliding_window_count,
)

END_EVENTS = ("done", "error")


class LocalCoordinator(Coordinator):
    name = "local"

    def __init__(self) -> None:
        self._locks: dict[str, tuple[str, float]] = {}  # key -> (token, expires at)
        self._idempotency: dict[str, tuple[IdempotencyRecord, float]] = {}
        self._stop_handlers: dict[str, list[StopHandler]] = {}
        self._windows: dict[tuple[str, int], float] = {}  # (key, window index) -> units
        self._leases: dict[str, tuple[str, float]] = {}
        self._events: dict[str, tuple[list[dict[str, Any]], float]] = {}
        self._event_added = asyncio.Event()

    async def healthy(self) -> bool:
        return True

    # -- locks -------------------------------------------------------------------------------------

    async def try_lock(self, key: str, token: str, ttl: float) -> bool:
        return self._hold(self._locks, key, token, ttl)

    async def unlock(self, key: str, token: str) -> None:
        held = self._locks.get(key)
        if held is not None and held[0] == token:
            del self._locks[key]

    @staticmethod
    def _hold(table: dict[str, tuple[str, float]], key: str, token: str, ttl: float) -> bool:
        now = time.monotonic()
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
        if entry[1] <= time.monotonic():
            del self._idempotency[key]
            return None
        return entry[0]

    async def idempotency_begin(
        self, key: str, fingerprint: str, ttl: float
    ) -> IdempotencyRecord | None:
        existing = self._live(key)
        if existing is not None:
            return existing
        self._idempotency[key] = (IdempotencyRecord(fingerprint), time.monotonic() + ttl)
        return None

    async def idempotency_finish(self, key: str, result: dict[str, Any], ttl: float) -> None:
        record = self._live(key)
        fingerprint = record.fingerprint if record is not None else ""
        self._idempotency[key] = (IdempotencyRecord(fingerprint, result), time.monotonic() + ttl)

    async def idempotency_abandon(self, key: str) -> None:
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

    async def release_lease(self, name: str, holder: str) -> None:
        held = self._leases.get(name)
        if held is not None and held[0] == holder:
            del self._leases[name]

    async def lease_holder(self, name: str) -> str | None:
        held = self._leases.get(name)
        if held is None or held[1] <= time.monotonic():
            return None
        return held[0]

    # -- event buffers -----------------------------------------------------------------------------

    async def append_event(self, stream: str, event: dict[str, Any], ttl: float) -> None:
        now = time.monotonic()
        for name in [n for n, (_, expires) in self._events.items() if expires <= now]:
            del self._events[name]
        events = self._events.setdefault(stream, ([], now + ttl))[0]
        events.append(event)
        self._events[stream] = (events, now + ttl)
        self._event_added.set()
        self._event_added = asyncio.Event()

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
