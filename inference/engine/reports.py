"""What the engine tells its callers about itself, as frozen dataclasses (as vLLM's
SchedulerStats): request counts, the pools, each session, the counters. Callers read fields,
never the engine's queues or pools.

Two ways out of the engine thread:
- `EngineStats` is built after every step and published whole (one reference swap), so any
  thread may read the latest one: admission control and metrics do.
- `SessionInfo` and `MemoryReport` walk the sessions and block tables: they are built on the
  engine thread, on request (`AsyncEngine.session_info`, `AsyncEngine.memory_report`), or by
  whoever steps a synchronous Engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvchat.memory.block_pool import BlockPool
from kvchat.memory.config import SessionBudget
from kvchat.memory.sessions import TIER_OF, Session, SessionState, SessionStore
from kvchat.memory.stats import CacheStats, KVStoreStats

from .scheduler import Scheduler


@dataclass(frozen=True)
class EngineStats:
    """The engine after a step: requests by queue, the pools' blocks, the idle sessions holding
    KV, and a copy of the cache counters (monotonic; see memory.stats.CacheStats)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_host_blocks: int
    num_used_host_blocks: int
    num_resident_sessions: int  # idle, KV pinned in the device pool
    num_offloaded_sessions: int  # idle, KV in the host pool
    num_pinned_blocks: int  # device blocks the resident sessions hold
    cache: CacheStats
    kv_store: KVStoreStats | None = None  # None: no KV store
    # Steps that raised and the requests they failed (the engine went on; monotonic).
    num_failed_steps: int = 0
    num_failed_requests: int = 0
    # On the CPU with adaptive threads: the count the last step ran on, and how often it changed.
    cpu_threads: int | None = None
    num_cpu_thread_switches: int = 0
    bytes_per_block: int = 0  # of the device pool's blocks (a host block holds as many)
    num_stored_sessions: int = 0  # idle, KV only in the KV store (the retention policy's)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the device pool's blocks in use (0-1)."""
        return self.num_used_blocks / self.num_blocks


@dataclass(frozen=True)
class SessionInfo:
    """A session as an operator sees it. idle_seconds: since its last turn ended (None while a
    turn of it runs); budget: what it is held to from its next turn on."""

    session_id: str
    state: SessionState
    num_tokens: int  # tokens whose KV it holds
    num_device_blocks: int
    num_host_blocks: int
    num_turns: int
    idle_seconds: float | None
    budget: SessionBudget
    # The retention policy's view (memory.retention): the session's class (agent | person),
    # its KV's tier (device | host | disk | none), the median wait for its next turn from now
    # (None: more likely never), the expected prefill seconds its KV saves per byte at its
    # tier, and whether it is held.
    klass: str = "person"
    tier: str = "none"
    next_turn_s: float | None = None
    value: float = 0.0
    held: bool = False

    @property
    def holds_kv(self) -> bool:
        """On the device, on the host, or held by its running turn."""
        return self.state is not SessionState.EMPTY


@dataclass(frozen=True)
class SessionEviction:
    """An eviction's answer: the session just before and just after it, taken on the engine
    thread in one go (None: a session the engine does not know)."""

    before: SessionInfo | None
    after: SessionInfo | None


@dataclass(frozen=True)
class KVSlotUsage:
    """KV slots (one token each): allocated = the slots of every block in use; filled = slots
    holding a token's KV for some holder (running or waiting sequence, pinned session), each
    physical block counted once. allocated - filled is the waste of paging."""

    num_allocated: int
    num_filled: int


@dataclass(frozen=True)
class MemoryReport:
    """Where the KV memory goes: the layout, the latest stats, slot usage and every session."""

    block_size: int
    kv_cache_dtype: str
    bytes_per_token: int
    bytes_per_block: int
    stats: EngineStats
    slots: KVSlotUsage
    sessions: tuple[SessionInfo, ...]


def engine_stats(
    scheduler: Scheduler,
    sessions: SessionStore,
    pool: BlockPool,
    host_pool: BlockPool,
    cache: CacheStats,
    kv_store: KVStoreStats | None = None,
    *,
    num_failed_steps: int = 0,
    num_failed_requests: int = 0,
    cpu_threads: int | None = None,
    num_cpu_thread_switches: int = 0,
    bytes_per_block: int = 0,
) -> EngineStats:
    tally = sessions.tally()
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
        num_blocks=pool.num_blocks,
        num_used_blocks=pool.num_used_blocks,
        num_cached_blocks=pool.num_cached_blocks,
        num_host_blocks=host_pool.num_blocks,
        num_used_host_blocks=host_pool.num_used_blocks,
        num_resident_sessions=tally.num_resident,
        num_offloaded_sessions=tally.num_offloaded,
        num_pinned_blocks=tally.num_pinned_blocks,
        num_stored_sessions=sessions.num_stored,
        cache=dataclasses.replace(cache),
        kv_store=kv_store,
        num_failed_steps=num_failed_steps,
        num_failed_requests=num_failed_requests,
        cpu_threads=cpu_threads,
        num_cpu_thread_switches=num_cpu_thread_switches,
        bytes_per_block=bytes_per_block,
    )


def session_info(sessions: SessionStore, session_id: str) -> SessionInfo | None:
    session = sessions.get(session_id)
    return None if session is None else _describe(sessions, session)


def session_infos(sessions: SessionStore) -> tuple[SessionInfo, ...]:
    """Every session the engine knows."""
    return tuple(_describe(sessions, session) for session in sessions.sessions.values())


def _describe(sessions: SessionStore, session: Session) -> SessionInfo:
    prediction = sessions.predict(session)
    return SessionInfo(
        session_id=session.session_id,
        state=session.state,
        num_tokens=session.num_tokens,
        num_device_blocks=len(session.kv.held_block_ids),
        num_host_blocks=len(session.kv.host_block_ids),
        num_turns=session.num_turns,
        idle_seconds=(
            None
            if session.state is SessionState.ACTIVE
            else round(sessions.clock() - session.last_used, 3)
        ),
        budget=sessions.budget(session.session_id),
        klass=prediction.klass,
        tier=TIER_OF[session.state],
        next_turn_s=prediction.next_turn_s,
        value=prediction.value,
        held=prediction.held,
    )


def kv_slot_usage(
    scheduler: Scheduler, sessions: SessionStore, pool: BlockPool, block_size: int
) -> KVSlotUsage:
    holders = [(s.kv.block_ids, s.num_computed_tokens) for s in scheduler.running]
    holders += [(s.kv.block_ids, s.num_computed_tokens) for s in scheduler.waiting]
    holders += [(s.kv.block_ids, s.kv.num_computed_tokens) for s in sessions.sessions.values()]
    filled: dict[int, int] = {}
    for blocks, num_tokens in holders:
        for i, block_id in enumerate(blocks):
            n = min(block_size, max(0, num_tokens - i * block_size))
            filled[block_id] = max(filled.get(block_id, 0), n)
    return KVSlotUsage(pool.num_used_blocks * block_size, sum(filled.values()))
