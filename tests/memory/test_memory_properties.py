"""Randomized operations on the block pool, prefix cache and sessions (no model): ref counts
always equal the number of holders, every held KV slot holds what its tokens wrote, and
everything returns to the pool at the end."""

from __future__ import annotations

import hashlib

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvchat.memory.block_pool import BlockPool
from kvchat.memory.config import CacheConfig, SessionBudget
from kvchat.memory.kv_cache import KVCache
from kvchat.memory.kv_cache_manager import KVCacheManager, KVState, cdiv
from kvchat.memory.kv_spec import KVCacheSpec
from kvchat.memory.sessions import SessionState, SessionStore
from kvchat.memory.stats import CacheStats

BLOCK = 4
NUM_BLOCKS = 24
HOST_BLOCKS = 12
SESSIONS = ["s0", "s1", "s2", "s3"]
SALTS = [None, "tenant-b"]


def kv_value(salt: str | None, tokens: list[int]) -> float:
    """What a model would write for the last of `tokens`: a function of the whole prefix."""
    digest = hashlib.sha256(repr((salt, tokens)).encode()).digest()
    return float(int.from_bytes(digest[:3], "little"))


class MemoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        config = CacheConfig(block_size=BLOCK, watermark_low=0.2, watermark_high=0.4)
        spec = KVCacheSpec(
            num_layers=1, num_kv_heads=1, head_dim=2, block_size=BLOCK, model_dtype=torch.float32
        )
        self.kv = KVCache(spec, NUM_BLOCKS, torch.device("cpu"), HOST_BLOCKS)
        self.pool = BlockPool(NUM_BLOCKS)
        self.host = BlockPool(HOST_BLOCKS)
        self.manager = KVCacheManager(
            self.pool, self.kv, BLOCK, enable_prefix_caching=True, host_pool=self.host
        )
        self.stats = CacheStats()
        self.sessions = SessionStore(config, self.manager, self.stats)
        self.turns = 0
        self.pinned_under: dict[str, int | None] = {}  # budget in force at a session's last pin

    # -- a fake forward: writes each new token's value into its slot ----------------------------

    def write(self, kv: KVState, tokens: list[int], start: int, end: int) -> None:
        for p in range(start, end):
            block = kv.block_ids[p // BLOCK]
            assert self.pool.is_writable(block), "wrote into a shared or registered block"
            self.kv.kv[0, 0, block, p % BLOCK, 0, :] = kv_value(kv.salt, tokens[: p + 1])

    def check(self, kv: KVState, tokens: list[int]) -> None:
        for p in range(kv.num_computed_tokens):
            block = kv.block_ids[p // BLOCK]
            got = self.kv.kv[0, 0, block, p % BLOCK, 0, 0].item()
            assert got == kv_value(kv.salt, tokens[: p + 1]), f"slot of token {p} is wrong"

    def reserve(self, kv: KVState, total: int) -> bool:
        need = self.manager.blocks_to_reserve(kv, total)
        if not self.pool.can_allocate(need) and not self.sessions.make_room(need):
            return False
        self.manager.reserve_slots(kv, total)
        return True

    @rule(
        session=st.sampled_from([*SESSIONS, None]),
        salt=st.sampled_from(SALTS),
        extend=st.booleans(),
        keep=st.integers(0, 40),
        new=st.lists(st.integers(0, 3), min_size=1, max_size=14),
        generate=st.integers(0, 6),
        abort=st.booleans(),
    )
    def turn(
        self,
        session: str | None,
        salt: str | None,
        extend: bool,
        keep: int,
        new: list[int],
        generate: int,
        abort: bool,
    ) -> None:
        """A request: often the session's history (cut at `keep`) plus new tokens."""
        history: list[int] = []
        if session is not None and extend:
            s = self.sessions.get(session)
            if s is not None:
                history = s.token_ids[:keep]
        tokens = history + new
        request_id = f"r{self.turns}"
        self.turns += 1
        kv = KVState(salt=salt)
        if session is not None:
            self.sessions.claim(session, salt, request_id, tokens, kv)
        self.manager.match_prefix(kv, tokens)
        self.check(kv, tokens)
        assert kv.num_computed_tokens < len(tokens)
        if not self.reserve(kv, len(tokens)):
            self.finish(session, request_id, tokens, kv)
            return
        self.write(kv, tokens, kv.num_computed_tokens, len(tokens))
        self.manager.commit(kv, tokens, len(tokens))
        for step in range(generate):
            if abort and step == generate // 2:
                break
            tokens.append((len(tokens) * 7 + step) % 4)
            if not self.reserve(kv, len(tokens)):
                break
            self.write(kv, tokens, len(tokens) - 1, len(tokens))
            self.manager.commit(kv, tokens, len(tokens))
        self.check(kv, tokens)
        self.finish(session, request_id, tokens, kv)

    def finish(self, session: str | None, request_id: str, tokens: list[int], kv: KVState) -> None:
        if session is None:
            self.manager.free(kv)
        else:
            owner = self.sessions.get(session)
            if owner is not None and owner.active_request_id == request_id:
                self.pinned_under[session] = self.sessions.budget(session).max_kv_tokens
            self.sessions.release(session, request_id, tokens, kv)
            assert not kv.block_ids

    @rule(session=st.sampled_from(SESSIONS), offload=st.booleans())
    def evict(self, session: str, offload: bool) -> None:
        self.sessions.evict(session, offload=offload)

    @rule(session=st.sampled_from(SESSIONS))
    def close(self, session: str) -> None:
        self.sessions.close(session)

    @rule(session=st.sampled_from(SESSIONS), max_kv=st.one_of(st.none(), st.integers(0, 30)))
    def budget(self, session: str, max_kv: int | None) -> None:
        self.sessions.set_budget(session, SessionBudget(max_kv_tokens=max_kv))

    @rule()
    def maintain(self) -> None:
        self.sessions.maintain()

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def ref_counts_equal_holders(self) -> None:
        self.pool.check_invariants()
        self.host.check_invariants()
        holders = [0] * NUM_BLOCKS
        host_holders = [0] * HOST_BLOCKS
        for s in self.sessions.sessions.values():
            assert s.state is not SessionState.ACTIVE
            if s.state is SessionState.RESIDENT:
                for b in s.kv.block_ids:
                    holders[b] += 1
                assert len(s.kv.block_ids) == cdiv(s.num_tokens, BLOCK)
                budget = self.pinned_under.get(s.session_id)
                assert budget is None or s.num_tokens <= budget
            elif s.state is SessionState.OFFLOADED:
                for b in s.kv.host_block_ids:
                    host_holders[b] += 1
                assert not s.kv.block_ids
            else:
                assert not s.kv.block_ids and not s.kv.host_block_ids
        assert [b.ref_count for b in self.pool.blocks] == holders
        assert [b.ref_count for b in self.host.blocks] == host_holders

    @invariant()
    def the_tally_counts_what_a_full_pass_counts(self) -> None:
        states = [s.state for s in self.sessions.sessions.values()]
        tally = self.sessions.tally()
        assert tally.num_resident == states.count(SessionState.RESIDENT)
        assert tally.num_offloaded == states.count(SessionState.OFFLOADED)
        assert tally.num_pinned_blocks == self.sessions.num_pinned_blocks

    @invariant()
    def resident_sessions_hold_their_tokens_kv(self) -> None:
        for s in self.sessions.sessions.values():
            if s.state is SessionState.RESIDENT:
                assert s.kv.num_computed_tokens == s.num_tokens
                self.check(s.kv, s.token_ids)

    def teardown(self) -> None:
        for session in SESSIONS:
            self.sessions.close(session)
        assert all(b.ref_count == 0 for b in self.pool.blocks)
        assert self.pool.num_free_blocks == NUM_BLOCKS
        assert self.host.num_free_blocks == HOST_BLOCKS


MemoryMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_memory_machine = MemoryMachine.TestCase
