"""SessionStore: a conversation's KV kept between turns.

After a turn, the session keeps references on the blocks of its prompt and generated tokens
(pinned). The next turn's prompt is matched token by token against them (longest common
prefix, down to the token) and only the rest is prefilled; whatever lies past a divergence
(an edited or regenerated message, trimmed history) is released.

Idle sessions are ordered least recently used. Under memory pressure the coldest are
offloaded to the host pool (restored by copying on their next turn) or, when the host pool is
full too, dropped: the conversation's history stays in the database, so a dropped session
costs recompute, never data.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .config import CacheConfig, SessionBudget
from .kv_cache_manager import KVCacheManager, KVState
from .stats import CacheStats


class SessionState(enum.Enum):
    EMPTY = "empty"  # known, holds no KV (new, dropped, or budget 0)
    RESIDENT = "resident"  # KV pinned in the device pool
    OFFLOADED = "offloaded"  # KV copied to the host pool
    ACTIVE = "active"  # a request of the session is running and holds the KV


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
    ) -> None:
        self.config = config
        self.manager = manager
        self.pool = manager.pool
        self.host_pool = manager.host_pool
        self.stats = stats
        self.block_size = manager.block_size
        self.sessions: dict[str, Session] = {}
        # Idle sessions holding KV (RESIDENT or OFFLOADED), least recently used first.
        self._idle: OrderedDict[str, None] = OrderedDict()
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
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = Session(session_id, salt)
        if session.state is SessionState.ACTIVE or session.salt != salt:
            # Another turn of it is running (or the tenant differs): no sharing.
            return Reuse()
        self._idle.pop(session_id, None)
        session.active_request_id = request_id
        state = session.state
        session.state = SessionState.ACTIVE
        match = min(common_prefix_len(session.token_ids, token_ids), len(token_ids) - 1)
        if state is SessionState.RESIDENT:
            self.manager.truncate(session.kv, match)
            self.manager.hand_over(session.kv, kv)
            return Reuse(from_session=match)
        if state is SessionState.OFFLOADED:
            restored = self.manager.restore(
                session.kv, session.token_ids, match, kv, self.make_room
            )
            self.stats.session_restores += 1
            return Reuse(from_host=restored.from_host, from_prefix_cache=restored.from_prefix_cache)
        return Reuse()

    # -- a turn ends -----------------------------------------------------------------------------

    def release(
        self, session_id: str, request_id: str, token_ids: Sequence[int], kv: KVState
    ) -> None:
        """Pin a finished turn's KV in its session (within budget), or free it."""
        session = self.sessions.get(session_id)
        if session is None or session.active_request_id != request_id:
            self.manager.free(kv)
            return
        session.active_request_id = None
        session.num_turns += 1
        session.last_used = time.monotonic()
        budget = self.budget(session_id)
        keep = kv.num_computed_tokens
        if budget.max_kv_tokens is not None:
            keep = min(keep, budget.max_kv_tokens)
        if keep == 0 or not self.config.enable_sessions:
            self.manager.free(kv)
            session.token_ids, session.state = [], SessionState.EMPTY
            return
        self.manager.truncate(kv, keep)
        session.kv = KVState(salt=kv.salt)
        self.manager.hand_over(kv, session.kv)
        session.token_ids = list(token_ids[:keep])
        session.state = SessionState.RESIDENT
        self._idle[session_id] = None
        self._enforce_max_pinned()

    def abandon(self, session_id: str, request_id: str) -> None:
        """A turn failed (its KV already freed): the session keeps nothing of it and is idle
        again, empty."""
        session = self.sessions.get(session_id)
        if session is None or session.active_request_id != request_id:
            return
        session.active_request_id = None
        session.last_used = time.monotonic()
        session.token_ids, session.state = [], SessionState.EMPTY

    # -- pressure ---------------------------------------------------------------------------------

    def make_room(self, num_blocks: int) -> bool:
        """Offload (or drop) idle resident sessions, coldest first, until `num_blocks` blocks
        are free. Returns whether they are."""
        while not self.pool.can_allocate(num_blocks):
            victim = self._coldest(SessionState.RESIDENT)
            if victim is None:
                return False
            self.evict(victim.session_id)
        return True

    def maintain(self) -> None:
        """Between steps: below the low watermark, evict idle sessions up to the high one."""
        total = self.pool.num_blocks
        if self.pool.num_free_blocks < self.config.watermark_low * total:
            self.make_room(int(self.config.watermark_high * total))

    def evict(self, session_id: str, *, offload: bool = True) -> str:
        """Move an idle session's KV out of the device pool: to host when `offload` and room
        allows, else drop it. Returns what happened: offloaded | dropped | noop."""
        session = self.sessions.get(session_id)
        if session is None or session.state is not SessionState.RESIDENT:
            if session is not None and session.state is SessionState.OFFLOADED and not offload:
                self._drop_host(session)
                return "dropped"
            return "noop"
        if offload and self.host_room(len(session.kv.block_ids)):
            self.manager.swap_out(session.kv)
            session.state = SessionState.OFFLOADED
            self._idle[session_id] = None  # still idle, now on host
            self.stats.session_offloads += 1
            return "offloaded"
        self.manager.free(session.kv)
        session.token_ids = []
        session.state = SessionState.EMPTY
        self._idle.pop(session_id, None)
        self.stats.session_drops += 1
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
        del self.sessions[session_id]

    def host_room(self, num_blocks: int) -> bool:
        """Whether `num_blocks` host blocks are free, dropping the coldest offloaded sessions
        to free them if need be."""
        if num_blocks > self.host_pool.num_blocks:
            return False
        while not self.host_pool.can_allocate(num_blocks):
            coldest = self._coldest(SessionState.OFFLOADED)
            if coldest is None:
                return False
            self._drop_host(coldest)
        return True

    def _drop_host(self, session: Session) -> None:
        self.manager.free(session.kv)
        session.token_ids = []
        session.state = SessionState.EMPTY
        self._idle.pop(session.session_id, None)
        self.stats.session_drops += 1

    def _coldest(self, state: SessionState) -> Session | None:
        for session_id in self._idle:
            session = self.sessions[session_id]
            if session.state is state:
                return session
        return None

    def _enforce_max_pinned(self) -> None:
        limit = self.config.max_pinned_sessions
        if limit is None:
            return
        while self.num_resident > limit:
            victim = self._coldest(SessionState.RESIDENT)
            if victim is None:
                return
            self.evict(victim.session_id)
