"""In-process coordination: the embedded default (one process, no Redis)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

from .base import Coordinator, IdempotencyRecord, StopHandler


class LocalCoordinator(Coordinator):
    name = "local"

    def __init__(self) -> None:
        self._locks: dict[str, tuple[str, float]] = {}  # key -> (token, expires at)
        self._idempotency: dict[str, tuple[IdempotencyRecord, float]] = {}
        self._stop_handlers: dict[str, list[StopHandler]] = {}

    async def healthy(self) -> bool:
        return True

    async def try_lock(self, key: str, token: str, ttl: float) -> bool:
        now = time.monotonic()
        held = self._locks.get(key)
        if held is not None and held[1] > now and held[0] != token:
            return False
        self._locks[key] = (token, now + ttl)
        return True

    async def unlock(self, key: str, token: str) -> None:
        held = self._locks.get(key)
        if held is not None and held[0] == token:
            del self._locks[key]

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

    async def publish_stop(self, conversation_id: str) -> None:
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
