"""Shared builders for the kernel tests: a paged KV pool filled with random values, block
tables with shuffled (non-contiguous, optionally shared) block ids, and error measures.

Every case draws fresh inputs from its own seed (`case_seed(case_id)`), so no two cases see
the same numbers and a failure reproduces from its test id alone. Tests reach these helpers
through the `kv` fixture (the module itself): `import conftest` would be ambiguous with
tests/conftest.py.
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

import kvchat.kernels  # noqa: F401  (sets TRITON_INTERPRET before any kernel module is imported)
from kvchat.kernels.cache_write import write_kv_cache_ref
from kvchat.kernels.quant import group_size, is_packed, is_quantized, scale_dtype

CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "int4": torch.uint8,
}


def case_seed(case_id: str) -> int:
    return zlib.crc32(case_id.encode())


def generator(case_id: str) -> torch.Generator:
    return torch.Generator().manual_seed(case_seed(case_id))


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; NaN (an unwritten, poisoned element) gives inf."""
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    diff = (out.double() - ref.double()).abs().max()
    return float(diff / ref.double().abs().max().clamp_min(1e-30))


@dataclass
class PagedKV:
    """A block pool and the block tables of a batch, in storage and in float64."""

    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], cache dtype
    value_cache: torch.Tensor
    key_scale_cache: torch.Tensor | None  # [num_blocks, block_size, num_kv_heads, num_groups]
    value_scale_cache: torch.Tensor | None
    key_full: torch.Tensor  # float64 values before quantization (equal to the cache if not)
    value_full: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor  # [num_seqs] int32

    def storage(self) -> dict[str, torch.Tensor | None]:
        """Caches as the kernels take them."""
        return dict(
            key_cache=self.key_cache,
            value_cache=self.value_cache,
            key_scale_cache=self.key_scale_cache,
            value_scale_cache=self.value_scale_cache,
        )

    def storage_f64(self) -> dict[str, torch.Tensor | None]:
        """The same stored values in float64 (the ref dequantizes in float64)."""
        quantized = self.key_scale_cache is not None
        return dict(
            key_cache=self.key_cache if quantized else self.key_cache.double(),
            value_cache=self.value_cache if quantized else self.value_cache.double(),
            key_scale_cache=self.key_scale_cache.double() if quantized else None,
            value_scale_cache=self.value_scale_cache.double() if quantized else None,
        )

    def full_f64(self) -> dict[str, torch.Tensor | None]:
        """The unquantized values in float64."""
        return dict(
            key_cache=self.key_full,
            value_cache=self.value_full,
            key_scale_cache=None,
            value_scale_cache=None,
        )


def build_paged_kv(
    gen: torch.Generator,
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    *,
    shared_prefix_blocks: int = 0,
    spare_blocks: int = 3,
) -> PagedKV:
    """Random K/V in a shuffled pool (plus `spare_blocks` no sequence uses). Sequences 0 and
    1 share their first `shared_prefix_blocks` block ids."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    if shared_prefix_blocks:
        assert min(blocks_per_seq[:2]) >= shared_prefix_blocks, "both sequences need the prefix"
    num_blocks = sum(blocks_per_seq) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max(blocks_per_seq, default=0) + 1  # a -1 pad column past the longest
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    next_id = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[next_id : next_id + n]
        next_id += n
    if shared_prefix_blocks:
        block_tables[1, :shared_prefix_blocks] = block_tables[0, :shared_prefix_blocks]

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Per-token magnitudes vary so the per-token quantization scales differ.
    key = torch.randn(shape, generator=gen) * torch.exp(
        0.5 * torch.randn(shape[:3] + (1,), generator=gen)
    )
    value = torch.randn(shape, generator=gen)
    if is_quantized(cache_dtype):
        stored = (*shape[:3], head_dim // 2 if is_packed(cache_dtype) else head_dim)
        key_cache = torch.empty(stored, dtype=cache_dtype)
        value_cache = torch.empty(stored, dtype=cache_dtype)
        groups = (*shape[:3], head_dim // group_size(cache_dtype, head_dim))
        key_scale = torch.empty(groups, dtype=scale_dtype(cache_dtype))
        value_scale = torch.empty(groups, dtype=scale_dtype(cache_dtype))
        slots = torch.arange(num_blocks * block_size)
        write_kv_cache_ref(
            key.view(-1, num_kv_heads, head_dim),
            value.view(-1, num_kv_heads, head_dim),
            key_cache,
            value_cache,
            slots,
            key_scale,
            value_scale,
        )
        return PagedKV(
            key_cache,
            value_cache,
            key_scale,
            value_scale,
            key.double(),
            value.double(),
            block_tables,
            torch.tensor(seq_lens, dtype=torch.int32),
        )
    key_cache, value_cache = key.to(cache_dtype), value.to(cache_dtype)
    return PagedKV(
        key_cache,
        value_cache,
        None,
        None,
        key_cache.double(),
        value_cache.double(),
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
    )


def drop_blocks_outside_window(
    paged: PagedKV, first_query_pos: list[int], sliding_window: int, num_sink_tokens: int
) -> int:
    """Set to -1 the table entries of blocks no query of the sequence can see (wholly before
    the window of its first query and past the sinks), as a cache that frees them would.
    Returns how many entries were dropped."""
    block_size = paged.key_cache.shape[1]
    dropped = 0
    for i, pos in enumerate(first_query_pos):
        first_key = pos - sliding_window + 1
        for b in range(paged.block_tables.shape[1]):
            start, end = b * block_size, (b + 1) * block_size
            if end <= first_key and start >= num_sink_tokens:
                dropped += int(paged.block_tables[i, b] >= 0)
                paged.block_tables[i, b] = -1
    return dropped


def rel_l2_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def query_dtype_for(cache_dtype: torch.dtype, requested: torch.dtype | None = None) -> torch.dtype:
    """Unquantized caches hold the query dtype; quantized ones take a float32 query unless
    a test asks for another."""
    if requested is not None:
        return requested
    return torch.float32 if is_quantized(cache_dtype) else cache_dtype


def random_query(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A query in `dtype`; its float64 upcast is the reference's input."""
    return torch.randn(shape, generator=gen).to(dtype)


def assert_takes_the_quantized_kernel(step, args, scales, ref, monkeypatch, reference: str) -> None:
    """`step` (a StepDecode or StepPrefill) runs the C++ kernel over a quantized cache: the
    torch reference it would fall back to (`reference`, a name in kernels.torch_ops) is never
    called, with or without `out`, and the result matches `ref`; a sliding window (which the
    kernels do not take) calls the reference."""
    from kvchat.kernels import torch_ops

    calls = []
    original = getattr(torch_ops, reference)

    def counted(*a, **k):
        calls.append(1)
        return original(*a, **k)

    monkeypatch.setattr(torch_ops, reference, counted)
    assert max_rel_err(step(*args, **scales), ref.double()) <= 1e-5
    assert not calls, "a quantized cache took the torch reference"
    out = torch.empty_like(args[0])
    assert step(*args, **scales, out=out) is out
    assert max_rel_err(out, ref.double()) <= 1e-5
    assert not calls
    step(*args, **scales, sliding_window=12, num_sink_tokens=2)
    assert calls, "a windowed call took the C++ kernel"


@pytest.fixture
def kv() -> ModuleType:
    """This module: the builders above."""
    return sys.modules[__name__]
