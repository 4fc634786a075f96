"""The KV store: blocks on disk that a new engine (a restart, another replica) loads instead
of recomputing. Restored KV gives the tokens an uninterrupted run gives; files that cannot be
used are skipped, never used; the byte cap evicts the least recently used."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvchat.inference.engine.engine import Engine
from kvchat.memory import kv_store
from kvchat.memory.kv_store import BlockData, KVStore, weights_fingerprint
from kvchat.memory.prefix_cache import hash_block
from kvchat_testing.engines import random_prompt
from kvchat_testing.session_engines import (
    BLOCK,
    GREEDY,
    NEW,
    ForwardCounter,
    cold,
    make_engine,
    turn,
)

KV_SHAPE = (2, 2, 4, 2, 8)


def block(seed: int, tokens: tuple[int, ...] = (1, 2, 3, 4)) -> BlockData:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randint(0, 256, KV_SHAPE, dtype=torch.uint8, generator=g)
    return BlockData(hash_block(None, tokens, f"tenant-{seed}"), tokens, kv, None)


def store_at(root: Path, max_bytes: int = 1 << 20) -> KVStore:
    return KVStore(root, "fp", max_bytes, KV_SHAPE, None)


def test_a_block_written_behind_loads_back_exactly(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    b = block(1)
    store.put([b])
    assert store.knows(b.block_hash)  # queued: not queued twice
    assert store.flush(10)
    loaded = store.load(b.block_hash, b.token_ids)
    assert loaded is not None and torch.equal(loaded.kv, b.kv)
    assert store.load(b.block_hash, (1, 2, 3, 5)) is None  # same hash, other tokens: unused
    stats = store.snapshot()
    assert (stats.writes, stats.hits, stats.num_blocks) == (1, 1, 0)  # the mismatch removed it
    store.close()
    # Another process (a new store on the same directory) finds what this one wrote.
    other = store_at(tmp_path)
    b2 = block(2)
    store2 = store_at(tmp_path)
    store2.put([b2])
    store2.close()
    found = other.load(b2.block_hash, b2.token_ids)
    assert found is not None and torch.equal(found.kv, b2.kv)
    other.close()


def test_a_truncated_or_foreign_file_is_skipped_and_removed(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    good, cut, foreign = block(1), block(2), block(3)
    store.put([good, cut, foreign])
    assert store.flush(10)
    path = store.dir / (cut.block_hash.hex() + ".safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a write the kernel never finished
    # A file of another shape (another model's blocks under a wrong name).
    alien = KVStore(tmp_path / "alien", "fp", 1 << 20, (2, 2, 4, 2, 4), None)
    alien.put(
        [
            BlockData(
                foreign.block_hash,
                foreign.token_ids,
                torch.zeros((2, 2, 4, 2, 4), dtype=torch.uint8),
                None,
            )
        ]
    )
    alien.close()
    name = foreign.block_hash.hex() + ".safetensors"
    (store.dir / name).write_bytes((alien.dir / name).read_bytes())
    assert store.load(cut.block_hash, cut.token_ids) is None
    assert not path.exists()
    assert store.load(foreign.block_hash, foreign.token_ids) is None
    loaded = store.load(good.block_hash, good.token_ids)
    assert loaded is not None and torch.equal(loaded.kv, good.kv)
    assert store.snapshot().skipped == 2
    store.close()


def test_the_byte_cap_evicts_the_least_recently_used(tmp_path: Path) -> None:
    probe = store_at(tmp_path / "probe")
    probe.put([block(0)])
    probe.close()
    size = probe.snapshot().num_bytes
    store = store_at(tmp_path, max_bytes=int(size * 3.5))  # three fit, four do not
    blocks = [block(i) for i in range(1, 5)]
    for i, b in enumerate(blocks[:3]):
        store.put([b])
        assert store.flush(10)
        past = time.time() - 100 + i  # mtimes in a known order, whatever the clock's grain
        os.utime(store.dir / (b.block_hash.hex() + ".safetensors"), (past, past))
    assert store.load(blocks[0].block_hash, blocks[0].token_ids) is not None  # now the newest
    store.put([blocks[3]])
    assert store.flush(10)
    assert store.snapshot().evictions >= 1
    kept = {p.name for p in store.dir.iterdir()}
    assert blocks[1].block_hash.hex() + ".safetensors" not in kept  # the least recently used
    assert blocks[0].block_hash.hex() + ".safetensors" in kept
    assert blocks[3].block_hash.hex() + ".safetensors" in kept
    assert store.snapshot().num_bytes <= store.max_bytes
    store.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def wait_for_writes(store: KVStore, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while store.snapshot().writes < n:
        assert time.monotonic() < deadline, f"{store.snapshot().writes} writes, waited for {n}"
        time.sleep(0.01)


def test_writes_wait_while_the_engine_prefills(tmp_path: Path) -> None:
    """The writer takes the CPU a prefill needs on a small machine: while the engine's steps
    prefill it holds back, until a step without one, HOLD_SECONDS of unbroken prefill, or a
    flush."""
    clock = Clock()
    store = KVStore(tmp_path, "fp", 1 << 20, KV_SHAPE, None, clock=clock)
    store.set_prefilling(True)
    assert store.prefilling
    store.put([block(1)])
    time.sleep(0.3)  # the writer is free to run: it holds the block
    assert store.snapshot().writes == 0 and store.snapshot().pending_bytes > 0
    store.set_prefilling(False)  # a decode step: the block is written
    wait_for_writes(store, 1)

    store.set_prefilling(True)  # a long stretch of prefill...
    store.put([block(2)])
    time.sleep(0.1)
    assert store.snapshot().writes == 1
    clock.now += kv_store.HOLD_SECONDS  # ...past the hold: written beside it
    wait_for_writes(store, 2)

    store.set_prefilling(False)
    store.set_prefilling(True)  # a new stretch: held again, but a flush is not kept waiting
    store.put([block(3)])
    assert store.flush(30)
    assert store.snapshot().writes == 3
    store.close()


def test_the_fingerprint_follows_the_weights(tiny_llama: tuple[Path, Any], tmp_path: Path) -> None:
    path, _ = tiny_llama
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in path.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    assert weights_fingerprint(copy) == weights_fingerprint(path)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of one weight, where a sample reads
    weights.write_bytes(bytes(data))
    assert weights_fingerprint(copy) != weights_fingerprint(path)


def stored_engine(path: Path, store: Path, **cache: Any) -> Engine:
    return make_engine(path, kv_store_dir=str(store), kv_store_bytes=1 << 30, **cache)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_a_restarted_engine_loads_the_conversation_and_computes_only_the_new_tokens(
    tiny_llama: tuple[Path, Any], tmp_path: Path, kv_cache_dtype: str
) -> None:
    path, _ = tiny_llama
    first = stored_engine(path, tmp_path, kv_cache_dtype=kv_cache_dtype)
    p1 = random_prompt(4 * BLOCK + 3, seed=31)
    o1 = turn(first, "t1", p1, session="conv", salt="alice").output_token_ids or []
    assert first.stats.blocks_to_store == (len(p1) + len(o1)) // BLOCK
    first.close_kv_store()  # the process exits (its writer finished)

    second = stored_engine(path, tmp_path, kv_cache_dtype=kv_cache_dtype)
    counter = ForwardCounter(second)
    p2 = p1 + o1 + random_prompt(9, seed=32)
    out = turn(second, "t2", p2, session="conv", salt="alice")
    stored = (len(p1) + len(o1)) // BLOCK * BLOCK
    assert out.num_cached_tokens == stored
    assert second.stats.from_store == stored
    assert second.stats.computed == len(p2) - stored
    assert counter.tokens == len(p2) - stored + NEW  # no recompute (NEW: decode + last)
    # Token for token what an engine that never stopped computes.
    assert out.output_token_ids == cold(path, p2, kv_cache_dtype)
    # Another tenant's identical tokens find nothing (the salt is in the hash chain).
    other = turn(second, "t3", p2, session="bob", salt="bob")
    assert other.num_cached_tokens == 0
    second.close_kv_store()


def test_the_engine_holds_the_writer_back_while_it_prefills(
    tiny_llama: tuple[Path, Any], tmp_path: Path
) -> None:
    path, _ = tiny_llama
    engine = stored_engine(path, tmp_path)
    assert engine.kv_store is not None
    engine.add_request("r", random_prompt(3 * BLOCK, seed=51), GREEDY)
    engine.step()  # the prompt
    assert engine.kv_store.prefilling
    engine.step()  # a decode step
    assert not engine.kv_store.prefilling
    while engine.has_unfinished_requests():
        engine.step()
    engine.close_kv_store()


def test_a_store_of_another_kv_dtype_is_not_used(
    tiny_llama: tuple[Path, Any], tmp_path: Path
) -> None:
    path, _ = tiny_llama
    first = stored_engine(path, tmp_path)
    p1 = random_prompt(3 * BLOCK, seed=41)
    turn(first, "t1", p1, session="conv")
    first.close_kv_store()
    quantized = stored_engine(path, tmp_path, kv_cache_dtype="int8")
    assert quantized.kv_store is not None and first.kv_store is not None
    assert quantized.kv_store.dir != first.kv_store.dir
    out = turn(quantized, "t2", p1 + [5, 6, 7], session="conv")
    assert out.num_cached_tokens == 0
    quantized.close_kv_store()


def test_a_store_of_turned_keys_is_not_used_by_a_cache_storing_them_plain(
    tiny_llama: tuple[Path, Any], tmp_path: Path
) -> None:
    # int8 blocks written with keys turned (kernels.quant.key_rotation) would read as garbage
    # in a cache that stores keys as they are: the two are different stores.
    path, _ = tiny_llama
    turned = stored_engine(path, tmp_path, kv_cache_dtype="int8")
    p1 = random_prompt(3 * BLOCK, seed=42)
    turn(turned, "t1", p1, session="conv")
    turned.close_kv_store()
    plain = stored_engine(path, tmp_path, kv_cache_dtype="int8", rotate_keys=False)
    assert plain.kv_store is not None and turned.kv_store is not None
    assert plain.kv_store.dir != turned.kv_store.dir
    assert turn(plain, "t2", p1 + [5, 6, 7], session="conv").num_cached_tokens == 0
    plain.close_kv_store()
    # An unquantized cache has no keys to turn: its store is the same either way.
    auto = stored_engine(path, tmp_path)
    also = stored_engine(path, tmp_path, rotate_keys=False)
    assert auto.kv_store is not None and also.kv_store is not None
    assert auto.kv_store.dir == also.kv_store.dir
    auto.close_kv_store()
    also.close_kv_store()
