"""KVStore: full KV blocks on disk, beside the device and host pools, so a session's KV
outlives the process (a restart, a drain, a conversation moving to another replica).

Content-addressed by the prefix cache's salted hash chain: a block's file is named by its
hash, so a system prompt shared by many sessions is stored once and any stream whose tokens
chain to the same hash (same tenant, same tokens before it) can load it. The store is the
prefix cache's disk tier: a lookup that misses the device pool tries it before recomputing.

    <root>/<fingerprint>/<hash hex>.safetensors
        kv      uint8 [num_layers, 2, block_size, num_kv_heads, head_dim * element size]
        scales  uint8 [num_layers, 2, block_size, num_kv_heads * 4]  (int8 / fp8 KV only)
        tokens  int64 [block_size]: the block's token ids, compared on load
        metadata: the fingerprint

The fingerprint names everything the bytes depend on (the weights, the model's dtype, the KV
dtype, the block size, the KV shape), so a store shared by replicas of different models
never mixes their blocks. A file is written to a temporary name and renamed into place, so a
reader sees a whole file or none; a file that does not load, or whose fingerprint, shape or
token ids differ, is skipped (and removed): the caller recomputes, it never uses it.

Writes are behind: `put` queues copies made by the caller and returns; one writer thread
serializes them, so a turn never waits for the disk, and a SIGKILL leaves every block whose
write finished. `flush` waits for the queue (a drain). The byte cap evicts least recently
used files (a load or a write marks a file used, through its mtime, which is what other
processes sharing the directory see too)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .stats import KVStoreStats

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
# What to keep when the cap is passed: evicting down to a little below it means one rescan
# of the directory frees room for many writes, not one.
EVICT_TO = 0.9
# Bytes of each weight file the fingerprint reads (its header, then samples spread over it):
# enough that two checkpoints of one shape differ, without reading gigabytes at start-up.
SAMPLE_BYTES = 1 << 20
NUM_SAMPLES = 16


@dataclass(frozen=True)
class BlockData:
    """One block's KV as bytes on the CPU (copied out of a pool by the caller)."""

    block_hash: bytes
    token_ids: tuple[int, ...]
    kv: torch.Tensor  # uint8 [num_layers, 2, block_size, num_kv_heads, bytes per head]
    scales: torch.Tensor | None  # uint8 [num_layers, 2, block_size, num_kv_heads * 4]


def weights_fingerprint(model_dir: str | Path) -> str:
    """sha256 over the model's config and, for each safetensors file, its size, its header
    and samples spread over its data."""
    root = Path(model_dir)
    h = hashlib.sha256()
    config = root / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(path.name.encode() + b"\x00" + size.to_bytes(8, "little"))
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, 1 << 24)))
            for i in range(NUM_SAMPLES):
                f.seek(size * i // NUM_SAMPLES)
                h.update(f.read(SAMPLE_BYTES // NUM_SAMPLES))
    return h.hexdigest()


def store_fingerprint(weights: str, parts: dict[str, object]) -> str:
    """The directory name: the weights' fingerprint and the KV layout, hashed together."""
    text = json.dumps({"weights": weights, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class KVStore:
    """See the module docstring. `kv_shape` / `scales_shape`: one block's byte shapes (files
    of any other shape are skipped). Thread-safe: the engine thread loads and puts, the writer
    thread writes, operators read `stats`."""

    def __init__(
        self,
        root: str | Path,
        fingerprint: str,
        max_bytes: int,
        kv_shape: Sequence[int],
        scales_shape: Sequence[int] | None,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a KV store needs a byte cap > 0, got {max_bytes}")
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.kv_shape = tuple(kv_shape)
        self.scales_shape = tuple(scales_shape) if scales_shape is not None else None
        self.stats = KVStoreStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> bytes, LRU first
        self._pending: set[bytes] = set()  # queued, not yet written
        self._queue: queue.Queue[list[BlockData] | None] = queue.Queue()
        self._rescan()
        self._writer = threading.Thread(
            target=self._write_loop, name="kv-store-writer", daemon=True
        )
        self._writer.start()

    # -- the engine thread -----------------------------------------------------------------------

    def knows(self, block_hash: bytes) -> bool:
        """Whether the block is stored or queued by this process (other processes' blocks are
        found by `load`)."""
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def note_copy(self, seconds: float) -> None:
        """The caller spent `seconds` copying blocks out for `put` (the turn's share of the
        write-behind)."""
        with self._lock:
            self.stats.copy_seconds += seconds

    def put(self, blocks: Sequence[BlockData]) -> None:
        """Queue blocks for the writer (those already known are dropped here)."""
        with self._lock:
            fresh = [
                b
                for b in blocks
                if b.block_hash not in self._index and b.block_hash not in self._pending
            ]
            self._pending.update(b.block_hash for b in fresh)
        if fresh:
            self._queue.put(fresh)

    def load(self, block_hash: bytes, token_ids: Sequence[int]) -> BlockData | None:
        """The stored block of that hash whose token ids are `token_ids`, or None (no file, or
        one that cannot be used: it is removed)."""
        path = self._path(block_hash)
        try:
            tensors = load_file(path)
        except FileNotFoundError:
            self._count_miss(block_hash)
            return None
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            self._reject(block_hash, path, f"unreadable: {e}")
            return None
        reason = self._check(tensors, token_ids)
        if reason is not None:
            self._reject(block_hash, path, reason)
            return None
        try:
            os.utime(path)  # most recently used, for every process sharing the directory
            size = path.stat().st_size
        except OSError:
            size = 0
        with self._lock:
            if block_hash not in self._index:
                self.stats.num_blocks += 1
                self.stats.num_bytes += size
            self._index[block_hash] = size
            self._index.move_to_end(block_hash)
            self.stats.hits += 1
        return BlockData(block_hash, tuple(token_ids), tensors["kv"], tensors.get("scales"))

    # -- any thread ------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written; False when `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._pending:
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued (up to `timeout`), then stop the writer."""
        if not self._writer.is_alive():
            return
        if not self.flush(timeout):
            log.warning("KV store: closing with %d blocks not written", len(self._pending))
        self._queue.put(None)
        self._writer.join(timeout)

    def snapshot(self) -> KVStoreStats:
        with self._lock:
            return KVStoreStats(**vars(self.stats))

    # -- internals -------------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def _check(self, tensors: dict[str, torch.Tensor], token_ids: Sequence[int]) -> str | None:
        kv, tokens = tensors.get("kv"), tensors.get("tokens")
        if kv is None or tokens is None:
            return "missing tensors"
        if tuple(kv.shape) != self.kv_shape or kv.dtype != torch.uint8:
            return f"kv shape {tuple(kv.shape)} is not {self.kv_shape}"
        scales = tensors.get("scales")
        if self.scales_shape is None:
            if scales is not None:
                return "scales for an unquantized KV"
        elif scales is None or tuple(scales.shape) != self.scales_shape:
            return "scales missing or misshapen"
        if tokens.tolist() != list(token_ids):
            return "token ids differ"
        return None

    def _count_miss(self, block_hash: bytes) -> None:
        with self._lock:
            self.stats.misses += 1
            size = self._index.pop(block_hash, None)
            if size is not None:  # another process evicted it
                self.stats.num_blocks -= 1
                self.stats.num_bytes -= size

    def _reject(self, block_hash: bytes, path: Path, reason: str) -> None:
        log.warning("KV store: skipping %s (%s); its tokens are recomputed", path.name, reason)
        with self._lock:
            self.stats.skipped += 1
            self.stats.misses += 1
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.stats.num_blocks -= 1
                self.stats.num_bytes -= size
        path.unlink(missing_ok=True)

    def _write_loop(self) -> None:
        while True:
            blocks = self._queue.get()
            if blocks is None:
                return
            for block in blocks:
                began = time.perf_counter()
                try:
                    size = self._write(block)
                except OSError as e:
                    log.warning("KV store: writing %s failed: %s", block.block_hash.hex(), e)
                    size = None
                with self._lock:
                    self._pending.discard(block.block_hash)
                    if size is not None:
                        if block.block_hash not in self._index:
                            self.stats.num_blocks += 1
                            self.stats.num_bytes += size
                        self._index[block.block_hash] = size
                        self._index.move_to_end(block.block_hash)
                        self.stats.writes += 1
                    self.stats.write_seconds += time.perf_counter() - began
                    over = self.stats.num_bytes > self.max_bytes
                if over:
                    self._evict()

    def _write(self, block: BlockData) -> int:
        path = self._path(block.block_hash)
        tensors = {
            "kv": block.kv.contiguous(),
            "tokens": torch.tensor(block.token_ids, dtype=torch.int64),
        }
        if block.scales is not None:
            tensors["scales"] = block.scales.contiguous()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        save_file(tensors, tmp, metadata={"fingerprint": self.fingerprint})
        os.replace(tmp, path)
        return path.stat().st_size

    def _rescan(self) -> None:
        """Rebuild the index from the directory (other processes write and evict there too),
        least recently used first; leftovers of interrupted writes are removed."""
        entries: list[tuple[float, bytes, int]] = []
        for entry in os.scandir(self.dir):
            name = entry.name
            try:
                if name.endswith(".tmp"):
                    if time.time() - entry.stat().st_mtime > 60:
                        os.unlink(entry.path)
                    continue
                if not name.endswith(SUFFIX):
                    continue
                st = entry.stat()
                entries.append((st.st_mtime, bytes.fromhex(name[: -len(SUFFIX)]), st.st_size))
            except (OSError, ValueError):
                continue
        entries.sort()
        with self._lock:
            self._index = OrderedDict((h, size) for _, h, size in entries)
            self.stats.num_blocks = len(self._index)
            self.stats.num_bytes = sum(self._index.values())

    def _evict(self) -> None:
        """Remove least recently used files until the store is under EVICT_TO of its cap."""
        self._rescan()
        target = int(self.max_bytes * EVICT_TO)
        while True:
            with self._lock:
                if self.stats.num_bytes <= target or not self._index:
                    return
                block_hash, size = self._index.popitem(last=False)
                self.stats.num_blocks -= 1
                self.stats.num_bytes -= size
                self.stats.evictions += 1
            self._path(block_hash).unlink(missing_ok=True)
