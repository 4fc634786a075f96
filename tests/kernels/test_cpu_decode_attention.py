"""kvchat's C++ paged decode attention (kernels/cpu_decode_attention.cpp) against the torch
reference, on the same shuffled block pools the Triton kernel is checked on: contexts of 1,
block_size - 1, block_size, block_size + 1 and several blocks, shared prefix blocks, every GQA
group, float32 / bfloat16 / float16 caches, on the vector path (AVX-512 or AVX2, where the
machine has one) and on the plain loop; and through StepDecode, which takes the kernel
only where it applies (full attention over a plain cache)."""

from __future__ import annotations

import pytest
import torch

from kvchat.kernels.cpu_ops import load_cpu_ops
from kvchat.kernels.decode_attention import paged_decode_attention_ref
from kvchat.kernels.torch_ops import StepDecode

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="needs a C++ compiler")

FP32_TOL = 1e-5
HALF_TOL = 1.5e-2
CASES = [  # (cache dtype, head_dim, group, block_size, shared prefix blocks)
    (torch.float32, 64, 1, 16, 0),
    (torch.float32, 80, 4, 32, 1),
    (torch.float32, 128, 8, 16, 2),
    (torch.float32, 32, 3, 8, 0),
    (torch.bfloat16, 64, 3, 16, 0),
    (torch.bfloat16, 128, 4, 32, 1),
    (torch.float16, 64, 2, 16, 0),
]


def lens_for(block_size: int, shared: int) -> list[int]:
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 5 * block_size]
    return lens[::-1] if shared else lens  # sequences 0 and 1 share leading blocks


@pytest.mark.parametrize("vectorized", [True, False], ids=["vector", "plain"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-g{c[2]}-bs{c[3]}-s{c[4]}")
def test_cpu_kernel_matches_reference(
    case: tuple[torch.dtype, int, int, int, int], vectorized: bool, kv
) -> None:
    dtype, head_dim, group, block_size, shared = case
    gen = kv.generator(str(case))
    lens = lens_for(block_size, shared)
    num_kv_heads = 2
    paged = kv.build_paged_kv(
        gen, lens, num_kv_heads, head_dim, block_size, dtype, shared_prefix_blocks=shared
    )
    query = kv.random_query(gen, (len(lens), num_kv_heads * group, head_dim), dtype)
    scale = head_dim**-0.5
    storage = paged.storage()
    out = torch.full_like(query, float("nan"))  # poison: an unwritten element fails
    torch.ops.kvchat_cpu.decode_attention(
        query,
        storage["key_cache"],
        storage["value_cache"],
        paged.block_tables,
        paged.seq_lens,
        scale,
        out,
        vectorized,
    )
    ref = paged_decode_attention_ref(
        query.double(),
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
        scale=scale,
        **paged.storage_f64(),
    )
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL
    assert kv.max_rel_err(out, ref) <= tol
    # and the reference on the cache's own values (what the engine ran before): same result
    same = paged_decode_attention_ref(
        query, block_tables=paged.block_tables, seq_lens=paged.seq_lens, scale=scale, **storage
    )
    assert kv.max_rel_err(out, same.double()) <= tol


@pytest.mark.parametrize("query_scale", [1.0, 40.0], ids=["plain", "peaked"])
def test_vector_path_on_long_contexts_and_peaked_scores(query_scale: float, kv) -> None:
    """Contexts of many vector widths with a tail, and scores so far apart (query x 40) that
    most of the softmax's exponentials underflow: the vector exp must neither lose the peak nor
    let the underflowed weights add up."""
    gen = kv.generator(f"long-{query_scale}")
    lens = [1000, 517, 33]
    paged = kv.build_paged_kv(gen, lens, 2, 64, 16, torch.float32)
    query = kv.random_query(gen, (len(lens), 6, 64), torch.float32) * query_scale
    storage = paged.storage()
    out = torch.full_like(query, float("nan"))
    torch.ops.kvchat_cpu.decode_attention(
        query,
        storage["key_cache"],
        storage["value_cache"],
        paged.block_tables,
        paged.seq_lens,
        0.125,
        out,
    )
    ref = paged_decode_attention_ref(
        query.double(),
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
        scale=0.125,
        **paged.storage_f64(),
    )
    assert kv.max_rel_err(out, ref) <= FP32_TOL


def test_step_decode_takes_the_kernel_only_where_it_applies(kv) -> None:
    gen = kv.generator("step")
    lens = [5, 40, 17]
    paged = kv.build_paged_kv(gen, lens, 2, 64, 16, torch.float32)
    query = kv.random_query(gen, (3, 4, 64), torch.float32)
    storage = paged.storage()
    args = (
        query,
        storage["key_cache"],
        storage["value_cache"],
        paged.block_tables,
        paged.seq_lens,
        0.125,
    )
    fast, slow = StepDecode(), StepDecode(use_cpu_kernel=False)
    for window in (dict(), dict(sliding_window=12, num_sink_tokens=2)):
        a = fast(*args, **window)
        b = slow(*args, **window)
        assert kv.max_rel_err(a, b.double()) <= FP32_TOL
    # a sliding window changes the answer, so the windowed call really took the reference path
    full = slow(*args)
    windowed = slow(*args, sliding_window=12, num_sink_tokens=2)
    assert not torch.allclose(full[1], windowed[1])


def test_cpu_kernel_checks_its_arguments(kv) -> None:
    gen = kv.generator("checks")
    paged = kv.build_paged_kv(gen, [4], 2, 64, 16, torch.float32)
    storage = paged.storage()
    query = kv.random_query(gen, (1, 4, 64), torch.float32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.kvchat_cpu.decode_attention(
            query.bfloat16(),
            storage["key_cache"],
            storage["value_cache"],
            paged.block_tables,
            paged.seq_lens,
            0.125,
            torch.empty_like(query),
        )
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        q3 = kv.random_query(gen, (1, 3, 64), torch.float32)
        torch.ops.kvchat_cpu.decode_attention(
            q3,
            storage["key_cache"],
            storage["value_cache"],
            paged.block_tables,
            paged.seq_lens,
            0.125,
            torch.empty_like(q3),
        )
