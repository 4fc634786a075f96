"""The coordination interface the service programs against."""

from __future__ import annotations

import abc
import math
import os
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class IdempotencyRecord:
    """What the first request with an Idempotency-Key left: its body's fingerprint, its
    result once it finished (None while it runs), and the attempt running it (`attempt`:
    its id, its process as in LockHolder, and what it has stored so far, e.g. the turn lock's
    token and the user message id), so a retry can tell a live attempt from a dead one."""

    fingerprint: str
    result: dict[str, Any] | None = None
    attempt: dict[str, Any] = field(default_factory=dict)

    @property
    def is_done(self) -> bool:
        return self.result is not None

    def record(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "result": self.result, "attempt": self.attempt}

    @classmethod
    def of(cls, record: dict[str, Any]) -> IdempotencyRecord:
        attempt = record.get("attempt")
        return cls(
            str(record.get("fingerprint", "")),
            record.get("result"),
            attempt if isinstance(attempt, dict) else {},
        )


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


@dataclass(frozen=True)
class ProcessIdentity:
    """Who this process is, as lock and lease records name it: the replica id operators see,
    and the host, process id and a random instance id that tell a dead holder from a live
    one (a restarted container has the same host name and often the same pid, never the same
    instance)."""

    replica_id: str
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    instance: str = field(default_factory=lambda: secrets.token_hex(8))

    def process(self) -> dict[str, Any]:
        """This process as records name it (a lock's holder, an idempotent attempt)."""
        return {
            "owner": self.replica_id,
            "host": self.host,
            "pid": self.pid,
            "instance": self.instance,
        }

    def is_dead(self, holder: LockHolder | dict[str, Any]) -> bool:
        """Whether the process that holds a lock (or a record naming a process as
        `process()` does) is known to be gone: an earlier incarnation of this replica, or a
        process of this host that no longer runs. Processes on other hosts are never known
        dead here (their locks expire instead)."""
        record = holder.record() if isinstance(holder, LockHolder) else holder
        instance, owner = record.get("instance"), record.get("owner")
        host, pid = record.get("host"), record.get("pid")
        if instance == self.instance:
            return False
        if host == self.host and pid == self.pid:
            # This process, or an earlier one that had its pid (a restarted container):
            # this process knows its own live instances.
            return instance not in _LIVE_INSTANCES
        if owner == self.replica_id:
            return True  # a replica id names one live process; this one is it now
        if host != self.host or not isinstance(pid, int):
            return False
        return not _process_exists(pid)

    def __post_init__(self) -> None:
        _LIVE_INSTANCES.add(self.instance)

    def retire(self) -> None:
        """This identity's app has stopped (its locks are released or expiring)."""
        _LIVE_INSTANCES.discard(self.instance)


# The identities alive in this process (tests run several apps in one process).
_LIVE_INSTANCES: set[str] = set()


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock: the acquisition's token (it alone renews and releases it), the
    holding process, a fencing token (strictly increasing across every acquisition: storage
    that records the fence of its last writer refuses an older one) and what it is held for
    (`purpose`: "turn", "delete", "summary"), with free-form `data` (the reply being
    generated)."""

    token: str
    owner: str
    host: str
    pid: int
    instance: str
    fence: int
    purpose: str
    data: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {
            "token": self.token,
            "owner": self.owner,
            "host": self.host,
            "pid": self.pid,
            "instance": self.instance,
            "fence": self.fence,
            "purpose": self.purpose,
            "data": self.data,
        }

    @classmethod
    def of(cls, record: dict[str, Any]) -> LockHolder:
        data = record.get("data")
        return cls(
            token=str(record["token"]),
            owner=str(record["owner"]),
            host=str(record["host"]),
            pid=int(record["pid"]),
            instance=str(record["instance"]),
            fence=int(record["fence"]),
            purpose=str(record["purpose"]),
            data=data if isinstance(data, dict) else {},
        )


def window_ms(window_s: float) -> int:
    """A rate-limit window's length in whole milliseconds, the unit windows are counted in."""
    assert window_s >= 0.001, window_s
    return round(window_s * 1000)


def sliding_window_count(previous: float, current: float, elapsed_fraction: float) -> float:
    """The sliding-window estimate from two fixed windows (the previous one weighted by how
    much of it still overlaps the sliding window), as Cloudflare's rate limiter does."""
    return previous * (1.0 - elapsed_fraction) + current


def sliding_window_wait(
    previous: float,
    current: float,
    elapsed_fraction: float,
    window_s: float,
    limit: int,
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
    previous: float,
    current: float,
    elapsed_fraction: float,
    window_s: float,
    limit: int,
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
        retry_after=0.0
        if allowed
        else sliding_window_wait(previous, current, elapsed_fraction, window_s, limit, cost),
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

    # -- owned, fenced, expiring locks (one turn at a time per conversation) --------------------
    #
    # A lock is a lease: it expires `ttl` seconds after it was taken or last renewed, so a
    # holder that dies frees it within `ttl`; its holder renews it while it works (see
    # app/coord/locks.py). Only the acquisition's token renews or releases it.

    @abc.abstractmethod
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
        """Take `key` unless another token holds it. Returns (taken, the holder now): when
        taken, the new holder with a fence above every fence issued before and above
        `fence_floor` (the fence the storage last saw, so a reset back end never issues an
        old one)."""

    @abc.abstractmethod
    async def lock_renew(self, key: str, token: str, ttl: float) -> bool:
        """Extend `key` by `ttl` if `token` still holds it; False when it was lost."""

    @abc.abstractmethod
    async def lock_release(self, key: str, token: str) -> bool:
        """Release `key` if `token` holds it (also: break a dead holder's lock by its token).
        Whether it was released."""

    @abc.abstractmethod
    async def lock_holder(self, key: str) -> LockHolder | None:
        """Who holds `key` now (None: free or expired)."""

    @abc.abstractmethod
    async def lock_scan(self, prefix: str) -> list[tuple[str, LockHolder]]:
        """Every live lock whose key starts with `prefix` (start-up takes over dead holders')."""

    # -- idempotency -----------------------------------------------------------------------------

    @abc.abstractmethod
    async def idempotency_begin(
        self, key: str, fingerprint: str, ttl: float, attempt: dict[str, Any] | None = None
    ) -> IdempotencyRecord | None:
        """Claim `key` for a new request run by `attempt` (returns None), or return the
        record of the request that claimed it first."""

    @abc.abstractmethod
    async def idempotency_progress(self, key: str, attempt_id: str, fields: dict[str, Any]) -> bool:
        """Merge `fields` into the running attempt's entry if `attempt_id` still runs it."""

    @abc.abstractmethod
    async def idempotency_takeover(
        self, key: str, dead_attempt_id: str, attempt: dict[str, Any]
    ) -> IdempotencyRecord | None:
        """Hand an unfinished record from a dead attempt to `attempt` (a retry that re-runs
        it), atomically: the updated record, or None when the record changed meanwhile (it
        finished, or another retry took it over first)."""

    @abc.abstractmethod
    async def idempotency_finish(
        self, key: str, result: dict[str, Any], ttl: float, attempt_id: str | None = None
    ) -> None:
        """Store the first request's result; later requests with the key get it. With
        `attempt_id`, only while that attempt still runs the record (an attempt a retry took
        over, or whose record a retry abandoned, never writes over it)."""

    @abc.abstractmethod
    async def idempotency_abandon(self, key: str, attempt_id: str | None = None) -> None:
        """The request failed before producing anything: let a retry start afresh (only if
        `attempt_id`, when given, still runs it)."""

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
    async def take_lease(self, name: str, holder: str, ttl: float) -> str | None:
        """Hold `name` for `holder` whoever holds it now; returns the holder it had (None when
        none or expired). For a replica that has just served a conversation's turn under its
        fenced turn lock: its copy of the session is the newest, wherever the last one was."""

    @abc.abstractmethod
    async def release_lease(self, name: str, holder: str) -> None: ...

    @abc.abstractmethod
    async def lease_holder(self, name: str) -> str | None: ...

    # -- a reply's events, for a client that comes back --------------------------------------------

    @abc.abstractmethod
    async def append_event(self, stream: str, event: dict[str, Any], ttl: float) -> None:
        """Buffer one event of a reply (start, delta, tool_call, done, error)."""

    @abc.abstractmethod
    async def buffered_events(self, stream: str) -> list[dict[str, Any]]:
        """The events buffered for a reply so far, without waiting for more (recovery after a
        crash reads what clients were sent)."""

    @abc.abstractmethod
    def read_events(self, stream: str, timeout: float) -> AsyncIterator[dict[str, Any]]:
        """Every buffered event of a reply, then the live ones, until `done` or `error` (or
        `timeout` seconds without one)."""
