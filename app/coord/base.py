"""The coordination interface the service programs against."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class IdempotencyRecord:
    """What the first request with an Idempotency-Key left: its body's fingerprint, and its
    result once it finished (None while it is still running)."""

    fingerprint: str
    result: dict[str, Any] | None = None

    @property
    def is_done(self) -> bool:
        return self.result is not None


StopHandler = Callable[[str], Awaitable[None] | None]


class Coordinator(abc.ABC):
    name: str

    async def start(self) -> None:  # noqa: B027  (optional hook)
        """Connect (back ends that need to)."""

    async def close(self) -> None:  # noqa: B027  (optional hook)
        """Release connections."""

    @abc.abstractmethod
    async def healthy(self) -> bool:
        """Whether the back end answers (the in-process one always does)."""

    # -- one turn at a time per conversation ------------------------------------------------------

    @abc.abstractmethod
    async def try_lock(self, key: str, token: str, ttl: float) -> bool:
        """Take `key` for `token` unless someone holds it; expires after `ttl` seconds."""

    @abc.abstractmethod
    async def unlock(self, key: str, token: str) -> None:
        """Release `key` if `token` still holds it."""

    # -- idempotency -----------------------------------------------------------------------------

    @abc.abstractmethod
    async def idempotency_begin(
        self, key: str, fingerprint: str, ttl: float
    ) -> IdempotencyRecord | None:
        """Claim `key` for a new request (returns None), or return the record of the request
        that claimed it first."""

    @abc.abstractmethod
    async def idempotency_finish(self, key: str, result: dict[str, Any], ttl: float) -> None:
        """Store the first request's result; later requests with the key get it."""

    @abc.abstractmethod
    async def idempotency_abandon(self, key: str) -> None:
        """The first request failed before producing anything: let a retry start afresh."""

    @abc.abstractmethod
    async def idempotency_get(self, key: str) -> IdempotencyRecord | None: ...

    # -- stop signals ------------------------------------------------------------------------------

    @abc.abstractmethod
    async def publish_stop(self, conversation_id: str) -> None:
        """Ask whoever generates this conversation's reply to stop."""

    @abc.abstractmethod
    async def subscribe_stop(self, conversation_id: str, handler: StopHandler) -> Callable[[], None]:
        """Call `handler(conversation_id)` on a stop for it; returns the unsubscribe function."""
