"""kvchat's C++ paged decode attention (kernels/cpu_decode_attention.cpp) against the torch
reference, on the same shuffled block pools the Triton kernel is checked on: contexts of 1,
block_size - 1, block_size, block_size + 1 and several blocks, shared prefix blocks, every GQA
group, float32 / bfloat16 / float16 caches, on the vector path (AVX-512 or AVX2, where the
machine has one) and on the plain loop; the quantized twin (decode_attention_quantized) on
int8 / fp8 / int4 caches, their scale layouts and every code of each format; and through
StepDecode, which takes the kernels only where they apply (full attention)."""

from __future__ import annotations

import pytest
import torch

from kvchat.kernels.cpu_ops import load_cpu_ops
from kvchat.kernels.decode_attention import paged_decode_attention_ref
from kvchat.kernels.quant import dequantize
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


# -- quantized caches --------------------------------------------------------------------------

QUANT_CASES = [  # (cache dtype, head_dim, group, block_size, query dtype)
    (torch.int8, 64, 3, 16, torch.float32),
    (torch.int8, 128, 4, 16, torch.bfloat16),
    (torch.int8, 32, 1, 8, torch.float16),
    (torch.int8, 96, 2, 16, torch.float32),
    (torch.float8_e4m3fn, 64, 1, 16, torch.float32),
    (torch.float8_e4m3fn, 80, 2, 32, torch.bfloat16),
    (torch.float8_e4m3fn, 128, 8, 16, torch.float32),
    (torch.uint8, 64, 3, 16, torch.float32),  # int4: two groups of 32 channels
    (torch.uint8, 128, 4, 32, torch.float32),  # four groups
    (torch.uint8, 80, 2, 16, torch.float32),  # one group (80 is no multiple of 32)
    (torch.uint8, 64, 8, 8, torch.bfloat16),
    (torch.uint8, 48, 2, 16, torch.float32),  # an odd number of AVX-512 vectors
    (torch.uint8, 40, 2, 16, torch.float32),  # of AVX2 vectors (AVX-512: the plain loop)
]
QUANT_NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.uint8: "int4"}


def quant_id(case: tuple) -> str:
    cache, head_dim, group, block_size, qdtype = case
    return f"{QUANT_NAMES[cache]}-d{head_dim}-g{group}-bs{block_size}-{str(qdtype)[6:]}"


def run_quantized(query, storage, paged, scale, vectorized=True) -> torch.Tensor:
    out = torch.full_like(query, float("nan"))  # poison: an unwritten element fails
    torch.ops.kvchat_cpu.decode_attention_quantized(
        query,
        storage["key_cache"],
        storage["value_cache"],
        storage["key_scale_cache"],
        storage["value_scale_cache"],
        paged.block_tables,
        paged.seq_lens,
        scale,
        out,
        vectorized,
    )
    return out


@pytest.mark.parametrize("vectorized", [True, False], ids=["vector", "plain"])
@pytest.mark.parametrize("case", QUANT_CASES, ids=quant_id)
def test_quantized_kernel_matches_reference(case: tuple, vectorized: bool, kv) -> None:
    cache_dtype, head_dim, group, block_size, qdtype = case
    gen = kv.generator(f"quant-{quant_id(case)}")
    lens = lens_for(block_size, 1)[:-1] + [9 * block_size + 3]  # shared prefix, shuffled pool
    num_kv_heads = 2
    paged = kv.build_paged_kv(
        gen, lens, num_kv_heads, head_dim, block_size, cache_dtype, shared_prefix_blocks=1
    )
    query = kv.random_query(gen, (len(lens), num_kv_heads * group, head_dim), qdtype)
    scale = head_dim**-0.5
    storage = paged.storage()
    out = run_quantized(query, storage, paged, scale, vectorized)
    # the reference on the same codes and scales, dequantized in float64
    ref = paged_decode_attention_ref(
        query.double(),
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
        scale=scale,
        **paged.storage_f64(),
    )
    tol = FP32_TOL if qdtype == torch.float32 else HALF_TOL
    assert kv.max_rel_err(out, ref) <= tol
    # and what the engine ran before (the reference in float32): the same result
    same = paged_decode_attention_ref(
        query, block_tables=paged.block_tables, seq_lens=paged.seq_lens, scale=scale, **storage
    )
    assert kv.max_rel_err(out, same.double()) <= tol


@pytest.mark.parametrize("vectorized", [True, False], ids=["vector", "plain"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("num_groups", [1, 2, 4, 8])
@pytest.mark.parametrize("cache_dtype", list(QUANT_NAMES), ids=QUANT_NAMES.get)
def test_quantized_kernel_takes_any_scale_layout(
    cache_dtype: torch.dtype, num_groups: int, scale_dtype: torch.dtype, vectorized: bool, kv
) -> None:
    """Scales of either dtype, in any number of groups dividing head_dim: one per row (folded
    into the scores), groups of whole vectors (64 / 2, 64 / 4 on AVX-512), and groups smaller
    than a vector (64 / 8 on AVX-512: a per-channel scale row)."""
    case_id = f"layout-{QUANT_NAMES[cache_dtype]}-{num_groups}-{scale_dtype}"
    gen = kv.generator(case_id)
    lens = [70, 33, 1]
    paged = kv.build_paged_kv(gen, lens, 2, 64, 16, cache_dtype)
    shape = (*paged.key_cache.shape[:3], num_groups)
    storage = paged.storage()
    for name in ("key_scale_cache", "value_scale_cache"):  # random scales, 0.01 to 0.1
        storage[name] = (0.01 + 0.09 * torch.rand(shape, generator=gen)).to(scale_dtype)
    query = kv.random_query(gen, (len(lens), 6, 64), torch.float32)
    out = run_quantized(query, storage, paged, 0.125, vectorized)
    f64 = dict(storage)
    for name in ("key_scale_cache", "value_scale_cache"):
        f64[name] = storage[name].double()
    ref = paged_decode_attention_ref(
        query.double(), block_tables=paged.block_tables, seq_lens=paged.seq_lens, scale=0.125, **f64
    )
    assert kv.max_rel_err(out, ref) <= FP32_TOL


@pytest.mark.parametrize("vectorized", [True, False], ids=["vector", "plain"])
@pytest.mark.parametrize("cache_dtype", list(QUANT_NAMES), ids=QUANT_NAMES.get)
def test_quantized_kernel_decodes_every_code_exactly(
    cache_dtype: torch.dtype, vectorized: bool
) -> None:
    """Every byte of the format (fp8: but its NaNs, 0x7F and 0xFF, which a cache never holds;
    its subnormals and both zeros included) as V rows of one-token contexts with scale 1: the
    softmax weight is exactly 1, so the output is the decoded row, bit for bit."""
    head_dim = 64
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if cache_dtype == torch.float8_e4m3fn:
        codes[codes & 0x7F == 0x7F] = 0
    stored = head_dim // 2 if cache_dtype == torch.uint8 else head_dim
    rows = codes.view(-1, 1, 1, stored).view(cache_dtype)  # [blocks, block_size 1, 1, stored]
    num_blocks = rows.shape[0]
    scales = torch.ones(num_blocks, 1, 1, 2, dtype=torch.float16)  # two groups of 32
    query = torch.randn(num_blocks, 3, head_dim)
    out = torch.full_like(query, float("nan"))
    torch.ops.kvchat_cpu.decode_attention_quantized(
        query,
        torch.zeros_like(rows),
        rows,
        scales,
        scales,
        torch.arange(num_blocks, dtype=torch.int32)[:, None],
        torch.ones(num_blocks, dtype=torch.int32),
        0.125,
        out,
        vectorized,
    )
    expected = dequantize(rows, scales, torch.float32).view(num_blocks, 1, head_dim)
    assert torch.equal(out, expected.expand_as(out))


@pytest.mark.parametrize("cache_dtype", list(QUANT_NAMES), ids=QUANT_NAMES.get)
def test_step_decode_takes_the_quantized_kernel(cache_dtype: torch.dtype, kv, monkeypatch) -> None:
    """StepDecode runs the C++ kernel over a quantized cache (the reference is never called)
    and still takes the reference for a sliding window."""
    gen = kv.generator(f"step-{QUANT_NAMES[cache_dtype]}")
    lens = [5, 40, 17]
    paged = kv.build_paged_kv(gen, lens, 2, 64, 16, cache_dtype)
    query = kv.random_query(gen, (3, 4, 64), torch.float32)
    args = (query, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, 0.125)
    scales = dict(key_scale_cache=paged.key_scale_cache, value_scale_cache=paged.value_scale_cache)
    ref = paged_decode_attention_ref(*args, **scales)

    kv.assert_takes_the_quantized_kernel(
        StepDecode(), args, scales, ref, monkeypatch, "paged_decode_attention_gathered"
    )
    slow = StepDecode(use_cpu_kernel=False)
    assert kv.max_rel_err(slow(*args, **scales), ref.double()) == 0.0


def test_quantized_kernel_checks_its_arguments(kv) -> None:
    gen = kv.generator("quant-checks")
    paged = kv.build_paged_kv(gen, [4], 2, 64, 16, torch.int8)
    query = kv.random_query(gen, (1, 4, 64), torch.float32)
    storage = paged.storage()
    with pytest.raises(RuntimeError, match="quantized cache is int8"):
        plain = kv.build_paged_kv(gen, [4], 2, 64, 16, torch.float32).storage()
        run_quantized(
            query, {**storage, **{k: plain[k] for k in ("key_cache", "value_cache")}}, paged, 0.125
        )
    with pytest.raises(RuntimeError, match="scale groups divide head_dim"):
        bad = torch.ones(*paged.key_cache.shape[:3], 3)
        run_quantized(
            query, {**storage, "key_scale_cache": bad, "value_scale_cache": bad}, paged, 0.125
        )
    with pytest.raises(RuntimeError, match="not the query's"):
        run_quantized(kv.random_query(gen, (1, 4, 32), torch.float32), storage, paged, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        run_quantized(kv.random_query(gen, (1, 3, 64), torch.float32), storage, paged, 0.125)
