"""Retention that knows the conversation: each signal changes the decision it should (an
injected clock drives time), the gap model learns, holds are soft and counted, prefetches
bring sessions up, and the lru mode keeps nothing past a turn."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvchat.inference.engine.scheduler import Scheduler, SchedulerConfig
from kvchat.inference.engine.sequence import Sequence
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.memory.block_pool import BlockPool
from kvchat.memory.config import CacheConfig, MemoryConfigError, RetentionConfig, SessionBudget
from kvchat.memory.kv_cache import KVCache
from kvchat.memory.kv_cache_manager import KVCacheManager, KVState
from kvchat.memory.kv_spec import KVCacheSpec
from kvchat.memory.retention import (
    AGENT,
    PERSON,
    LogGaps,
    RetentionPolicy,
    Signals,
    _normal_quantile,
)
from kvchat.memory.sessions import SessionState, SessionStore
from kvchat.memory.stats import CacheStats

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_store(
    clock: Clock,
    num_blocks: int = 16,
    host_blocks: int = 0,
    mode: str = "predictive",
    retention: dict[str, float] | None = None,
    **config: object,
) -> SessionStore:
    policy = RetentionConfig(mode=mode, **(retention or {}))  # type: ignore[arg-type]
    cfg = CacheConfig(block_size=BS, retention=policy, **config)  # type: ignore[arg-type]
    spec = KVCacheSpec(1, 1, 2, BS, torch.float32)
    kv = KVCache(spec, num_blocks, torch.device("cpu"), host_blocks)
    pool, host = BlockPool(num_blocks), BlockPool(host_blocks)
    manager = KVCacheManager(pool, kv, BS, enable_prefix_caching=True, host_pool=host)
    return SessionStore(
        cfg, manager, CacheStats(), bytes_per_block=spec.bytes_per_block, clock=clock
    )


def turn(
    store: SessionStore,
    sid: str,
    num_tokens: int,
    end: str = "stop",
    first: int = 0,
    salt: str | None = None,
) -> None:
    """One turn of `num_tokens` tokens, all computed, then released (pinned per the mode); its
    blocks made room for as the scheduler does."""
    tokens = list(range(first, first + num_tokens))
    kv = KVState(salt=salt)
    store.claim(sid, salt, f"{sid}-{store.clock()}", tokens, kv)
    assert store.make_room(store.manager.num_new_blocks(kv, num_tokens))
    store.manager.allocate_slots(kv, num_tokens)
    store.manager.commit(kv, tokens, num_tokens)
    store.release(sid, f"{sid}-{store.clock()}", tokens, kv, end)


def tiers(store: SessionStore) -> dict[str, str]:
    return {sid: s.state.value for sid, s in store.sessions.items()}


# -- the model ------------------------------------------------------------------------------------


def test_the_normal_quantile_inverts_the_cdf() -> None:
    for p in (1e-6, 0.01, 0.02425, 0.1, 0.5, 0.9, 0.97575, 0.999):
        z = _normal_quantile(p)
        assert 0.5 * math.erfc(-z / math.sqrt(2)) == pytest.approx(p, rel=1e-6, abs=1e-12)
    with pytest.raises(ValueError):
        _normal_quantile(1.0)


def test_log_gaps_learn_a_log_normal_and_blend_with_the_prior() -> None:
    rng = random.Random(0)
    gaps = LogGaps()
    for _ in range(2000):
        gaps.observe(math.exp(rng.gauss(math.log(30.0), 0.5)))
    mu, sigma = gaps.blended(math.log(126.0), 0.97, weight=4)
    assert math.exp(mu) == pytest.approx(30.0, rel=0.05) and sigma == pytest.approx(0.5, rel=0.1)
    few = LogGaps()
    few.observe(30.0)
    mu_few, _ = few.blended(math.log(126.0), 0.97, weight=4)
    assert math.log(30.0) < mu_few < math.log(126.0)  # one gap moves it a fifth of the way


def test_an_agent_is_expected_back_in_seconds_a_person_in_minutes() -> None:
    clock = Clock()
    policy = RetentionPolicy(RetentionConfig(), clock)
    agent, person = Signals(), Signals()
    policy.turn_ended(agent, "tool_calls", clock())
    policy.turn_ended(person, "stop", clock())
    assert (agent.klass, person.klass) == (AGENT, PERSON)
    assert policy.p_return_within(agent, 5.0, clock()) > 0.8
    assert policy.p_return_within(person, 5.0, clock()) < 0.05
    assert policy.next_turn_s(agent, clock()) < 2.0  # type: ignore[operator]
    assert policy.next_turn_s(person, clock()) is None  # more likely never than not
    person.present = True  # its user has the page open: likely back, in minutes
    wait = policy.next_turn_s(person, clock())
    assert wait is not None and 60 < wait < 300
    # typing: now
    person.typing_at = clock()
    assert policy.p_return_within(person, 1.0, clock()) == 1.0
    assert policy.next_turn_s(person, clock()) == 0.0


def test_a_sessions_own_gaps_override_its_class() -> None:
    """A person who answers every 10 s is expected back in about 10 s, not in minutes."""
    clock = Clock()
    policy = RetentionPolicy(RetentionConfig(), clock)
    quick, plain = Signals(owner="o"), Signals(owner="p")
    for _ in range(12):
        for s in (quick,):
            policy.turn_ended(s, "stop", clock())
            clock.advance(10.0)
            policy.turn_began(s, clock())
    policy.turn_ended(quick, "stop", clock())
    policy.turn_ended(plain, "stop", clock())
    assert policy.p_return_within(quick, 30.0, clock()) > 0.7
    assert policy.p_return_within(plain, 30.0, clock()) < 0.1


# -- decisions ------------------------------------------------------------------------------------


def test_predictive_evicts_the_person_before_the_agent_lru_the_other_way() -> None:
    """Same size, the agent's turn ended first (LRU's victim); it ended in tool calls, so it
    is back in seconds: the person (who just started reading) goes instead."""
    for mode, victim in (("predictive", "person"), ("pinned", "agent")):
        clock = Clock()
        store = make_store(clock, num_blocks=8, mode=mode)
        turn(store, "agent", 4 * BS, end="tool_calls")
        clock.advance(1.0)
        turn(store, "person", 4 * BS, end="stop", first=100)
        assert store.make_room(4)
        dropped = [sid for sid, t in tiers(store).items() if t in ("empty", "stored")]
        assert dropped == [victim], mode


def test_a_session_noted_before_its_first_turn_is_its_first_turns_tenants() -> None:
    """A conversation's WebSocket opens before its first turn: the note makes the session, and
    the turn (in its tenant's salt) still pins its KV for the next; another tenant's claim of
    the id shares nothing."""
    clock = Clock()
    store = make_store(clock, num_blocks=8)
    store.note("conv", present=True)
    turn(store, "conv", 2 * BS, salt="alice")
    session = store.get("conv")
    assert session is not None and session.state is SessionState.RESIDENT
    assert session.signals.present and session.signals.owner == "alice"
    tokens = [*range(2 * BS), 99]
    assert (
        store.claim("conv", "mallory", "r-mallory", tokens, KVState(salt="mallory")).from_session
        == 0
    )
    reuse = store.claim("conv", "alice", "r-alice", tokens, KVState(salt="alice"))
    assert reuse.from_session == 2 * BS


def test_the_service_reports_tool_calls_the_engine_could_not_see() -> None:
    clock = Clock()
    store = make_store(clock, num_blocks=8)
    turn(store, "a", 4 * BS)  # the engine saw a stop
    clock.advance(0.5)
    turn(store, "b", 4 * BS, first=100)
    store.note("a", end="tool_calls")  # the service parsed tool calls out of a's reply
    assert store.get("a").signals.klass == AGENT  # type: ignore[union-attr]
    store.make_room(4)
    assert tiers(store)["b"] in ("empty", "stored") and tiers(store)["a"] == "resident"
    assert store.get("a").signals.gaps.ends == 1  # one turn, reported twice  # type: ignore[union-attr]


def test_priority_and_ttl_come_with_the_budget() -> None:
    clock = Clock()
    store = make_store(clock, num_blocks=8)
    store.set_budget("vip", SessionBudget(retention_priority=90))
    turn(store, "vip", 4 * BS)
    turn(store, "other", 4 * BS, first=100)
    store.make_room(4)
    assert tiers(store)["vip"] == "resident"
    # A TTL holds a session: its value counts hold_weight times over.
    clock2 = Clock()
    store2 = make_store(clock2, num_blocks=8)
    store2.set_budget("kept", SessionBudget(retention_ttl_s=3600))
    turn(store2, "kept", 4 * BS)
    turn(store2, "other", 4 * BS, first=100)
    clock2.advance(600)
    assert store2.predict(store2.get("kept")).held  # type: ignore[arg-type]
    store2.make_room(4)
    assert tiers(store2)["kept"] == "resident"


def test_holds_are_soft_and_broken_holds_are_counted() -> None:
    """Two agents mid tool call (both held) and room for one: a running request is never
    refused for a hold; the lower value is moved and the broken hold counted."""
    clock = Clock()
    store = make_store(clock, num_blocks=8)
    turn(store, "a", 4 * BS, end="tool_calls")
    turn(store, "b", 4 * BS, end="tool_calls", first=100)
    assert store.make_room(8)  # all of the pool, for a running request
    assert store.stats.holds_broken == 2
    assert store.pool.num_free_blocks == 8


def test_pinning_more_than_the_pool_never_deadlocks() -> None:
    """Many held sessions, each alone as big as half the pool: every claim still gets room,
    and a turn whose session holds too much is capped by its budget."""
    clock = Clock()
    store = make_store(clock, num_blocks=8, host_blocks=0)
    for i in range(10):
        store.set_budget(f"s{i}", SessionBudget(retention_ttl_s=86_400, retention_priority=100))
        turn(store, f"s{i}", 4 * BS, end="tool_calls", first=i * 100)
        assert store.pool.num_used_blocks <= 8
    assert store.make_room(8)
    store.set_budget("capped", SessionBudget(max_kv_tokens=2 * BS))
    turn(store, "capped", 6 * BS, first=5000)
    assert store.get("capped").num_tokens == 2 * BS  # type: ignore[union-attr]


def test_typing_brings_a_session_up_from_host_at_once() -> None:
    clock = Clock()
    store = make_store(clock, num_blocks=12, host_blocks=8)
    turn(store, "reader", 4 * BS)
    assert store.evict("reader") == "offloaded"
    store.note("reader", typing=True)
    assert tiers(store)["reader"] == "resident"
    assert store.stats.prefetches == 1 and store.stats.prefetch_blocks_from_host == 4
    kv = KVState()
    reuse = store.claim("reader", None, "next", [*range(4 * BS), 7, 8], kv)
    assert reuse.from_session == 4 * BS and store.stats.prefetches_used == 1
    assert store.stats.session_hits_device == 1


def test_a_predicted_return_is_prefetched_and_an_unused_one_counted_wasted() -> None:
    """A session whose own gaps say it answers every 20 s is brought up from the host ahead
    of that, in free room, by maintain(); one without a history is not. Evicted again
    unused, the prefetch counts as wasted."""
    clock = Clock()
    store = make_store(clock, num_blocks=16, host_blocks=8)
    for _ in range(8):
        turn(store, "regular", 4 * BS)
        clock.advance(20.0)
    turn(store, "regular", 4 * BS)
    turn(store, "new", 4 * BS, first=500)
    store.evict("regular")
    store.evict("new")
    up_at = None
    for second in range(1, 31):
        clock.advance(1.0)
        store.maintain()
        if up_at is None and tiers(store)["regular"] == "resident":
            up_at = second
    assert up_at is not None and 8 <= up_at <= 20
    assert tiers(store)["new"] == "offloaded" and store.stats.prefetches == 1
    store.evict("regular")
    assert store.stats.prefetches_wasted == 1


def test_a_session_dropped_to_disk_keeps_its_tokens_for_a_prefetch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With a KV store, predictive drops keep the token ids (STORED): typing loads the full
    blocks back from disk."""
    from kvchat.memory.kv_store import KVStore

    clock = Clock()
    spec = KVCacheSpec(1, 1, 2, BS, torch.float32)
    kv = KVCache(spec, 8, torch.device("cpu"), 0)
    kv_shape, scales_shape = kv.block_byte_shapes()
    disk = KVStore(tmp_path / "kv", "fp", spec.bytes_per_block * 64, kv_shape, scales_shape)
    manager = KVCacheManager(
        BlockPool(8), kv, BS, enable_prefix_caching=True, host_pool=BlockPool(0), store=disk
    )
    cfg = CacheConfig(block_size=BS, retention=RetentionConfig(mode="predictive"))
    sessions = SessionStore(
        cfg, manager, CacheStats(), bytes_per_block=spec.bytes_per_block, clock=clock
    )
    turn(sessions, "reader", 4 * BS + 1)
    session = sessions.get("reader")
    assert session is not None
    manager.persist(session.kv, session.token_ids)
    disk.flush()
    assert sessions.evict("reader") == "dropped"
    assert tiers(sessions)["reader"] == "stored"
    # Its blocks stay findable in the prefix cache until reused: take them all first.
    hold = KVState()
    manager.allocate_slots(hold, 8 * BS)
    manager.free(hold)
    sessions.note("reader", typing=True)
    assert tiers(sessions)["reader"] == "resident"
    assert sessions.get("reader").num_tokens == 4 * BS  # type: ignore[union-attr]
    assert sessions.stats.prefetch_blocks_from_store == 4  # read back from disk
    assert manager.copy_times.store_blocks == 4 and manager.copy_times.store_s > 0  # timed
    disk.close()


def test_lru_keeps_nothing_past_a_turn() -> None:
    clock = Clock()
    store = make_store(clock, num_blocks=8, mode="lru")
    turn(store, "a", 4 * BS)
    assert tiers(store) == {"a": "empty"} and store.pool.num_used_blocks == 0
    # Its full blocks are still in the prefix cache, found by hash.
    kv = KVState()
    assert store.manager.match_prefix(kv, [*range(4 * BS), 9]) == 4 * BS


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(MemoryConfigError, match="retention must be one of"):
        RetentionConfig(mode="fifo")
    with pytest.raises(MemoryConfigError, match="retention_priority"):
        SessionBudget(retention_priority=101)


def test_the_policy_costs_little_with_a_thousand_idle_sessions() -> None:
    """Ordering 1,000 idle sessions by value: measured here only as work done (values
    computed once per make_room, not per victim)."""
    clock = Clock()
    store = make_store(clock, num_blocks=2100)
    for i in range(1000):
        turn(store, f"s{i}", 2 * BS, end="tool_calls" if i % 3 == 0 else "stop", first=i * 10)
        clock.advance(0.01)
    calls = 0
    real = store.retention.value

    def counting(*args: object, **kwargs: object) -> float:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    store.retention.value = counting  # type: ignore[method-assign]
    assert store.make_room(2100 - 100 + 20)
    assert calls == 1000  # one ordering, then evictions in it
    assert SessionState.RESIDENT in {s.state for s in store.sessions.values()}


def test_a_typing_prefetch_never_breaks_a_hold() -> None:
    """Room for a typing user's session is made from sessions that are not held: an agent
    mid tool call stays on the device, and the prefetch waits for free room."""
    clock = Clock()
    store = make_store(clock, num_blocks=8, host_blocks=8)
    turn(store, "reader", 4 * BS)
    assert store.evict("reader") == "offloaded"
    turn(store, "agent", 4 * BS, end="tool_calls", first=100)
    turn(store, "idle", 4 * BS, first=200)  # moves the reader's room: device full
    assert tiers(store)["agent"] == "resident"
    clock.advance(1.0)
    store.note("reader", typing=True)
    # The idle person's session made the room; the agent's held session did not.
    assert tiers(store) == {"reader": "resident", "agent": "resident", "idle": "offloaded"}
    assert store.stats.holds_broken == 0
    # Another typing user, and nothing left that is not held: it waits on the host.
    store.note("idle", typing=True)
    assert tiers(store)["idle"] == "offloaded" and tiers(store)["agent"] == "resident"
    assert store.stats.holds_broken == 0


def test_typing_ends_when_the_turn_begins() -> None:
    """A typing user's session is held until their message comes; once that turn has run,
    the session is judged by its gaps again, not held by the typing of a message it has."""
    clock = Clock()
    store = make_store(clock, num_blocks=16)
    turn(store, "p", 4 * BS)
    clock.advance(60.0)
    store.note("p", typing=True)
    session = store.get("p")
    assert session is not None and store.retention.held(session.signals, clock())
    clock.advance(2.0)
    turn(store, "p", 5 * BS)
    assert not store.retention.held(session.signals, clock())
    assert store.predict(session).next_turn_s != 0.0


def test_the_watermarks_spare_held_sessions() -> None:
    """Below the low watermark, idle sessions are moved out up to the high one, but not an
    agent mid tool call: its turn is seconds away. The pinned mode holds nothing."""
    for mode, kept in (("predictive", "resident"), ("pinned", "offloaded")):
        clock = Clock()
        store = make_store(clock, num_blocks=8, host_blocks=8, mode=mode)
        turn(store, "agent", 4 * BS, end="tool_calls")
        turn(store, "person", 4 * BS, first=100)
        assert store.pool.num_free_blocks == 0
        store.maintain()
        assert tiers(store)["agent"] == kept, mode
        assert store.stats.holds_broken == 0


def test_a_session_not_held_never_pushes_a_held_one_off_the_host() -> None:
    """An agent mid tool call waits on the host; a person's session moved out of the device
    after it goes on down (dropped), rather than pushing the agent to nowhere."""
    clock = Clock()
    store = make_store(clock, num_blocks=16, host_blocks=4)
    turn(store, "agent", 4 * BS, end="tool_calls")
    assert store.evict("agent") == "offloaded"  # (an operator's move: a hold broken)
    broken = store.stats.holds_broken
    turn(store, "person", 4 * BS, first=100)
    assert store.evict("person") == "dropped"
    assert tiers(store) == {"agent": "offloaded", "person": "empty"}
    assert store.stats.holds_broken == broken
    # A held session still takes the room of one that is not.
    turn(store, "agent2", 4 * BS, end="tool_calls", first=200)
    clock.advance(60.0)  # the first agent's hold is over
    assert store.evict("agent2") == "offloaded"
    assert tiers(store)["agent"] == "empty"


def test_an_operators_move_is_not_undone_by_a_prefetch() -> None:
    """A session whose gaps say it is back in seconds is prefetched when it leaves the device
    under pressure, but not when an operator moved it out: that stays until its next turn (or
    its user types)."""
    for operator, after in ((False, "resident"), (True, "offloaded")):
        clock = Clock()
        store = make_store(clock, num_blocks=16, host_blocks=16)
        for i in range(6):  # a session that answers every 2 s
            turn(store, "quick", (4 + i) * BS)
            clock.advance(2.0)
        turn(store, "quick", 10 * BS)
        assert store.evict("quick", operator=operator) == "offloaded"
        clock.advance(1.0)
        store.maintain()
        assert tiers(store)["quick"] == after, operator
    store.note("quick", typing=True)
    assert tiers(store)["quick"] == "resident"


def waiting(rid: str, tokens: list[int], session_id: str | None = None) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4), 1_000, session_id=session_id)


@pytest.mark.parametrize("agent_returns", [True, False])
def test_a_new_request_waits_on_a_tool_calls_hold_for_what_breaking_it_would_cost(
    agent_returns: bool,
) -> None:
    """An agent mid tool call holds half the pool; a new request needs more than the free half.
    Under predictive it waits (its wait bounded by the agent's expected recompute: 32 tokens x
    0.1 s, times how likely the agent is back), the agent's next turn passes it and finds its KV
    on the device; if the agent does not come, the request goes ahead once it has waited that
    long and breaks the hold. pinned and lru break it (or never hold) at once."""
    retention = {"prefill_s_per_token": 0.1}
    for mode in ("predictive", "pinned", "lru"):
        clock = Clock()
        store = make_store(clock, num_blocks=16, mode=mode, retention=retention)
        agent = list(range(8 * BS))
        turn(store, "a", len(agent), end="tool_calls")
        scheduler = Scheduler(SchedulerConfig(), store.manager, store, store.stats)
        scheduler.add(waiting("r", list(range(500, 500 + 12 * BS))))
        batch = scheduler.schedule()
        if mode != "predictive":
            assert [s.request_id for s in scheduler.running] == ["r"], mode
            continue
        assert not scheduler.running and tiers(store)["a"] == "resident"
        assert store.stats.holds_broken == 0 and batch.is_empty
        cost = store.hold_cost_s(12)
        assert cost is not None and 0.5 * 32 * 0.1 < cost <= 32 * 0.1
        clock.advance(cost / 2)
        scheduler.schedule()
        assert not scheduler.running
        if agent_returns:
            scheduler.add(waiting("a2", [*agent, 900, 901, 902], session_id="a"))
            scheduler.schedule()
            assert [s.request_id for s in scheduler.running] == ["a2"]
            assert store.stats.session_hits_device == 1 and store.stats.holds_broken == 0
            assert [s.request_id for s in scheduler.waiting] == ["r"]
        else:
            clock.advance(cost / 2 + 0.01)
            scheduler.schedule()
            assert [s.request_id for s in scheduler.running] == ["r"]
            assert store.stats.holds_broken == 1 and store.stats.admissions_held_back == 1
            assert tiers(store)["a"] == "empty"


def test_a_request_never_waits_on_holds_that_could_not_make_its_room() -> None:
    """Held sessions that could not free enough even all together are no reason to wait: the
    request goes the usual way (here: too big for the pool, refused at once)."""
    clock = Clock()
    store = make_store(clock, num_blocks=16, retention={"prefill_s_per_token": 0.1})
    turn(store, "a", 4 * BS, end="tool_calls")
    assert store.hold_cost_s(17) is None
    assert not store.should_wait(17, 0.0)
    assert store.should_wait(14, 0.0)  # 12 free + the agent's 4
    assert not store.should_wait(12, 0.0)  # free already


def test_reload_costs_are_measured_not_assumed() -> None:
    """Copies from host are counted and timed where they happen; their rate replaces the
    configured one once there are enough bytes, and prefill steps move the per-token cost."""
    clock = Clock()
    store = make_store(clock, num_blocks=12, host_blocks=8)
    turn(store, "reader", 4 * BS)
    assert store.evict("reader") == "offloaded"
    turn(store, "other", 12 * BS, first=1000)  # reuses the blocks the prefix cache still had
    store.note("reader", typing=True)  # brought back up from host: four blocks copied
    copied = store.manager.copy_times
    assert copied.host_blocks == 4 and copied.host_s > 0 and copied.store_blocks == 0
    policy = RetentionPolicy(RetentionConfig(), clock)
    configured_host, configured_disk = policy.host_bytes_per_s, policy.disk_bytes_per_s
    policy.observe_copies(1024, 1.0, 0, 0.0)  # too few bytes to go by
    assert policy.host_bytes_per_s == configured_host
    policy.observe_copies(8 * 1024**2, 0.5, 64 * 1024**2, 2.0)
    assert policy.host_bytes_per_s == 16 * 1024**2 and policy.disk_bytes_per_s == 32 * 1024**2
    assert policy.disk_bytes_per_s != configured_disk
    before = policy.prefill_s_per_token
    for _ in range(200):
        policy.observe_prefill(0.5, 100)  # 5 ms a token
    assert policy.prefill_s_per_token == pytest.approx(5e-3, rel=1e-3) and before < 5e-3
    assert policy.reload_s("none", 300, 0) == pytest.approx(1.5, rel=1e-3)
