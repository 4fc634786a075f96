"""SessionStore policies without a model: LRU eviction order, watermarks, pinned-session cap,
host pool pressure, close."""

from __future__ import annotations

import torch

from kvchat.memory.block_pool import BlockPool
from kvchat.memory.config import CacheConfig
from kvchat.memory.kv_cache import KVCache
from kvchat.memory.kv_cache_manager import KVCacheManager, KVState
from kvchat.memory.kv_spec import KVCacheSpec
from kvchat.memory.sessions import SessionState, SessionStore
from kvchat.memory.stats import CacheStats

BS = 4


def make_store(num_blocks: int = 16, host_blocks: int = 0, **config: object) -> SessionStore:
    cfg = CacheConfig(block_size=BS, **config)  # type: ignore[arg-type]
    spec = KVCacheSpec(1, 1, 2, BS, torch.float32)
    kv = KVCache(spec, num_blocks, torch.device("cpu"), host_blocks)
    pool, host = BlockPool(num_blocks), BlockPool(host_blocks)
    manager = KVCacheManager(pool, kv, BS, enable_prefix_caching=False, host_pool=host)
    return SessionStore(cfg, manager, CacheStats())


def pin(store: SessionStore, session_id: str, num_tokens: int, first: int = 0) -> None:
    """One turn of `num_tokens` tokens that all get computed, then pinned."""
    tokens = list(range(first, first + num_tokens))
    kv = KVState()
    store.claim(session_id, None, f"{session_id}-req", tokens, kv)
    store.manager.allocate_slots(kv, num_tokens)
    store.manager.commit(kv, tokens, num_tokens)
    store.release(session_id, f"{session_id}-req", tokens, kv)


def states(store: SessionStore) -> dict[str, str]:
    return {sid: s.state.value for sid, s in store.sessions.items()}


def test_make_room_evicts_coldest_first() -> None:
    store = make_store(num_blocks=12)
    for name in ("a", "b", "c"):
        pin(store, name, 4 * BS)  # 4 blocks each: the pool is full
    assert store.pool.num_free_blocks == 0
    pin(store, "a", 4 * BS)  # touch a: b is now the coldest
    store.make_room(3)
    assert states(store) == {"a": "resident", "b": "empty", "c": "resident"}
    assert store.stats.session_drops == 1


def test_watermarks_evict_down_to_the_high_mark() -> None:
    store = make_store(num_blocks=20, watermark_low=0.25, watermark_high=0.5)
    for i in range(5):
        pin(store, f"s{i}", 4 * BS)  # 20 blocks pinned, 0 free: below the low watermark
    store.maintain()
    assert store.pool.num_free_blocks >= 10  # high watermark: half the pool
    assert [s.state for s in store.sessions.values()][:3] == [SessionState.EMPTY] * 3
    assert store.num_resident == 2
    store.maintain()  # above the low mark now: nothing more happens
    assert store.num_resident == 2


def test_max_pinned_sessions_offloads_the_coldest() -> None:
    store = make_store(num_blocks=32, host_blocks=16, max_pinned_sessions=2)
    pin(store, "a", 2 * BS)
    pin(store, "b", 2 * BS)
    pin(store, "c", 2 * BS)
    assert states(store) == {"a": "offloaded", "b": "resident", "c": "resident"}
    assert store.num_resident == 2
    assert store.host_pool.num_used_blocks == 2


def test_host_pool_pressure_drops_the_coldest_offloaded() -> None:
    store = make_store(num_blocks=32, host_blocks=4)
    pin(store, "a", 2 * BS)
    pin(store, "b", 2 * BS)
    pin(store, "c", 2 * BS)
    assert store.evict("a") == "offloaded"
    assert store.evict("b") == "offloaded"  # host is full now
    assert store.evict("c") == "offloaded"  # a, the coldest offloaded, is dropped for it
    assert states(store) == {"a": "empty", "b": "offloaded", "c": "offloaded"}
    assert store.stats.session_drops == 1 and store.stats.session_offloads == 3


def test_evict_to_drop_and_close_release_everything() -> None:
    store = make_store(num_blocks=16, host_blocks=8)
    pin(store, "a", 3 * BS)
    pin(store, "b", 3 * BS)
    assert store.evict("a") == "offloaded"
    assert store.evict("a", offload=False) == "dropped"
    store.close("b")
    assert store.get("b") is None
    assert store.pool.num_free_blocks == 16 and store.host_pool.num_free_blocks == 8


def test_running_turn_is_never_evicted() -> None:
    store = make_store(num_blocks=8)
    pin(store, "a", 4 * BS)
    kv = KVState()
    tokens = list(range(4 * BS)) + [99]
    store.claim("a", None, "a-2", tokens, kv)  # a is now ACTIVE: its blocks belong to the turn
    assert not store.make_room(8)
    assert store.get("a").state is SessionState.ACTIVE  # type: ignore[union-attr]
    assert len(kv.block_ids) == 4


def test_other_tenant_cannot_claim_a_session() -> None:
    store = make_store()
    pin(store, "a", 3 * BS)
    kv = KVState(salt="intruder")
    reuse = store.claim("a", "intruder", "x", list(range(3 * BS)) + [1], kv)
    assert reuse.from_session == 0 and not kv.block_ids
    assert store.get("a").state is SessionState.RESIDENT  # type: ignore[union-attr]
