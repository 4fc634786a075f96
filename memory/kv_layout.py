"""KVCacheLayout: how many blocks the KV pools get, decided once at start-up. The arithmetic of
`kvchat.memory.pool_sizing` applied to what the engine measured, no tensors: the engine measures (on
CUDA, a profiling pass: `DeviceMemory`) and allocates; this module decides.

The result is a frozen object of its own, never written back into `CacheConfig` (which says
what a user asked for, not what the machine gave)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import CacheConfig

CPU_DEFAULT_KV_CACHE_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class DeviceMemory:
    """What a profiling pass measured on an accelerator, in bytes.

    peak_bytes: torch's peak allocation while the largest step ran, its scratch KV left out.
    non_torch_bytes: memory in use outside torch's allocator (the CUDA context, other
    processes) when the pass began."""

    total_bytes: int
    peak_bytes: int
    non_torch_bytes: int


@dataclass(frozen=True)
class KVCacheLayout:
    """What start-up measured: how many blocks the pools got."""

    num_blocks: int
    num_host_blocks: int
    bytes_per_block: int


def plan_kv_layout(
    cache: CacheConfig,
    bytes_per_block: int,
    measure: Callable[[], DeviceMemory] | None,
) -> KVCacheLayout:
    """The pools' sizes, in order of precedence: `num_blocks_override`; `kv_cache_bytes`; on an
    accelerator (`measure` given, called only here), as vLLM does, what is left of
    `gpu_memory_utilization x total` after the measured peak and what torch does not hold; else
    the CPU default. The host pool holds `host_cache_bytes`. `num_blocks` may come out below 1:
    the caller says what to change."""
    if cache.num_blocks_override is not None:
        num_blocks = cache.num_blocks_override
    elif cache.kv_cache_bytes is not None:
        num_blocks = cache.kv_cache_bytes // bytes_per_block
    elif measure is not None:
        measured = measure()
        budget = (
            cache.gpu_memory_utilization * measured.total_bytes
            - measured.peak_bytes
            - measured.non_torch_bytes
        )
        num_blocks = int(budget // bytes_per_block)
    else:
        num_blocks = CPU_DEFAULT_KV_CACHE_BYTES // bytes_per_block
    return KVCacheLayout(num_blocks, cache.host_cache_bytes // bytes_per_block, bytes_per_block)
