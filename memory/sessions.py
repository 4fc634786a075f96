"""SessionStore: a conversation's KV kept between turns.

After a turn, the session keeps references on the blocks of its prompt and generated tokens
(pinned). The next turn's prompt is matched token by token against them (longest common
prefix, down to the token) and only the rest is prefilled; whatever lies past a divergence
(an edited or regenerated message, trimmed history) is released.

Which idle session's KV stays where is the retention policy's (memory.retention): under
memory pressure `pinned` moves the least recently used idle session to the host pool, then
drops it; `predictive` moves the one whose KV is worth least (by when its next turn will come)
down a tier, device -> host -> the KV store on disk (the session keeps its token ids, so a
prefetch can load it back) -> nowhere, and brings a session back up ahead of a predicted
return or at once when its user types; `lru` keeps no session's KV past its turn (the prefix
cache's blocks stay findable until reused). A dropped session costs recompute, never data:
the conversation's history stays in the database.
"""

from __future__ import annotations

import bisect
import enum
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from .config import CacheConfig, SessionBudget
from .kv_cache_manager import KVCacheManager, KVState
from .retention import (
    DEVICE,
    DISK,
    HOST,
    NOWHERE,
    Prediction,
    RetentionPolicy,
    Signals,
)
from .stats import CacheStats

VALUE_TTL_S = 1.0  # how long a tier's ranking of its idle sessions is reused
PREFETCH_BATCH = 32  # sessions the prefetch scan looks at in one call


class SessionState(enum.Enum):
    EMPTY = "empty"  # known, holds no KV (new, dropped, or budget 0)
    RESIDENT = "resident"  # KV pinned in the device pool
    OFFLOADED = "offloaded"  # KV copied to the host pool
    STORED = "stored"  # KV only in the KV store on disk (its full blocks); token ids kept
    ACTIVE = "active"  # a request of the session is running and holds the KV


TIER_OF = {
    SessionState.RESIDENT: DEVICE,
    SessionState.ACTIVE: DEVICE,
    SessionState.OFFLOADED: HOST,
    SessionState.STORED: DISK,
    SessionState.EMPTY: NOWHERE,
}


@dataclass
class Session:
    session_id: str
    salt: str | None
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV is held
    # Device blocks while RESIDENT, host blocks (and the hashes) while OFFLOADED.
    kv: KVState = field(default_factory=KVState)
    state: SessionState = SessionState.EMPTY
    active_request_id: str | None = None
    num_turns: int = 0
    last_used: float = field(default_factory=time.monotonic)  # when a turn last ended
    signals: Signals = field(default_factory=Signals)  # what predicts its next turn
    prefetched_at: float | None = None  # brought up ahead of its turn, not claimed since
    moved_down: bool = False  # an operator moved it out: no prefetch before its next turn

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SessionTally:
    """The idle sessions holding KV: how many on the device (pinned) and on the host, and the
    device blocks the pinned ones hold."""

    num_resident: int = 0
    num_offloaded: int = 0
    num_pinned_blocks: int = 0


@dataclass(frozen=True)
class Reuse:
    """What a claim gave a new turn: tokens reused in place and tokens copied from host."""

    from_session: int = 0
    from_host: int = 0
    from_prefix_cache: int = 0


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionStore:
    def __init__(
        self,
        config: CacheConfig,
        manager: KVCacheManager,
        stats: CacheStats,
        *,
        bytes_per_block: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.manager = manager
        self.pool = manager.pool
        self.host_pool = manager.host_pool
        self.stats = stats
        self.block_size = manager.block_size
        self.bytes_per_block = bytes_per_block or 1
        self.clock = clock
        self.retention = RetentionPolicy(config.retention, clock)
        self.mode = config.retention.mode
        self.sessions: dict[str, Session] = {}
        # Idle sessions holding KV (RESIDENT or OFFLOADED), least recently used first.
        self._idle: OrderedDict[str, None] = OrderedDict()
        # Sessions whose KV is only on disk (STORED), oldest first.
        self._stored: OrderedDict[str, None] = OrderedDict()
        self._next_prefetch = 0.0
        # The policy's cost stays flat with many idle sessions: the idle sessions of each
        # tier are ranked by value once every VALUE_TTL_S (values move slowly with time),
        # sessions that became idle since are ranked in as they come, and eviction walks the
        # ranking; the prefetch scan looks at PREFETCH_BATCH sessions a call, round robin.
        self._rankings = {SessionState.RESIDENT: _Ranking(), SessionState.OFFLOADED: _Ranking()}
        self._prefetch_queue: list[str] = []
        # Budgets may be set and read from other threads (the engine records an operator's
        # or the service's budget at once, and checks requests against it on the caller's
        # thread); the engine thread reads them at each claim/release.
        self._budgets: dict[str, SessionBudget] = {}
        self._budget_lock = threading.Lock()

    # -- budgets --------------------------------------------------------------------------------

    def budget(self, session_id: str) -> SessionBudget:
        with self._budget_lock:
            return self._budgets.get(session_id, self.config.default_budget)

    def set_budget(self, session_id: str, budget: SessionBudget) -> None:
        """Takes effect at the session's next turn (thread-safe)."""
        with self._budget_lock:
            self._budgets[session_id] = budget

    # -- queries ---------------------------------------------------------------------------------

    # The engine thread is the only reader (other threads get the engine's reports).

    @property
    def num_resident(self) -> int:
        return sum(1 for s in self.sessions.values() if s.state is SessionState.RESIDENT)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(
            len(s.kv.block_ids) for s in self.sessions.values() if s.state is SessionState.RESIDENT
        )

    @property
    def num_stored(self) -> int:
        """Idle sessions whose KV is only in the KV store."""
        return len(self._stored)

    def get(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def tally(self) -> SessionTally:
        """One pass over the idle sessions holding KV (every resident or offloaded session is
        idle: a running turn makes its session active), not over every session known."""
        resident = offloaded = pinned_blocks = 0
        for session_id in self._idle:
            session = self.sessions[session_id]
            if session.state is SessionState.RESIDENT:
                resident += 1
                pinned_blocks += len(session.kv.block_ids)
            else:
                offloaded += 1
        return SessionTally(resident, offloaded, pinned_blocks)

    # -- a turn begins ---------------------------------------------------------------------------

    def claim(
        self,
        session_id: str,
        salt: str | None,
        request_id: str,
        token_ids: Sequence[int],
        kv: KVState,
    ) -> Reuse:
        """Hand the session's KV to a new turn's (empty) `kv`, as far as it matches `token_ids`.
        At least the last token is left to compute."""
        assert not kv.block_ids and kv.num_computed_tokens == 0
        if not self.config.enable_sessions:
            return Reuse()
        session = self.session(session_id, salt)
        if session.num_turns == 0 and session.state is SessionState.EMPTY:
            # Made by a note (its WebSocket opened before its first turn): it holds nothing,
            # and is its first turn's tenant's.
            session.salt = salt
        if session.state is SessionState.ACTIVE or session.salt != salt:
            # Another turn of it is running (or the tenant differs): no sharing.
            return Reuse()
        now = self.clock()
        self.retention.turn_began(session.signals, now)
        self._idle.pop(session_id, None)
        self._stored.pop(session_id, None)
        session.active_request_id = request_id
        session.moved_down = False
        state = session.state
        session.state = SessionState.ACTIVE
        if session.prefetched_at is not None:
            session.prefetched_at = None
            self.stats.prefetches_used += 1
        match = min(common_prefix_len(session.token_ids, token_ids), len(token_ids) - 1)
        if state is SessionState.RESIDENT:
            self.stats.session_hits_device += 1
            self.manager.truncate(session.kv, match)
            self.manager.hand_over(session.kv, kv)
            return Reuse(from_session=match)
        if state is SessionState.OFFLOADED:
            self.stats.session_hits_host += 1
            restored = self.manager.restore(
                session.kv, session.token_ids, match, kv, self.make_room
            )
            self.stats.session_restores += 1
            return Reuse(from_host=restored.from_host, from_prefix_cache=restored.from_prefix_cache)
        if state is SessionState.STORED:  # the scheduler loads its blocks from the store
            self.stats.session_hits_disk += 1
            session.token_ids = []
        return Reuse()

    def session(self, session_id: str, salt: str | None = None) -> Session:
        """The session (made on first use)."""
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = Session(session_id, salt)
        return session

    # -- a turn ends -----------------------------------------------------------------------------

    def release(
        self,
        session_id: str,
        request_id: str,
        token_ids: Sequence[int],
        kv: KVState,
        end: str = "stop",
    ) -> None:
        """Pin a finished turn's KV in its session (within budget), or free it. `end`: how the
        turn ended (memory.retention.TURN_ENDS; the service may report it better later)."""
        session = self.sessions.get(session_id)
        if session is None or session.active_request_id != request_id:
            self.manager.free(kv)
            return
        session.active_request_id = None
        session.num_turns += 1
        session.last_used = self.clock()
        self.retention.turn_ended(session.signals, end, session.last_used)
        budget = self.budget(session_id)
        session.signals.owner = session.salt
        session.signals.ttl_s = budget.retention_ttl_s
        session.signals.priority = (
            50 if budget.retention_priority is None else budget.retention_priority
        )
        keep = kv.num_computed_tokens
        if budget.max_kv_tokens is not None:
            keep = min(keep, budget.max_kv_tokens)
        if keep == 0 or not self.config.enable_sessions or self.mode == "lru":
            # lru: nothing kept past the turn; its full blocks stay findable by hash.
            self.manager.free(kv)
            session.token_ids, session.state = [], SessionState.EMPTY
            return
        self.manager.truncate(kv, keep)
        session.kv = KVState(salt=kv.salt)
        self.manager.hand_over(kv, session.kv)
        session.token_ids = list(token_ids[:keep])
        session.state = SessionState.RESIDENT
        self._idle[session_id] = None
        self._rerank(session)
        self._enforce_max_pinned()

    def abandon(self, session_id: str, request_id: str) -> None:
        """A turn failed (its KV already freed): the session keeps nothing of it and is idle
        again, empty."""
        session = self.sessions.get(session_id)
        if session is None or session.active_request_id != request_id:
            return
        session.active_request_id = None
        session.last_used = self.clock()
        session.token_ids, session.state = [], SessionState.EMPTY

    # -- signals --------------------------------------------------------------------------------

    def note(
        self,
        session_id: str,
        *,
        end: str | None = None,
        typing: bool = False,
        present: bool | None = None,
    ) -> None:
        """What the service knows of a session's next turn (its retention, whose it is and
        its operator's rank come with each turn's budget): how its last turn ended (better
        than the engine can tell: tool calls), its user typing (a session not on the device
        is brought up at once), its WebSocket open or closed."""
        session = self.session(session_id)
        signals = session.signals
        now = self.clock()
        self._rerank(session)
        if end is not None:
            self.retention.turn_ended(signals, end, now)
        if present is not None:
            signals.present = present
        if typing:
            signals.typing_at = now
            if self.mode == "predictive":
                self._prefetch(session, now, urgent=True)

    def predict(self, session: Session) -> Prediction:
        """The policy's view of a session now (for reports)."""
        tier = TIER_OF[session.state]
        return self.retention.predict(
            session.signals,
            tier,
            self._below(tier, len(session.kv.block_ids) or len(session.kv.host_block_ids)),
            session.num_tokens,
            self._bytes(session),
        )

    # -- pressure ---------------------------------------------------------------------------------

    def make_room(self, num_blocks: int, *, spare_held: bool = False) -> bool:
        """Offload (or drop) idle resident sessions until `num_blocks` blocks are free, the
        least worth keeping first. Returns whether they are. `spare_held`: held sessions stay
        (room for a prefetch; a running request's room breaks holds)."""
        if self.pool.can_allocate(num_blocks):
            return True
        spare_held = spare_held and self.mode == "predictive"  # only its policy holds
        now = self.clock()
        for victim in self._victims(SessionState.RESIDENT):
            if spare_held and self.retention.held(victim.signals, now):
                continue
            self.evict(victim.session_id)
            if self.pool.can_allocate(num_blocks):
                return True
        return False

    def is_idle_on_device(self, session_id: str | None) -> bool:
        """Whether the session's KV is on the device, no turn of it running."""
        session = self.sessions.get(session_id) if session_id is not None else None
        return session is not None and session.state is SessionState.RESIDENT

    def should_wait(self, num_blocks: int, waited_s: float) -> bool:
        """Whether a waiting request that needs `num_blocks` more should stay waiting rather
        than break holds (predictive only). Idle sessions that are not held make room first;
        if held ones are all that stand in the way, the request waits for as long as breaking
        their holds would cost their own next turns (the reload each would need, times how
        likely its turn is: Continuum's trade of a tool call's wait against its recompute),
        and then goes ahead and breaks them. A running request never waits on a hold."""
        if self.mode != "predictive" or self.make_room(num_blocks, spare_held=True):
            return False
        cost = self.hold_cost_s(num_blocks)
        return cost is not None and waited_s < cost

    def hold_cost_s(self, num_blocks: int) -> float | None:
        """The expected reload seconds that freeing `num_blocks` by breaking holds would cost
        the held resident sessions it takes (in the order they would leave); None when the
        idle resident sessions cannot free that many at all."""
        now = self.clock()
        free = self.pool.num_free_blocks
        cost = 0.0
        for victim in self._victims(SessionState.RESIDENT):
            blocks = len(victim.kv.block_ids)
            if self.retention.held(victim.signals, now):
                below = self._below(DEVICE, blocks)
                p = self.retention.p_return_within(
                    victim.signals, self.config.retention.horizon_s[0], now
                )
                reload_s = self.retention.reload_s(
                    below, victim.num_tokens, blocks * self.bytes_per_block
                )
                cost += p * reload_s
            free += blocks
            if free >= num_blocks:
                return cost
        return None

    def maintain(self) -> None:
        """Between steps: below the low watermark, evict idle sessions up to the high one (held
        ones stay: their turn is seconds away, and a running request's room still breaks a
        hold); and (predictive) bring up the sessions whose next turn is near."""
        copied = self.manager.copy_times
        self.retention.observe_copies(
            copied.host_blocks * self.bytes_per_block,
            copied.host_s,
            copied.store_blocks * self.bytes_per_block,
            copied.store_s,
        )
        total = self.pool.num_blocks
        if self.pool.num_free_blocks < self.config.watermark_low * total:
            self.make_room(int(self.config.watermark_high * total), spare_held=True)
        if self.mode == "predictive" and (
            self._prefetch_queue or self.clock() >= self._next_prefetch
        ):
            self._prefetch_near()

    def evict(self, session_id: str, *, offload: bool = True, operator: bool = False) -> str:
        """Move an idle session's KV out of the device pool: to host when `offload` and room
        allows, else drop it (to the KV store's copy, under the predictive policy). Returns
        what happened: offloaded | dropped | noop. `operator`: an operator's move, which the
        policy's prefetch leaves be until the session's next turn (its user typing still
        brings it up)."""
        session = self.sessions.get(session_id)
        if operator and session is not None:
            session.moved_down = True
        if session is None or session.state is not SessionState.RESIDENT:
            if session is not None and session.state is SessionState.OFFLOADED and not offload:
                self._drop(session)
                return "dropped"
            return "noop"
        self._note_leaving(session)
        # A session that is not held never pushes a held one off the host: it goes on down.
        spare_held = not self.retention.held(session.signals, self.clock())
        if offload and self.host_room(len(session.kv.block_ids), spare_held=spare_held):
            self.manager.swap_out(session.kv)
            session.state = SessionState.OFFLOADED
            self._idle[session_id] = None  # still idle, now on host
            self._rerank(session)
            self.stats.session_offloads += 1
            return "offloaded"
        self._drop(session)
        return "dropped"

    def close(self, session_id: str) -> None:
        """Forget a session and release everything it holds (an ACTIVE one keeps running; its
        KV is freed when the turn ends)."""
        session = self.sessions.get(session_id)
        if session is None:
            return
        if session.state in (SessionState.RESIDENT, SessionState.OFFLOADED):
            self.manager.free(session.kv)
        self._idle.pop(session_id, None)
        self._stored.pop(session_id, None)
        del self.sessions[session_id]

    def host_room(self, num_blocks: int, *, spare_held: bool = False) -> bool:
        """Whether `num_blocks` host blocks are free, dropping offloaded sessions (the least
        worth keeping first) to free them if need be; `spare_held`: not held ones only."""
        if num_blocks > self.host_pool.num_blocks:
            return False
        if self.host_pool.can_allocate(num_blocks):
            return True
        spare_held = spare_held and self.mode == "predictive"  # only its policy holds
        now = self.clock()
        for victim in self._victims(SessionState.OFFLOADED):
            if spare_held and self.retention.held(victim.signals, now):
                continue
            self._note_leaving(victim)
            self._drop(victim)
            if self.host_pool.can_allocate(num_blocks):
                return True
        return False

    def _drop(self, session: Session) -> None:
        """The session's KV leaves memory: to its KV store copy (predictive, with a store:
        its token ids are kept, so it can be loaded back ahead of its turn), else nowhere."""
        self.manager.free(session.kv)
        self._idle.pop(session.session_id, None)
        self.stats.session_drops += 1
        if self.mode == "predictive" and self.manager.store is not None and session.token_ids:
            session.kv = KVState(salt=session.salt)
            session.state = SessionState.STORED
            self._stored[session.session_id] = None
            return
        session.token_ids = []
        session.state = SessionState.EMPTY

    def _note_leaving(self, session: Session) -> None:
        """Counted as it leaves its tier: a hold broken, a prefetch that went unused."""
        if self.mode != "predictive":
            return
        now = self.clock()
        if self.retention.held(session.signals, now):
            self.stats.holds_broken += 1
        if session.prefetched_at is not None:
            session.prefetched_at = None
            self.stats.prefetches_wasted += 1

    def _victims(self, state: SessionState) -> Iterator[Session]:
        """The idle sessions in `state` (RESIDENT or OFFLOADED), in the order they should
        leave: least recently used first (pinned), or least worth keeping (predictive). The
        caller may move each one as it gets it."""
        if self.mode != "predictive":
            yield from [self.sessions[i] for i in self._idle if self.sessions[i].state is state]
            return
        now = self.clock()
        ranking = self._rankings[state]
        if now - ranking.built_at >= VALUE_TTL_S:
            ranking.rebuild(now, [self.sessions[i] for i in self._idle], state, self._value)
        else:
            ranking.take_in(now, self.sessions, state, self._value)
        yield from ranking.walk(self.sessions, state)

    def _rerank(self, session: Session) -> None:
        """The session's value changed or it became idle in its tier: ranked in anew."""
        ranking = self._rankings.get(session.state)
        if ranking is not None:
            ranking.added.add(session.session_id)

    def _value(self, session: Session, now: float) -> float:
        tier = TIER_OF[session.state]
        return self.retention.value(
            session.signals,
            tier,
            self._below(tier, len(session.kv.block_ids) or len(session.kv.host_block_ids)),
            session.num_tokens,
            self._bytes(session),
            now,
        )

    def _below(self, tier: str, num_blocks: int) -> str:
        """Where KV leaving `tier` goes."""
        if tier == DEVICE and 0 < num_blocks <= self.host_pool.num_blocks:
            return HOST
        if tier in (DEVICE, HOST) and self.manager.store is not None:
            return DISK
        return NOWHERE

    def _bytes(self, session: Session) -> int:
        blocks = len(session.kv.block_ids) or len(session.kv.host_block_ids)
        if not blocks:
            blocks = -(-session.num_tokens // self.block_size)
        return blocks * self.bytes_per_block

    # -- prefetch ---------------------------------------------------------------------------------

    def _prefetch_near(self) -> None:
        """Bring up the sessions not on the device whose next turn is near, into blocks free
        above the low watermark (a prefetch never takes a running request's room): the next
        PREFETCH_BATCH of them, round robin (a pass over all every prefetch_interval_s)."""
        now = self.clock()
        if not self._prefetch_queue:
            self._next_prefetch = now + self.config.retention.prefetch_interval_s
            self._prefetch_queue = [
                i
                for i in (*self._idle, *self._stored)
                if self.sessions[i].state in (SessionState.OFFLOADED, SessionState.STORED)
            ]
            self._prefetch_queue.reverse()  # popped from the end: oldest first
        for _ in range(min(PREFETCH_BATCH, len(self._prefetch_queue))):
            session = self.sessions.get(self._prefetch_queue.pop())
            if session is None or session.state not in (
                SessionState.OFFLOADED,
                SessionState.STORED,
            ):
                continue
            if session.moved_down and not self.retention.typing(session.signals, now):
                continue
            if self.retention.wants_prefetch(session.signals, now):
                self._prefetch(session, now, urgent=False)

    def _prefetch(self, session: Session, now: float, *, urgent: bool) -> bool:
        """Bring the session's KV onto the device ahead of its turn: from the host pool, or
        from the KV store. `urgent` (its user is typing): make room by moving sessions that are
        not held down; otherwise only into free blocks above the low watermark."""
        if session.state not in (SessionState.OFFLOADED, SessionState.STORED):
            return False
        need = len(session.kv.host_block_ids) or -(-session.num_tokens // self.block_size)
        reserve = int(self.config.watermark_low * self.pool.num_blocks)
        if not self.pool.can_allocate(need + reserve) and not (
            urgent and self.make_room(need, spare_held=True)
        ):
            return False
        fresh = KVState(salt=session.salt)
        if session.state is SessionState.OFFLOADED:
            self._idle.pop(session.session_id, None)
            self.manager.restore(
                session.kv, session.token_ids, session.num_tokens, fresh, lambda n: False
            )
            self.stats.prefetch_blocks_from_host += len(fresh.block_ids)
        else:
            self._stored.pop(session.session_id, None)
            self.manager.match_prefix(fresh, session.token_ids)
            before = self.manager.stats.blocks_from_store
            self.manager.load_from_store(fresh, session.token_ids)
            self.stats.prefetch_blocks_from_store += self.manager.stats.blocks_from_store - before
        if fresh.num_computed_tokens == 0:
            self.manager.free(fresh)
            session.kv, session.token_ids, session.state = fresh, [], SessionState.EMPTY
            return False
        session.kv = fresh
        session.token_ids = session.token_ids[: fresh.num_computed_tokens]
        session.state = SessionState.RESIDENT
        session.prefetched_at = now
        self._idle[session.session_id] = None
        self._rerank(session)
        self.stats.prefetches += 1
        return True

    def _enforce_max_pinned(self) -> None:
        limit = self.config.max_pinned_sessions
        if limit is None:
            return
        while self.num_resident > limit:
            victim = next(self._victims(SessionState.RESIDENT), None)
            if victim is None:
                return
            self.evict(victim.session_id)


class _Ranking:
    """The idle sessions of one tier, least worth keeping first: (value, session id), built
    whole every VALUE_TTL_S; sessions that came in since (`added`) are ranked in as they come
    (an entry of a session ranked anew, or gone from the tier, is skipped, and dropped as
    eviction walks by)."""

    def __init__(self) -> None:
        self.built_at = -math.inf
        self.entries: list[tuple[float, str]] = []
        self.current: dict[str, float] = {}  # each ranked session's latest value
        self.added: set[str] = set()

    def rebuild(
        self,
        now: float,
        idle: list[Session],
        state: SessionState,
        value: Callable[[Session, float], float],
    ) -> None:
        self.current = {s.session_id: value(s, now) for s in idle if s.state is state}
        self.entries = sorted((v, i) for i, v in self.current.items())
        self.added.clear()
        self.built_at = now

    def take_in(
        self,
        now: float,
        sessions: dict[str, Session],
        state: SessionState,
        value: Callable[[Session, float], float],
    ) -> None:
        for session_id in self.added:
            session = sessions.get(session_id)
            if session is not None and session.state is state:
                v = self.current[session_id] = value(session, now)
                bisect.insort(self.entries, (v, session_id))
        self.added.clear()

    def walk(self, sessions: dict[str, Session], state: SessionState) -> Iterator[Session]:
        i = 0
        while i < len(self.entries):
            v, session_id = self.entries[i]
            session = sessions.get(session_id)
            if session is None or session.state is not state or self.current.get(session_id) != v:
                del self.entries[i]  # gone from the tier, or ranked anew further on
                continue
            i += 1
            yield session
