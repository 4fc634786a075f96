"""The coordination interface the service programs against."""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Awaitable, Callable
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


@dataclass(frozen=True)
class RateDecision:
    """A sliding-window rate limit's answer: whether `cost` more fits in the window now.

    `remaining` and `reset_s` describe the window after this decision (with `cost` counted
    when it was allowed); both wait times assume nothing else is counted meanwhile and are
    `math.inf` when the wait never ends (a cost above the limit)."""

    allowed: bool
    limit: int
    remaining: int  # whole units that still fit
    reset_s: float  # until one more unit fits (0 while remaining >= 1)
    retry_after: float  # until `cost` fits; 0 when allowed


StopHandler = Callable[[str], Awaitable[None] | None]


def window_ms(window_s: float) -> int:
    """A rate-limit window's length in whole milliseconds, the unit windows are counted in."""
    assert window_s >= 0.001, window_s
    return round(window_s * 1000)


def sliding_window_count(previous: float, current: float, elapsed_fraction: float) -> float:
    """The sliding-window estimate from two fixed windows (the previous one weighted by how
    much of it still overlaps the sliding window), as Cloudflare's rate limiter does."""
    return previous * (1.0 - elapsed_fraction) + current


def sliding_window_wait(
    previous: float, current: float, elapsed_fraction: float, window_s: float, limit: int,
    need: float,
) -> float:
    """Seconds until `need` more units fit under `limit` if nothing else is counted: the
    previous window's weight shrinks through this window; once this window ends its count is
    the previous one and shrinks through the next. So a window spent to its limit goes on
    refusing past its own end, until enough of it has slid out."""
    if sliding_window_count(previous, current, elapsed_fraction) + need <= limit:
        return 0.0
    if need > limit:
        return math.inf
    if current + need <= limit:  # in this window, once enough of the previous one slid out
        fits_at = 1.0 - (limit - current - need) / previous
        return max(0.0, fits_at - elapsed_fraction) * window_s
    fits_at = 1.0 - (limit - need) / current  # in the next window, this one's count sliding out
    return (1.0 - elapsed_fraction + fits_at) * window_s


def sliding_window_decision(
    previous: float, current: float, elapsed_fraction: float, window_s: float, limit: int,
    cost: int,
) -> RateDecision:
    """Whether `cost` more fits on top of the counts of the previous and the current fixed
    window, `elapsed_fraction` into the current one; what every back end decides (the Redis
    one in its script, with the same arithmetic)."""
    used = sliding_window_count(previous, current, elapsed_fraction)
    allowed = used + cost <= limit  # the script's test, term for term
    after = current + cost if allowed else current
    used_after = sliding_window_count(previous, after, elapsed_fraction)
    return RateDecision(
        allowed=allowed,
        limit=limit,
        remaining=max(0, math.floor(limit - used_after)),
        reset_s=sliding_window_wait(previous, after, elapsed_fraction, window_s, limit, 1),
        retry_after=0.0 if allowed else sliding_window_wait(
            previous, current, elapsed_fraction, window_s, limit, cost),
    )


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
    async def subscribe_stop(
        self, conversation_id: str, handler: StopHandler
    ) -> Callable[[], None]:
        """Call `handler(conversation_id)` on a stop for it; returns the unsubscribe function."""

    # -- rate limits -----------------------------------------------------------------------------

    @abc.abstractmethod
    async def rate_check(self, key: str, limit: int, window_s: float, cost: int) -> RateDecision:
        """Whether `cost` more units fit under `limit` per sliding `window_s`; counts them when
        they do (pass cost 0 to only look). Deciding and counting are one step: concurrent
        checks, from any number of processes sharing the back end, never admit past the
        limit. See `sliding_window_decision` for the arithmetic."""

    @abc.abstractmethod
    async def rate_add(self, key: str, window_s: float, cost: int) -> None:
        """Count `cost` units that were used (tokens, known after the fact), in one step with
        what concurrent checks count."""

    # -- session ownership leases ------------------------------------------------------------

    @abc.abstractmethod
    async def acquire_lease(self, name: str, holder: str, ttl: float) -> bool:
        """Hold `name` for `holder` (or renew it) unless another holder has it."""

    @abc.abstractmethod
    async def release_lease(self, name: str, holder: str) -> None: ...

    @abc.abstractmethod
    async def lease_holder(self, name: str) -> str | None: ...

    # -- a reply's events, for a client that comes back --------------------------------------------

    @abc.abstractmethod
    async def append_event(self, stream: str, event: dict[str, Any], ttl: float) -> None:
        """Buffer one event of a reply (start, delta, tool_call, done, error)."""

    @abc.abstractmethod
    def read_events(self, stream: str, timeout: float) -> AsyncIterator[dict[str, Any]]:
        """Every buffered event of a reply, then the live ones, until `done` or `error` (or
        `timeout` seconds without one)."""
