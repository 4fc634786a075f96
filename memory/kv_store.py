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
        metadata: format "2", the fingerprint, the block's hash (hex), and the checksum:
            blake2b-128 over kv, tokens and scales' bytes in that order

The fingerprint names everything the bytes depend on (the weights, the model's dtype, the KV
dtype, the block size, the KV shape), so a store shared by replicas of different models
never mixes their blocks. A file is written to a temporary name and renamed into place, so a
reader sees a whole file or none.

The store is a cache that can only ever cost a recompute. Every read is verified: a regular
file (never a symlink, a directory or a device), of a plausible size, whose format,
fingerprint, block hash, checksum, shapes and token ids are what the lookup expects; a file
that fails is skipped (and removed where it can be): the caller recomputes, it never uses it.
Every fault on open, scan, read, write, rename or removal, whatever the library raises, is
caught here, logged once per cause and counted in `stats.errors` by (op, reason); nothing
reaches the engine. A store whose I/O fails FAILURES_TO_DISABLE times in a row (a read-only
volume, a full disk) turns itself off for RETRY_SECONDS, drops what it has queued, and then
tries again; while off, lookups miss and nothing is queued.

Writes are behind: `put` queues copies made by the caller and returns; one writer thread
serializes them, so a turn never waits for the disk, and a SIGKILL leaves every block whose
write finished. The writer's hashing and copying take CPU, which on a small machine is the
prefill's: while the engine's steps prefill (`set_prefilling`) the writer waits for a step
without one, up to HOLD_SECONDS of unbroken prefill, so a finished turn's blocks are written
while the next turn decodes or the engine idles, not while it waits for its first token.
The queue holds at most `max_pending_bytes`: past it the oldest copies are dropped
(counted). `flush` waits for the queue (a drain). The byte cap evicts least recently
used files (a load or a write marks a file used, through its mtime, which is what other
processes sharing the directory see too)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

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
FORMAT = "2"
# I/O faults in a row (no success between them) that turn the store off, and for how long.
FAILURES_TO_DISABLE = 8
RETRY_SECONDS = 60.0
# Copies the writer may have queued (bytes): past it the oldest are dropped.
MAX_PENDING_BYTES = 64 << 20
# Longest the writer holds back while the engine prefills (seconds of one unbroken stretch of
# prefill steps); past it, writes go on beside the prefill.
HOLD_SECONDS = 5.0
# Faults of one file, not of the store: they never turn the store off.
FILE_FAULTS = frozenset({"EISDIR", "ELOOP", "ENOTEMPTY", "ENXIO", "not_regular"})
# Header bytes a block file may have beyond its tensors' (the JSON header is ~0.5 KiB).
MAX_HEADER_BYTES = 64 << 10


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


class NotRegularFile(OSError):
    """A FIFO, a socket or a device where a block file should be."""


def fault_reason(e: BaseException) -> str:
    """The errno's name of an I/O error, also where a library wraps it in its own exception
    (safetensors: "... os error 28"), else the exception's type."""
    if isinstance(e, NotRegularFile):
        return "not_regular"
    code = e.errno if isinstance(e, OSError) else None
    if not code:
        found = re.search(r"(?:os error|code:?)\s*(\d+)", str(e))
        code = int(found.group(1)) if found else None
    if code:
        return errno.errorcode.get(code, f"errno{code}")
    return type(e).__name__


def checksum(tensors: Sequence[torch.Tensor | None]) -> str:
    """blake2b-128 over the tensors' bytes, in order (None skipped)."""
    h = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        if tensor is not None:
            h.update(tensor.contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


class KVStore:
    """See the module docstring. `kv_shape` / `scales_shape`: one block's byte shapes (files
    of any other shape are skipped). Thread-safe: the engine thread loads and puts, the writer
    thread writes, operators read `stats`. `clock` (monotonic seconds) is injectable, for the
    time a store that turned itself off waits before it tries again."""

    def __init__(
        self,
        root: str | Path,
        fingerprint: str,
        max_bytes: int,
        kv_shape: Sequence[int],
        scales_shape: Sequence[int] | None,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a KV store needs a byte cap > 0, got {max_bytes}")
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint
        self.max_bytes = max_bytes
        self.max_pending_bytes = max_pending_bytes
        self.kv_shape = tuple(kv_shape)
        self.scales_shape = tuple(scales_shape) if scales_shape is not None else None
        self.stats = KVStoreStats()
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> bytes, LRU first
        self._pending: set[bytes] = set()  # queued or being written
        self._queue: deque[BlockData | None] = deque()  # None: stop
        self._unusable: set[bytes] = set()  # files that fail and cannot be removed
        self._logged: set[tuple[str, str]] = set()
        self._failures = 0  # I/O faults in a row
        self._disabled_until: float | None = None
        self._prefilling_since: float | None = None  # the engine's steps prefill since then
        self._flushing = 0  # flush() calls waiting: nothing is held back
        tokens_bytes = (kv_shape[2] if len(kv_shape) > 2 else 0) * 8
        self._max_file_bytes = (
            _numel(self.kv_shape)
            + (_numel(self.scales_shape) if self.scales_shape else 0)
            + tokens_bytes
            + MAX_HEADER_BYTES
        )
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except Exception as e:  # a read-only or missing volume: serve without the store
            self._fault("open", fault_reason(e), e)
            self._disable(f"cannot open {self.dir}: {fault_reason(e)}")
        else:
            self._rescan()
        self._writer = threading.Thread(
            target=self._write_loop, name="kv-store-writer", daemon=True
        )
        self._writer.start()

    # -- the engine thread -----------------------------------------------------------------------

    @property
    def is_enabled(self) -> bool:
        """False while the store has turned itself off (it tries again after RETRY_SECONDS)."""
        with self._lock:
            return self._enabled_locked()

    def knows(self, block_hash: bytes) -> bool:
        """Whether the block needs no write: stored or queued by this process, or a file that
        fails and cannot be replaced (other processes' blocks are found by `load`)."""
        with self._lock:
            return (
                block_hash in self._index
                or block_hash in self._pending
                or block_hash in self._unusable
            )

    @property
    def prefilling(self) -> bool:
        """Whether the engine said its steps prefill now (the writer holds back)."""
        with self._lock:
            return self._prefilling_since is not None

    def set_prefilling(self, prefilling: bool) -> None:
        """Whether the engine's steps prefill now: the writer holds back while they do."""
        with self._lock:
            if prefilling == (self._prefilling_since is not None):
                return
            self._prefilling_since = self._clock() if prefilling else None
            if not prefilling:
                self._wake.notify_all()

    def note_copy(self, seconds: float) -> None:
        """The caller spent `seconds` copying blocks out for `put` (the turn's share of the
        write-behind)."""
        with self._lock:
            self.stats.copy_seconds += seconds

    def put(self, blocks: Sequence[BlockData]) -> None:
        """Queue blocks for the writer (those already known are dropped here; past the queue's
        byte cap the oldest queued copies are dropped, counted)."""
        with self._lock:
            if not self._enabled_locked():
                self.stats.dropped += len(blocks)
                return
            for b in blocks:
                if b.block_hash in self._index or b.block_hash in self._pending:
                    continue
                if b.block_hash in self._unusable:
                    continue
                self._pending.add(b.block_hash)
                self._queue.append(b)
                self.stats.pending_bytes += _nbytes(b)
            while self.stats.pending_bytes > self.max_pending_bytes and self._queue:
                oldest = self._queue.popleft()
                if oldest is None:  # a stop request stays last
                    self._queue.appendleft(oldest)
                    break
                self._pending.discard(oldest.block_hash)
                self.stats.pending_bytes -= _nbytes(oldest)
                self.stats.dropped += 1
            self._wake.notify()

    def load(self, block_hash: bytes, token_ids: Sequence[int]) -> BlockData | None:
        """The stored block of that hash whose token ids are `token_ids`, or None (no file, a
        store that is off, or a file that cannot be used: it is removed where it can be).
        Never raises."""
        with self._lock:
            if not self._enabled_locked() or block_hash in self._unusable:
                self.stats.misses += 1
                return None
        path = self._path(block_hash)
        try:
            data = self._read(path)
        except FileNotFoundError:
            self._count_miss(block_hash)
            return None
        except Exception as e:
            self._fault("read", fault_reason(e), e)
            self._reject(block_hash, path)
            return None
        self._succeeded()
        problem: str | None
        try:
            tensors, problem = self._verify(data, block_hash, token_ids)
        except Exception as e:  # whatever a malformed file makes the parser raise
            tensors, problem = None, "format"
            log.debug("KV store: parsing %s: %s", path.name, e)
        if tensors is None:
            reason = problem or "format"
            self._fault("verify", reason, f"{path.name}: {reason}", io=False)
            self._reject(block_hash, path)
            return None
        try:
            os.utime(path)  # most recently used, for every process sharing the directory
        except Exception as e:  # a read-only volume: the LRU order is this process's alone
            self._fault("touch", fault_reason(e), e, io=False)
        size = len(data)
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
        """Wait until every queued block is written (or dropped); False when `timeout` ran out
        first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._flushing += 1
            self._wake.notify_all()
            try:
                while self._pending:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._wake.wait(0.05 if left is None else min(left, 0.05))
                return True
            finally:
                self._flushing -= 1

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued (up to `timeout`), then stop the writer."""
        if not self._writer.is_alive():
            return
        if not self.flush(timeout):
            log.warning("KV store: closing with %d blocks not written", len(self._pending))
        with self._lock:
            self._queue.append(None)
            self._wake.notify_all()
        self._writer.join(timeout)

    def snapshot(self) -> KVStoreStats:
        with self._lock:
            self._enabled_locked()
            return self.stats.copy()

    # -- internals -------------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def _enabled_locked(self) -> bool:
        if self._disabled_until is None:
            return True
        if self._clock() < self._disabled_until:
            return False
        # Half-open: try again; one more I/O fault turns the store off again.
        self._disabled_until = None
        self._failures = FAILURES_TO_DISABLE - 1
        self.stats.enabled = True
        self.stats.disabled_reason = None
        log.warning("KV store: trying %s again", self.dir)
        return True

    def _disable(self, why: str) -> None:
        with self._lock:
            self._disable_locked(why)

    def _disable_locked(self, why: str) -> None:
        self._disabled_until = self._clock() + RETRY_SECONDS
        self.stats.enabled = False
        self.stats.disabled_reason = why
        dropped = [b for b in self._queue if b is not None]
        self._queue = deque(b for b in self._queue if b is None)
        for b in dropped:
            self._pending.discard(b.block_hash)
        self.stats.dropped += len(dropped)
        self.stats.pending_bytes = 0
        self._wake.notify_all()
        log.error(
            "KV store: turned off for %.0f s, serving goes on without it (%s; %d queued "
            "blocks dropped)",
            RETRY_SECONDS,
            why,
            len(dropped),
        )

    def _fault(self, op: str, reason: str, detail: object, io: bool = True) -> None:
        """Count a caught fault, log it once per (op, reason), and turn the store off when its
        I/O keeps failing."""
        key = (op, reason)
        with self._lock:
            self.stats.errors[key] = self.stats.errors.get(key, 0) + 1
            first = key not in self._logged
            self._logged.add(key)
            if io and reason not in FILE_FAULTS:
                self._failures += 1
                if self._failures >= FAILURES_TO_DISABLE and self._disabled_until is None:
                    self._disable_locked(f"{op} failed {self._failures} times in a row: {reason}")
        if first:
            log.warning(
                "KV store: %s failed (%s): %s; the tokens are recomputed (counted in "
                "kvchat:kv_store_errors_total; logged once per cause)",
                op,
                reason,
                detail,
            )

    def _succeeded(self) -> None:
        with self._lock:
            self._failures = 0

    def _read(self, path: Path) -> bytes:
        """A block file's bytes: a regular file only (O_NOFOLLOW: a symlink fails with ELOOP;
        O_NONBLOCK: a FIFO cannot hang the engine), no bigger than a block's file can be."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "a directory in place of a block", str(path))
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFile(f"{path.name} is not a regular file")
            if st.st_size > self._max_file_bytes:
                raise OSError(
                    errno.EFBIG,
                    f"{st.st_size} bytes, a block's file has at most {self._max_file_bytes}",
                )
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _verify(
        self, data: bytes, block_hash: bytes, token_ids: Sequence[int]
    ) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """(the tensors, None), or (None, why the file cannot be used)."""
        if len(data) < 8:
            return None, "format"
        header_len = int.from_bytes(data[:8], "little")
        if header_len > min(len(data) - 8, MAX_HEADER_BYTES):
            return None, "format"
        meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
        if meta.get("format") != FORMAT:
            return None, "format"
        if meta.get("fingerprint") != self.fingerprint:
            return None, "fingerprint"
        if meta.get("block") != block_hash.hex():
            return None, "block_hash"
        tensors = load_bytes(data)
        kv, tokens = tensors.get("kv"), tensors.get("tokens")
        if kv is None or tokens is None:
            return None, "format"
        scales = tensors.get("scales")
        if tuple(kv.shape) != self.kv_shape or kv.dtype != torch.uint8:
            return None, "shape"
        if self.scales_shape is None:
            if scales is not None:
                return None, "shape"
        elif scales is None or tuple(scales.shape) != self.scales_shape:
            return None, "shape"
        if tokens.dtype != torch.int64 or meta.get("checksum") != checksum([kv, tokens, scales]):
            return None, "checksum"
        if tokens.tolist() != list(token_ids):
            return None, "tokens"
        return tensors, None

    def _count_miss(self, block_hash: bytes) -> None:
        with self._lock:
            self.stats.misses += 1
            size = self._index.pop(block_hash, None)
            if size is not None:  # another process evicted it
                self.stats.num_blocks -= 1
                self.stats.num_bytes -= size

    def _reject(self, block_hash: bytes, path: Path) -> None:
        """A file that cannot be used: skipped, and removed where it can be (else remembered,
        so it is neither read nor rewritten again)."""
        with self._lock:
            self.stats.skipped += 1
            self.stats.misses += 1
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.stats.num_blocks -= 1
                self.stats.num_bytes -= size
        if not self._remove(path):
            with self._lock:
                if len(self._unusable) > 1 << 16:
                    self._unusable.clear()
                self._unusable.add(block_hash)

    def _remove(self, path: Path) -> bool:
        """Unlink a file; False (counted) when it cannot be removed."""
        try:
            path.unlink(missing_ok=True)
            return True
        except Exception as e:
            self._fault("remove", fault_reason(e), e)
            return False

    def _write_loop(self) -> None:
        """The writer thread: survives every fault (each is counted by `_write`)."""
        while True:
            with self._lock:
                while not self._queue:
                    self._wake.wait()
                self._hold_locked()
                block = self._queue.popleft()
                if block is None:
                    return
                self.stats.pending_bytes -= _nbytes(block)
            began = time.perf_counter()
            size = self._write(block)
            with self._lock:
                if size is not None:
                    if block.block_hash not in self._index:
                        self.stats.num_blocks += 1
                        self.stats.num_bytes += size
                    self._index[block.block_hash] = size
                    self._index.move_to_end(block.block_hash)
                    self.stats.writes += 1
                over = self.stats.num_bytes > self.max_bytes
            if over:
                self._evict()
            with self._lock:  # done (a flush returns once the cap holds again too)
                self._pending.discard(block.block_hash)
                self.stats.write_seconds += time.perf_counter() - began
                self._wake.notify_all()

    def _hold_locked(self) -> None:
        """Wait while the engine prefills (up to HOLD_SECONDS of it), unless a flush or a stop
        is waiting."""
        while (
            self._prefilling_since is not None
            and not self._flushing
            and self._queue
            and self._queue[-1] is not None  # a stop request is queued last
        ):
            left = self._prefilling_since + HOLD_SECONDS - self._clock()
            if left <= 0:
                return
            self._wake.wait(min(left, 0.05))

    def _write(self, block: BlockData) -> int | None:
        """Write one block (temporary name, then rename); its size, or None (counted)."""
        path = self._path(block.block_hash)
        tokens = torch.tensor(block.token_ids, dtype=torch.int64)
        kv = block.kv.contiguous()
        scales = block.scales.contiguous() if block.scales is not None else None
        tensors = {"kv": kv, "tokens": tokens}
        if scales is not None:
            tensors["scales"] = scales
        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "block": block.block_hash.hex(),
            "checksum": checksum([kv, tokens, scales]),
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        op = "write"
        try:
            data = save_bytes(tensors, metadata=meta)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            op = "rename"
            os.replace(tmp, path)
        except Exception as e:
            reason = fault_reason(e)
            self._fault(op, reason, e)
            if op == "rename" and reason in FILE_FAULTS:  # e.g. a directory in place
                with self._lock:
                    self._unusable.add(block.block_hash)
            if op == "rename" or os.path.lexists(tmp):
                self._remove(tmp)
            return None
        self._succeeded()
        return len(data)

    def _rescan(self) -> None:
        """Rebuild the index from the directory (other processes write and evict there too),
        least recently used first; leftovers of interrupted writes are removed."""
        entries: list[tuple[float, bytes, int]] = []
        try:
            listing = list(os.scandir(self.dir))
        except Exception as e:
            self._fault("scan", fault_reason(e), e)
            return
        for entry in listing:
            name = entry.name
            try:
                if name.endswith(".tmp"):
                    if time.time() - entry.stat(follow_symlinks=False).st_mtime > 60:
                        os.unlink(entry.path)
                    continue
                if not name.endswith(SUFFIX):
                    continue
                st = entry.stat(follow_symlinks=False)
                entries.append((st.st_mtime, bytes.fromhex(name[: -len(SUFFIX)]), st.st_size))
            except Exception:  # a file another process removed, or a name not ours
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
            self._remove(self._path(block_hash))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _nbytes(block: BlockData) -> int:
    n = block.kv.numel() * block.kv.element_size()
    if block.scales is not None:
        n += block.scales.numel() * block.scales.element_size()
    return n + 8 * len(block.token_ids)
