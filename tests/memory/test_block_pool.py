"""BlockPool and PrefixCache: ref counts, LRU of free cached blocks, hash-chain hits."""

from __future__ import annotations

import pytest

from kvchat.memory.block_pool import BlockPool, OutOfBlocksError
from kvchat.memory.kv_cache_manager import KVCacheManager, KVState
from kvchat.memory.prefix_cache import PrefixCache, hash_block

BS = 4


def test_allocate_and_release_round_trip() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free_blocks == 1
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    pool.release(ids)
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_free_cached_blocks_are_found_until_reused_lru_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    ha, hb = hash_block(None, [1, 2, 3, 4], None), hash_block(None, [5, 6, 7, 8], None)
    pool.register(a, ha, [1, 2, 3, 4])
    pool.register(b, hb, [5, 6, 7, 8])
    pool.release([a])  # freed first: evicted first
    pool.release([b])
    pool.release([c])  # unhashed: handed out before cached ones
    assert pool.lookup(ha, [1, 2, 3, 4]) == a
    assert pool.allocate(1) == [c]
    assert pool.lookup(ha, [1, 2, 3, 4]) == a  # still cached
    assert pool.allocate(1) == [a]
    assert pool.lookup(ha, [1, 2, 3, 4]) is None  # its hash is forgotten once reused
    assert pool.lookup(hb, [5, 6, 7, 8]) == b
    pool.check_invariants()


def test_hit_is_confirmed_by_token_ids() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    h = hash_block(None, [1, 2, 3, 4], None)
    pool.register(a, h, [1, 2, 3, 4])
    assert pool.lookup(h, [1, 2, 3, 5]) is None  # a (pretend) collision is not a hit


def test_hash_chain_depends_on_parent_and_salt() -> None:
    h1 = hash_block(None, [1, 2], None)
    assert hash_block(h1, [3, 4], None) != hash_block(hash_block(None, [9, 9], None), [3, 4], None)
    assert hash_block(None, [1, 2], "tenant-a") != hash_block(None, [1, 2], "tenant-b")
    assert hash_block(None, [1, 2], "tenant-a") == hash_block(None, [1, 2], "tenant-a")


def test_prefix_match_stops_at_first_miss_and_leaves_a_token_to_compute() -> None:
    pool = BlockPool(8)
    manager = KVCacheManager(pool, None, BS, enable_prefix_caching=True)
    tokens = list(range(12))
    first = KVState()
    manager.allocate_slots(first, 12)
    manager.commit(first, tokens, 12)
    assert len(first.block_hashes) == 3
    second = KVState()
    assert manager.match_prefix(second, tokens) == 8  # 12 tokens: the last block is recomputed
    assert second.block_ids == first.block_ids[:2]
    third = KVState()
    assert manager.match_prefix(third, tokens[:4] + [99] + tokens[5:] + [0]) == 4
    for b in first.block_ids[:1]:
        assert pool.blocks[b].ref_count == 3
    manager.free(first)
    manager.free(second)
    manager.free(third)
    assert pool.num_free_blocks == 8
    pool.check_invariants()


def test_copy_on_write_for_shared_or_registered_blocks() -> None:
    pool = BlockPool(6)
    manager = KVCacheManager(pool, None, BS, enable_prefix_caching=True)
    tokens = list(range(8))
    a = KVState()
    manager.allocate_slots(a, 8)
    manager.commit(a, tokens, 8)
    b = KVState(block_ids=list(a.block_ids), block_hashes=list(a.block_hashes))
    for block in b.block_ids:
        pool.incref(block)
    b.num_computed_tokens = 6
    manager.truncate(b, 6)
    assert not pool.is_writable(b.block_ids[1])
    assert manager.make_writable(b, 6)
    assert b.block_ids[0] == a.block_ids[0] and b.block_ids[1] != a.block_ids[1]
    assert pool.is_writable(b.block_ids[1])
    assert len(b.block_hashes) == 1


def test_disabled_prefix_cache_never_hits() -> None:
    pool = BlockPool(4)
    cache = PrefixCache(pool, BS, enabled=False)
    manager = KVCacheManager(pool, None, BS, enable_prefix_caching=False)
    a = KVState()
    manager.allocate_slots(a, 8)
    manager.commit(a, list(range(8)), 8)
    assert pool.num_cached_blocks == 0
    assert cache.match(list(range(9)), None, 0, None, 8) == ([], [])
