"""The KV store can only ever cost a recompute: every fault of a real file system (a directory
or a symlink or a FIFO in place of a block file, a read-only volume, a full disk, a truncated
file, flipped bits, a file of another shape) is caught inside the store, counted by (op,
reason), and answered with a miss; the writer survives them all, its queue stays bounded, and a
store that keeps failing turns itself off and then tries again. Then the engine: twenty turns
over each broken store give the tokens a recompute gives.

The volumes are real: a tmpfs of a few KiB for the full disk, a read-only bind mount for the
read-only volume (the tests run as root, as CI does)."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kvchat.memory import kv_store as kv_store_module
from kvchat.memory.kv_store import (
    FAILURES_TO_DISABLE,
    RETRY_SECONDS,
    BlockData,
    KVStore,
    fault_reason,
)
from kvchat.memory.prefix_cache import hash_block
from kvchat_testing.engines import random_prompt
from kvchat_testing.session_engines import BLOCK, make_engine, turn
from kvchat_testing.volumes import read_only, tmpfs

KV_SHAPE = (2, 2, 4, 2, 8)  # 256 bytes of KV per block
TOKENS = (1, 2, 3, 4)


def block(seed: int, tokens: tuple[int, ...] = TOKENS) -> BlockData:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randint(0, 256, KV_SHAPE, dtype=torch.uint8, generator=g)
    return BlockData(hash_block(None, tokens, f"tenant-{seed}"), tokens, kv, None)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store_at(root: Path, clock: Clock | None = None, **kw: Any) -> KVStore:
    return KVStore(root, "fp", 1 << 20, KV_SHAPE, None, clock=clock or Clock(), **kw)


def file_of(store: KVStore, b: BlockData) -> Path:
    return store.dir / (b.block_hash.hex() + ".safetensors")


def written(root: Path, *blocks: BlockData) -> KVStore:
    store = store_at(root)
    store.put(list(blocks))
    assert store.flush(10)
    return store


@pytest.fixture(autouse=True)
def _root() -> None:
    assert os.geteuid() == 0, "these tests mount real volumes: run them as root (CI does)"


# --- one file at a time ---------------------------------------------------------------------


def test_a_directory_in_place_of_a_block_is_a_miss_counted_once_read(tmp_path: Path) -> None:
    good, bad = block(1), block(2)
    store = written(tmp_path, good, bad)
    path = file_of(store, bad)
    path.unlink()
    path.mkdir()
    (path / "x").write_text("not a block")  # not removable by unlink either
    assert store.load(bad.block_hash, bad.token_ids) is None
    stats = store.snapshot()
    assert stats.errors == {("read", "EISDIR"): 1, ("remove", "EISDIR"): 1}
    assert store.load(bad.block_hash, bad.token_ids) is None  # remembered: not read again
    assert store.snapshot().errors == stats.errors
    assert store.knows(bad.block_hash)  # never queued for a write that cannot land
    loaded = store.load(good.block_hash, good.token_ids)
    assert loaded is not None and torch.equal(loaded.kv, good.kv)
    assert store.is_enabled  # one bad file never turns the store off
    store.close()


def test_a_symlink_and_a_fifo_are_not_followed(tmp_path: Path) -> None:
    target, linked, fifo = block(1), block(2), block(3)
    store = written(tmp_path, target)
    os.symlink(file_of(store, target), file_of(store, linked))  # a valid file, another name
    os.mkfifo(file_of(store, fifo))  # would block a plain open() forever
    assert store.load(linked.block_hash, target.token_ids) is None
    assert store.load(fifo.block_hash, fifo.token_ids) is None
    errors = store.snapshot().errors
    assert errors[("read", "ELOOP")] == 1 and errors[("read", "not_regular")] == 1
    assert not os.path.lexists(file_of(store, linked))  # the link removed, not its target
    assert file_of(store, target).exists() and not file_of(store, fifo).exists()
    store.close()


def test_truncated_flipped_and_misshapen_files_fail_verification(tmp_path: Path) -> None:
    cut, flipped, sign, other = block(1), block(2), block(3), block(4)
    store = written(tmp_path, cut, flipped, sign, other)
    data = file_of(store, cut).read_bytes()
    file_of(store, cut).write_bytes(data[: len(data) // 2])
    data = bytearray(file_of(store, flipped).read_bytes())
    data[-1] ^= 0x01  # one low bit of the last token id
    file_of(store, flipped).write_bytes(bytes(data))
    data = bytearray(file_of(store, sign).read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    for i in range(header, header + 256):  # every byte of the KV: its top bit
        data[i] ^= 0x80
    file_of(store, sign).write_bytes(bytes(data))
    # A block of another shape, with a valid checksum, under the same fingerprint.
    wide = KVStore(tmp_path / "wide", "fp", 1 << 20, (2, 2, 4, 2, 16), None)
    g = torch.Generator().manual_seed(9)
    kv = torch.randint(0, 256, (2, 2, 4, 2, 16), dtype=torch.uint8, generator=g)
    wide.put([BlockData(other.block_hash, TOKENS, kv, None)])
    wide.close()
    os.replace(file_of(wide, other), file_of(store, other))
    for b in (cut, flipped, sign, other):
        assert store.load(b.block_hash, b.token_ids) is None
        assert not file_of(store, b).exists()  # removed: the next write replaces it
    assert store.snapshot().errors == {
        ("verify", "format"): 1,
        ("verify", "checksum"): 2,
        ("verify", "shape"): 1,
    }
    assert store.snapshot().skipped == 4
    store.put([flipped])  # rewritten, then loads exactly
    assert store.flush(10)
    loaded = store.load(flipped.block_hash, flipped.token_ids)
    assert loaded is not None and torch.equal(loaded.kv, flipped.kv)
    store.close()


def test_a_file_under_another_blocks_name_is_not_used(tmp_path: Path) -> None:
    """Same tokens, another hash (another prefix or tenant): its KV is another block's."""
    a = block(1)
    b = BlockData(hash_block(None, TOKENS, "tenant-other"), TOKENS, a.kv, None)
    store = written(tmp_path, a)
    os.link(file_of(store, a), file_of(store, b))
    assert store.load(b.block_hash, TOKENS) is None
    assert store.snapshot().errors == {("verify", "block_hash"): 1}
    store.close()


def test_a_store_that_cannot_be_opened_serves_without_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file where the store's directory would be")
    store = KVStore(tmp_path / "file", "fp", 1 << 20, KV_SHAPE, None)
    b = block(1)
    assert store.load(b.block_hash, b.token_ids) is None
    store.put([b])
    assert store.flush(5)
    stats = store.snapshot()
    assert not stats.enabled and "ENOTDIR" in (stats.disabled_reason or "")
    assert stats.errors == {("open", "ENOTDIR"): 1} and stats.dropped == 1
    store.close()


# --- the volume ---------------------------------------------------------------------------


def test_a_read_only_volume_turns_the_store_off_then_on_again(tmp_path: Path) -> None:
    clock = Clock()
    good, bad = block(1), block(2)
    written(tmp_path, good, bad).close()
    data = bytearray((tmp_path / "fp" / (bad.block_hash.hex() + ".safetensors")).read_bytes())
    data[-9] ^= 0x10
    (tmp_path / "fp" / (bad.block_hash.hex() + ".safetensors")).write_bytes(bytes(data))
    with read_only(tmp_path):
        store = store_at(tmp_path, clock)
        assert store.load(good.block_hash, good.token_ids) is not None  # reads still work
        assert store.load(bad.block_hash, bad.token_ids) is None
        assert store.snapshot().errors[("remove", "EROFS")] == 1
        fresh = [block(10 + i, (i, i, i, i)) for i in range(FAILURES_TO_DISABLE + 4)]
        for b in fresh:
            store.put([b])
            assert store.flush(10)
        stats = store.snapshot()
        # The failed removal and the failed writes, in a row, turn it off: the rest is dropped.
        assert stats.errors[("write", "EROFS")] == FAILURES_TO_DISABLE - 1
        assert not stats.enabled and "EROFS" in (stats.disabled_reason or "")
        assert stats.dropped == len(fresh) - (FAILURES_TO_DISABLE - 1) and stats.writes == 0
        assert store.load(good.block_hash, good.token_ids) is None  # off: a miss
        assert store._writer.is_alive()
    clock.now += RETRY_SECONDS  # the volume is writable again
    assert store.is_enabled
    store.put([fresh[0]])
    assert store.flush(10)
    assert store.snapshot().writes == 1
    assert store.load(fresh[0].block_hash, fresh[0].token_ids) is not None
    store.close()


def test_a_full_disk_costs_writes_not_the_writer(tmp_path: Path) -> None:
    clock = Clock()
    with tmpfs(tmp_path / "vol", "64k") as vol:
        store = store_at(vol, clock)
        filler = vol / "filler"
        with filler.open("wb") as f, contextlib.suppress(OSError):
            f.write(b"\0" * (64 << 10))
        for i in range(FAILURES_TO_DISABLE):
            store.put([block(i, (i, 0, 0, i))])
            assert store.flush(10)
        stats = store.snapshot()
        assert stats.errors[("write", "ENOSPC")] == FAILURES_TO_DISABLE
        assert not stats.enabled and stats.pending_bytes == 0
        assert store._writer.is_alive()
        filler.unlink()  # space freed
        clock.now += RETRY_SECONDS
        b = block(99, (9, 9, 9, 9))
        store.put([b])
        assert store.flush(10)
        assert store.snapshot().writes == 1 and store.is_enabled
        loaded = store.load(b.block_hash, b.token_ids)
        assert loaded is not None and torch.equal(loaded.kv, b.kv)
        store.close()
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "vol").iterdir())


def test_the_queue_drops_its_oldest_copies_past_its_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung disk (an injected fault: the write waits) never grows the queue past its cap."""
    release = threading.Event()
    real_write = KVStore._write

    def hung(self: KVStore, b: BlockData) -> int | None:
        release.wait(30)
        return real_write(self, b)

    monkeypatch.setattr(KVStore, "_write", hung)
    per_block = 256 + 8 * len(TOKENS)
    store = store_at(tmp_path, max_pending_bytes=4 * per_block)
    blocks = [block(i, (i, 1, 2, 3)) for i in range(20)]
    for b in blocks:
        store.put([b])
        assert store.snapshot().pending_bytes <= 4 * per_block
    release.set()
    assert store.flush(10)
    stats = store.snapshot()
    assert stats.dropped >= 15 and stats.writes + stats.dropped == 20
    assert store.load(blocks[-1].block_hash, blocks[-1].token_ids) is not None  # newest kept
    assert store.load(blocks[1].block_hash, blocks[1].token_ids) is None  # oldest dropped
    store.close()


def test_fault_reasons_name_the_errno_whatever_raised_it() -> None:
    assert fault_reason(OSError(28, "No space left on device")) == "ENOSPC"
    wrapped = RuntimeError('IoError(Os { code: 30, kind: ReadOnlyFilesystem, message: "x" })')
    assert fault_reason(wrapped) == "EROFS"
    assert fault_reason(ValueError("no number here")) == "ValueError"
    assert {"EISDIR", "ELOOP"} <= kv_store_module.FILE_FAULTS


# --- the engine over a broken store ------------------------------------------------------


def break_store(kind: str, root: Path) -> contextlib.AbstractContextManager[Any]:
    files = sorted(root.rglob("*.safetensors"))
    assert files, "the first engine wrote no blocks"
    if kind == "directory":
        for f in files:
            f.unlink()
            f.mkdir()
            (f / "x").write_text("")
        return contextlib.nullcontext()
    if kind == "corrupt":
        for f in files:
            data = bytearray(f.read_bytes())
            header = 8 + int.from_bytes(data[:8], "little")
            for i in range(header, len(data) - 8 * BLOCK):  # the sign bit of every KV value
                if (i - header) % 4 == 3:
                    data[i] ^= 0x80
            f.write_bytes(bytes(data))
        return contextlib.nullcontext()
    if kind == "read_only":
        f = files[0]
        data = bytearray(f.read_bytes())
        data[-1] ^= 0x01
        f.write_bytes(bytes(data))
        return read_only(root)
    assert kind == "full"
    return contextlib.nullcontext()


@pytest.mark.parametrize("kind", ["directory", "corrupt", "read_only", "full"])
def test_twenty_turns_over_a_broken_store_give_the_recomputed_tokens(
    tiny_llama: tuple[Path, Any], tmp_path: Path, kind: str
) -> None:
    path, _ = tiny_llama
    root = tmp_path / "store"
    with contextlib.ExitStack() as stack:
        if kind == "full":
            stack.enter_context(tmpfs(root, "1m"))
        first = make_engine(path, kv_store_dir=str(root), kv_store_bytes=1 << 30)
        prompt = random_prompt(3 * BLOCK + 5, seed=7)
        reference = make_engine(path)  # no store: every turn recomputed or pinned
        ref = turn(reference, "r0", prompt, session="conv", salt="alice")
        out = turn(first, "t0", prompt, session="conv", salt="alice")
        assert out.output_token_ids == ref.output_token_ids
        first.close_kv_store()
        if kind == "full":  # fill what is left of the volume
            with (root / "filler").open("wb") as f, contextlib.suppress(OSError):
                f.write(b"\0" * (1 << 20))
        stack.enter_context(break_store(kind, root))
        history = prompt + (ref.output_token_ids or [])
        faults = 0
        for t in range(1, 21):
            history = history + random_prompt(5, seed=100 + t)
            # A restart every turn: the prefix is looked up in the broken store each time.
            engine = make_engine(path, kv_store_dir=str(root), kv_store_bytes=1 << 30)
            got = turn(engine, f"t{t}", history, session="conv", salt="alice")
            want = turn(reference, f"r{t}", history, session="conv", salt="alice")
            assert got.output_token_ids == want.output_token_ids, f"turn {t}"
            assert engine.kv_store is not None
            engine.close_kv_store()
            faults += engine.kv_store.snapshot().num_errors
            history = history + (want.output_token_ids or [])
        assert faults > 0, "the broken store was never consulted"
