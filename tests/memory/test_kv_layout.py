"""The KV arithmetic without torch: KVCacheSpec's byte counts agree with the tensors the cache
allocates, and the pool sizing at start-up follows its precedence (override, bytes, measured
accelerator budget, CPU default)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from kvchat.kernels.quant import kv_storage_dtype
from kvchat.memory.config import CacheConfig
from kvchat.memory.kv_cache import KVCache
from kvchat.memory.kv_layout import CPU_DEFAULT_KV_CACHE_BYTES, DeviceMemory, plan_kv_layout
from kvchat.memory.kv_spec import KV_CACHE_DTYPES, KVCacheSpec


def test_the_arithmetic_modules_import_without_torch() -> None:
    code = (
        "import sys, kvchat.memory.kv_spec, kvchat.memory.kv_layout, kvchat.memory.pool_sizing, "
        "kvchat.memory.config; print(sorted(m for m in sys.modules "
        "if m.split('.')[0] == 'torch' or m.startswith('kvchat.kernels')))"
    )
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_spec_bytes_match_the_allocated_tensors(
    kv_cache_dtype: str, model_dtype: torch.dtype
) -> None:
    rng = random.Random(f"{kv_cache_dtype}-{model_dtype}")
    spec = KVCacheSpec(
        num_layers=rng.randint(1, 3),
        num_kv_heads=rng.randint(1, 4),
        head_dim=rng.choice([2, 8, 16, 64, 96]),
        block_size=rng.choice([1, 4, 16]),
        model_dtype=model_dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    num_blocks = rng.randint(1, 5)
    cache = KVCache(spec, num_blocks, torch.device("cpu"))
    allocated = cache.kv.numel() * cache.kv.element_size()
    if cache.scales is not None:
        allocated += cache.scales.numel() * cache.scales.element_size()
    assert allocated == spec.bytes_per_block * num_blocks
    assert spec.storage_dtype == kv_storage_dtype(kv_cache_dtype, model_dtype)
    assert spec.storage_dtype_name == str(spec.storage_dtype).removeprefix("torch.")
    assert spec.element_bytes * spec.head_dim == cache.kv.element_size() * cache.kv.shape[-1]
    assert spec.is_quantized == (cache.scales is not None)
    if cache.scales is not None:
        per_token = cache.scales[:, :, 0, 0].numel() * cache.scales.element_size()
        assert spec.scale_bytes_per_token == per_token
    else:
        assert spec.scale_bytes_per_token == 0


def test_int4_packs_two_channels_a_byte_with_a_float16_scale_per_32() -> None:
    # SmolLM2-135M's shape: 30 layers, 3 KV heads, head_dim 64.
    bf16 = KVCacheSpec(30, 3, 64, 16, torch.bfloat16)
    int4 = KVCacheSpec(30, 3, 64, 16, torch.bfloat16, "int4")
    assert int4.value_bytes_per_token == 2 * 30 * 3 * 32
    assert int4.scale_bytes_per_token == 2 * 30 * 3 * 2 * 2
    assert int4.bytes_per_token == 6480
    assert int4.bytes_per_token / bf16.bytes_per_token < 0.3
    cache = KVCache(int4, 2, torch.device("cpu"))
    assert cache.kv.shape[-1] == 32 and cache.kv.dtype == torch.uint8
    assert cache.scales is not None and cache.scales.shape[-1] == 2
    assert cache.scales.dtype == torch.float16


def test_an_unknown_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCacheSpec(1, 1, 2, 16, torch.float32, "int2")
    with pytest.raises(ValueError, match="even head_dim"):
        KVCacheSpec(1, 1, 3, 16, torch.float32, "int4")


PER_BLOCK = 4096


def no_measure() -> DeviceMemory:
    raise AssertionError("measured although the size was given")


def test_an_override_wins_over_bytes_and_measurement() -> None:
    cache = CacheConfig(
        num_blocks_override=7, kv_cache_bytes=10 * PER_BLOCK, host_cache_bytes=3 * PER_BLOCK + 1
    )
    layout = plan_kv_layout(cache, PER_BLOCK, no_measure)
    assert (layout.num_blocks, layout.num_host_blocks, layout.bytes_per_block) == (7, 3, PER_BLOCK)


@pytest.mark.parametrize("extra", [0, 1, PER_BLOCK - 1])
def test_kv_cache_bytes_hold_whole_blocks_only(extra: int) -> None:
    cache = CacheConfig(kv_cache_bytes=5 * PER_BLOCK + extra)
    assert plan_kv_layout(cache, PER_BLOCK, no_measure).num_blocks == 5


def test_a_measured_accelerator_gives_what_the_peak_leaves() -> None:
    measured = DeviceMemory(
        total_bytes=1000 * PER_BLOCK, peak_bytes=100 * PER_BLOCK + 5, non_torch_bytes=50 * PER_BLOCK
    )
    cache = CacheConfig(gpu_memory_utilization=0.5)
    layout = plan_kv_layout(cache, PER_BLOCK, lambda: measured)
    # 500 blocks' worth, less the peak (100 blocks and 5 bytes) and the rest: 349 whole blocks.
    assert layout.num_blocks == 349


def test_without_a_measurement_the_cpu_default_applies() -> None:
    layout = plan_kv_layout(CacheConfig(), PER_BLOCK, None)
    assert layout.num_blocks == CPU_DEFAULT_KV_CACHE_BYTES // PER_BLOCK
    assert layout.num_host_blocks == 0


def test_a_budget_below_one_block_is_reported_as_such() -> None:
    measured = DeviceMemory(
        total_bytes=10 * PER_BLOCK, peak_bytes=10 * PER_BLOCK, non_torch_bytes=0
    )
    assert plan_kv_layout(CacheConfig(), PER_BLOCK, lambda: measured).num_blocks < 1
