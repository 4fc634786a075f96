"""kvchat's C++ layer ops (kernels/cpu_layer_ops.cpp) against the torch path they replace:
RoPE on q and k with the KV cache write (padding slots skipped), and silu(gate) * up, in
float32, bfloat16 and float16, rounding as torch rounds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvchat.inference.model.model import silu_mul
from kvchat.inference.model.rope import apply_rotary
from kvchat.kernels.cache_write import write_kv_cache_ref
from kvchat.kernels.cpu_ops import load_cpu_ops
from kvchat.kernels.torch_ops import rotary_cache_write_cpu

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="needs a C++ compiler")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim", [(1, 4, 2, 64), (5, 6, 2, 32), (17, 2, 1, 128), (3, 8, 8, 16)]
)
def test_rotary_cache_write_matches_the_torch_path(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    g = torch.Generator().manual_seed(tokens * 100 + heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=g) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    ssin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    num_blocks, block_size = 8, 4
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    if tokens > 2:
        slots[1] = -1  # a padding token: computed for q, never cached
    caches = [
        torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(4)
    ]
    q = rotary_cache_write_cpu(qkv, cos, ssin, caches[0], caches[1], slots, heads, kv_heads)
    assert q is not None and q.shape == (tokens, heads, head_dim)
    # the torch path
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim), cos, ssin)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    write_kv_cache_ref(qk[:, heads:], v, caches[2], caches[3], slots)
    t = tol(dtype)
    torch.testing.assert_close(q.float(), qk[:, :heads].float(), rtol=t, atol=t)
    torch.testing.assert_close(caches[0].float(), caches[2].float(), rtol=t, atol=t)
    assert torch.equal(caches[1], caches[3])  # v is copied, not computed
    if tokens > 2:
        written = (caches[0].view(num_blocks * block_size, -1) != 0).any(1).sum().item()
        assert written == tokens - 1


def test_rotary_cache_write_declines_a_quantized_cache() -> None:
    qkv = torch.randn(1, 4 * 16)
    cache = torch.zeros(2, 4, 1, 16, dtype=torch.int8)
    scales = torch.zeros(2, 4, 1, 1)
    t = torch.ones(1, 1, 16)
    assert rotary_cache_write_cpu(qkv, t, t, cache, cache, torch.tensor([0]), 2, 1, scales) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 16, 300])
def test_silu_mul_matches_torch(dtype: torch.dtype, rows: int) -> None:
    gate_up = (torch.randn(rows, 2 * 96, generator=torch.Generator().manual_seed(rows)) * 4).to(
        dtype
    )
    gate, up = gate_up.chunk(2, dim=-1)
    t = tol(dtype)
    torch.testing.assert_close(
        silu_mul(gate_up).float(), (F.silu(gate) * up).float(), rtol=t, atol=t
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_over_chunks_tails_and_large_gates(dtype: torch.dtype) -> None:
    """A model's width (4096 + 5: whole chunks, whole vectors and a scalar tail), gates far
    out on both sides (the sigmoid's exp taken at -|x|), zeros and exact values."""
    width = 4096 + 5
    g = torch.Generator().manual_seed(7)
    gate = torch.randn(2, width, generator=g) * 6
    gate[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 100.0, -100.0, 1.0, -1.0])
    up = torch.randn(2, width, generator=g)
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    t = tol(dtype)
    got = silu_mul(gate_up)
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).float(), rtol=t, atol=t)
    assert got[0, :2].float().eq(0).all() and got[0, 5].float().abs() < 1e-30
