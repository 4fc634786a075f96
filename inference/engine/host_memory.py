"""Host allocator settings for decoding on the CPU.

A decode step allocates the same large tensors every time (activations, the [batch, vocab]
logits, the sampler's and the grammar masks' rows: megabytes each). glibc serves blocks above
its mmap threshold (128 KiB at start, raised only as far as the largest block freed so far)
with a fresh mmap and returns them with munmap, and trims freed heap above its trim
threshold, so each step's big tensors first-touch fresh pages: page faults that cost a
batch-16 step on the bench model about 3 ms of ~44. Setting the threshold to 32 MiB (the
ceiling of glibc's own adjustment on 64-bit systems) and keeping up to 1 GiB of freed heap
lets those blocks be reused, as a caching allocator (torch's CUDA one, jemalloc, tcmalloc)
would. Tensors above 32 MiB still come from mmap. Other C libraries are left alone.

Kept freed memory must not pile up in a server that runs for days: blocks of sizes it sees once
(prompts of every length) leave holes inside the heaps that the trim threshold never returns,
and every thread that allocates gets an arena of its own that keeps its own. So the arenas are
capped at ARENA_MAX, and `HeapTrimmer` has the engine thread call malloc_trim(0) (which also
gives back whole free pages inside each arena) every TRIM_INTERVAL_S: one step in that many
seconds first-touches its pages again, and RSS stays flat (bench/soak.py measures it)."""

from __future__ import annotations

import ctypes
import logging
import platform
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**30
ARENA_MAX = 2
TRIM_INTERVAL_S = 30.0

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings above once per process (later calls return the first result): True
    when glibc took them, False on another C library or when mallopt refused."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _apply() -> bool:
    libc = _glibc()
    if libc is None:
        return False
    ok = (
        bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        and bool(libc.mallopt(M_ARENA_MAX, ARENA_MAX))
    )
    log.debug(
        "glibc malloc: mmap threshold %d, trim threshold %d: %s",
        MMAP_THRESHOLD,
        TRIM_THRESHOLD,
        "set" if ok else "refused",
    )
    return ok


class HeapTrimmer:
    """Calls `release_freed_memory` at most once every `interval` seconds (`clock`: monotonic
    seconds, injectable); the engine thread asks after each step and while idle."""

    def __init__(
        self, interval: float = TRIM_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self.clock = clock
        self.last = clock()
        self.num_trims = 0

    def maybe_trim(self) -> bool:
        """Trim if `interval` has passed since the last one; True when it trimmed."""
        now = self.clock()
        if now - self.last < self.interval:
            return False
        self.last = now
        if release_freed_memory():
            self.num_trims += 1
            return True
        return False


def release_freed_memory() -> bool:
    """Return the heap freed so far to the system (glibc's malloc_trim): after loading, the
    checkpoint's tensors before casting and fusing and the linear probe's copies are garbage
    the trim threshold above would otherwise keep resident. True when glibc did it."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


HUGE_PAGE = 2 * 2**20


class HugePageArena:
    """One anonymous mapping, backed by transparent huge pages where the kernel grants them
    (madvise(MADV_HUGEPAGE): honoured in the default "madvise" THP mode), that tensors are
    copied into. A decode step streams every weight once; in 4 KiB pages that is a page walk
    and a hardware-prefetcher restart every 4 KiB, in 2 MiB pages every 2 MiB. Tensors placed
    here share the mapping, which lives as long as any of them (and the arena) does."""

    def __init__(self, num_bytes: int) -> None:
        import mmap

        self.capacity = num_bytes + HUGE_PAGE
        self._map = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge = False
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except OSError:
                pass
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._offset = (-base) % HUGE_PAGE  # the first tensor starts on a huge page

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` (contiguous, same shape and dtype) in the arena."""
        num_bytes = tensor.numel() * tensor.element_size()
        if self._offset + num_bytes > self.capacity:
            raise ValueError(
                f"arena full: {num_bytes} bytes asked, {self.capacity - self._offset} left"
            )
        out = torch.frombuffer(
            self._map, dtype=tensor.dtype, count=tensor.numel(), offset=self._offset
        ).view(tensor.shape)
        out.copy_(tensor)
        self._offset += -(-num_bytes // 4096) * 4096  # the next on a 4 KiB page
        return out
