"""A replica's drain: what happens between SIGTERM and the process's exit, so a rolling restart
behind a load balancer loses no request and no message.

1. `begin()` (the first SIGTERM or SIGINT): `/readyz` answers 503 `draining` from now on, so
   the balancer's health checks take the replica out of rotation; the replica still serves
   whatever reaches it meanwhile.
2. The grace: the process keeps listening until the balancer has seen it draining — `probes`
   answers of `/readyz` since `begin()` (when `probes` > 0), or `grace` seconds, whichever
   comes first. A request that reaches the replica after it stopped listening is refused at
   the connection, which a balancer retries on another replica (HAProxy's `retries` with
   `option redispatch`), so the grace spares retries; it is not what makes the drain safe.
3. uvicorn stops listening and waits for open connections; in-flight turns finish within
   `drain_timeout` (past it the engine stops them and they are stored interrupted, as on
   any shutdown).
4. `before_exit()`: the exit hooks, with the engine stopped and its KV pool still in memory.
   The one registered by default, `persist_pinned_sessions`, is where pinned sessions' blocks
   go to the KV store (each finished turn queued its blocks already: this waits for the
   writer) so the replicas their conversations move to load them instead of recomputing.
5. Leases are released, connections closed (each at most `CLOSE_TIMEOUT_S`: a Redis or a
   database that stops answering must not keep the process from exiting; one that overran is
   logged with every asyncio task's await chain), the process exits.

With `grace` 0 (the default of a single process) a signal stops the server at once, as
before.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvchat.app.engine_client import EngineClient
from kvchat.app.ops import stacks
from kvchat.inference import MemoryReport
from kvchat.memory import SessionState

log = logging.getLogger(__name__)

ExitHook = Callable[[], Awaitable[None]]

# The most seconds one close at exit (leases, the coordinator, the database) may take. The
# fleet's bound on a replica's exit (app/fleet/processes.py) leaves 30 s for all of them.
CLOSE_TIMEOUT_S = 5.0


async def bounded_close(
    what: str, close: Awaitable[None], timeout: float = CLOSE_TIMEOUT_S
) -> bool:
    """Await `close` for at most `timeout` seconds. Past it the close is cancelled and logged
    with what every task was awaiting at that moment, and the exit goes on. Returns whether
    it finished."""
    task = asyncio.ensure_future(close)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if done:
        if task.exception() is not None:
            log.error("exit: %s failed", what, exc_info=task.exception())
        return True
    chains = io.StringIO()
    stacks.dump_tasks(chains)
    log.error(
        "exit: %s did not finish within %.0f s: cancelled, the exit goes on. What the "
        "tasks awaited:\n%s",
        what,
        timeout,
        chains.getvalue(),
    )
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)
    return False


@dataclass
class Drain:
    """The drain state of one replica. `grace`: the most seconds it keeps serving after
    `begin()`; `probes`: readiness answers after which the balancer has seen it (0: only
    time counts). `clock` is injectable (monotonic seconds)."""

    grace: float = 0.0
    probes: int = 0
    clock: Callable[[], float] = time.monotonic
    exit_hooks: list[ExitHook] = field(default_factory=list)
    since: float | None = None
    probes_answered: int = 0

    def __post_init__(self) -> None:
        if self.grace < 0:
            raise ValueError(f"drain grace must be >= 0, got {self.grace}")
        if self.probes < 0:
            raise ValueError(f"drain probes must be >= 0, got {self.probes}")

    @property
    def is_draining(self) -> bool:
        return self.since is not None

    @property
    def is_graceful(self) -> bool:
        """Whether a signal should start a drain (a grace is configured) rather than stop
        the server at once."""
        return self.grace > 0

    def begin(self) -> None:
        """Not ready from now on (idempotent: a second call keeps the first start)."""
        if self.since is None:
            self.since = self.clock()
            log.warning("draining: /readyz answers 503; serving for up to %.1f s more", self.grace)

    def probed(self) -> None:
        """`/readyz` answered `draining` once more."""
        if self.is_draining:
            self.probes_answered += 1

    def is_grace_over(self) -> bool:
        """Whether the server may stop listening: the balancer has seen the replica draining
        (`probes` answers), or the grace has run out."""
        if self.since is None:
            return False
        if self.probes and self.probes_answered >= self.probes:
            return True
        return self.clock() - self.since >= self.grace

    async def before_exit(self) -> None:
        """Run the exit hooks in order; a failing hook is logged and the next ones run."""
        for hook in self.exit_hooks:
            try:
                await hook()
            except Exception:
                log.exception("exit hook %s failed", getattr(hook, "__name__", hook))


@dataclass(frozen=True)
class PinnedSessions:
    """The sessions holding KV on this replica (on the device or the host) and their tokens."""

    num_sessions: int
    num_tokens: int


def pinned_sessions(report: MemoryReport) -> PinnedSessions:
    pinned = [
        s for s in report.sessions if s.state in (SessionState.RESIDENT, SessionState.OFFLOADED)
    ]
    return PinnedSessions(len(pinned), sum(s.num_tokens for s in pinned))


async def persist_pinned_sessions(engine: EngineClient, timeout: float) -> None:
    """Make sure every pinned session's KV blocks are in the KV store before the process
    exits, so the replica each conversation moves to (or this one, restarted) loads its KV
    instead of recomputing it. Each finished turn queued its blocks already (write-behind);
    this queues what is left (none, normally) and waits for the writer, at most `timeout`
    seconds. The engine has stopped: it is read directly."""
    pinned = pinned_sessions(await engine.memory_report())
    if not engine.has_kv_store:
        if pinned.num_sessions:
            log.warning(
                "exiting with %d pinned sessions (%d tokens of KV) and no KV store: "
                "their conversations recompute on their next turn",
                pinned.num_sessions,
                pinned.num_tokens,
            )
        return
    began = time.monotonic()
    queued = await engine.persist_sessions(timeout)
    log.info(
        "KV store: %d pinned sessions (%d tokens) kept on disk (%d blocks written at "
        "exit) in %.2f s",
        pinned.num_sessions,
        pinned.num_tokens,
        queued,
        time.monotonic() - began,
    )
