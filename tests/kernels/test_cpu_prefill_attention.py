"""kvchat's C++ paged prefill attention (kernels/cpu_prefill_attention.cpp) against the
float64 reference, on shuffled block pools: whole prompts (causal only), chunks over a cached
prefix, one new token, lengths on and off the kernel's tiles (32 new tokens, 32 or 64 keys)
and the cache's blocks, several sequences in one call, every GQA group, float32 / bfloat16 /
float16 caches; scores far apart (most exponentials underflow); and through StepPrefill,
which takes the kernel only where it applies (full attention). Its quantized twin
(prefill_attention_quantized: int8, fp8 and packed int4 caches, any scale grouping) against
the same reference on the stored codes and scales."""

from __future__ import annotations

import pytest
import torch

from kvchat.kernels.cpu_ops import load_cpu_ops
from kvchat.kernels.prefill_attention import paged_prefill_attention_ref
from kvchat.kernels.torch_ops import StepPrefill

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="needs a C++ compiler")

FP32_TOL = 1e-5
HALF_TOL = 1.5e-2
CASES = [  # (cache dtype, head_dim, group, block_size)
    (torch.float32, 64, 1, 16),
    (torch.float32, 128, 4, 32),
    (torch.float32, 32, 3, 8),
    (torch.bfloat16, 64, 3, 16),
    (torch.float16, 64, 2, 16),
]
# (context length, new tokens): a whole prompt, a chunk over a prefix, one token, tile edges
SEQS = [(1, 1), (37, 37), (200, 200), (130, 70), (65, 1), (97, 33), (64, 64), (300, 31)]


def supported(head_dim: int) -> bool:
    return bool(torch.ops.kvchat_cpu.prefill_attention_supported(head_dim))


def run_case(kv, case_id: str, dtype, head_dim, group, block_size, seqs, query_scale=1.0):
    gen = kv.generator(case_id)
    lens = [length for length, _ in seqs]
    q_lens = [new for _, new in seqs]
    num_kv_heads = 2
    paged = kv.build_paged_kv(gen, lens, num_kv_heads, head_dim, block_size, dtype)
    query = kv.random_query(gen, (sum(q_lens), num_kv_heads * group, head_dim), dtype)
    query = (query.float() * query_scale).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    storage = paged.storage()
    out = torch.full_like(query, float("nan"))  # poison: an unwritten element fails
    torch.ops.kvchat_cpu.prefill_attention(
        query,
        storage["key_cache"],
        storage["value_cache"],
        paged.block_tables,
        paged.seq_lens,
        starts,
        scale,
        out,
    )
    batch = dict(block_tables=paged.block_tables, seq_lens=paged.seq_lens, query_start_loc=starts)
    ref = paged_prefill_attention_ref(query.double(), scale=scale, **batch, **paged.storage_f64())
    return out, ref, (query, storage, batch, scale)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-g{c[2]}-bs{c[3]}")
def test_cpu_kernel_matches_reference(case, kv) -> None:
    dtype, head_dim, group, block_size = case
    if not supported(head_dim):
        pytest.skip(f"this build's vector width does not divide head_dim {head_dim}")
    out, ref, (query, storage, batch, scale) = run_case(
        kv, str(case), dtype, head_dim, group, block_size, SEQS
    )
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL
    assert kv.max_rel_err(out, ref) <= tol
    # and torch's flash path on the cache's own values (what the engine ran before): the same
    same = paged_prefill_attention_ref(query, scale=scale, **batch, **storage)
    assert kv.max_rel_err(out, same.double()) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("query_scale", [1.0, 40.0], ids=["plain", "peaked"])
def test_long_chunks_and_peaked_scores(query_scale: float, dtype, kv) -> None:
    """A long prompt's chunks (many tiles each way) and scores so far apart that most
    exponentials underflow: the online softmax must keep the peak across key tiles and let no
    underflowed weight add up."""
    if not supported(64):
        pytest.skip("no vector path on this machine")
    seqs = [(700, 512), (1100, 100), (513, 513)]
    out, ref, (query, storage, batch, scale) = run_case(
        kv, f"long-{query_scale}", dtype, 64, 3, 16, seqs, query_scale
    )
    # Peaked scores are in the hundreds, where float32 keeps them to ~1e-5 absolute, and the
    # softmax turns that into relative error: no float32 kernel does better than torch's own.
    # bfloat16 caches: the products are exact, the probabilities rounded to bfloat16 for P V
    # (as torch's flash kernel does), the output to bfloat16.
    flash = paged_prefill_attention_ref(query, scale=scale, **batch, **storage)
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL
    err, flash_err = kv.max_rel_err(out, ref), kv.max_rel_err(flash.double(), ref)
    print(f"kernel {err:.3g}, torch's flash {flash_err:.3g}")
    assert err <= max(tol, 1.5 * flash_err)


def test_step_prefill_takes_the_kernel_only_where_it_applies(kv) -> None:
    if not supported(64):
        pytest.skip("no vector path on this machine")
    out, _, (query, storage, batch, scale) = run_case(
        kv, "step", torch.float32, 64, 2, 16, [(40, 40), (90, 20)]
    )
    args = (
        query,
        storage["key_cache"],
        storage["value_cache"],
        batch["block_tables"],
        batch["seq_lens"],
        batch["query_start_loc"],
        scale,
    )
    fast, slow = StepPrefill(), StepPrefill(use_cpu_kernel=False)
    assert torch.equal(fast(*args), out)  # the kernel's own result: it took the kernel
    assert kv.max_rel_err(out, slow(*args).double()) <= FP32_TOL
    window = dict(sliding_window=12, num_sink_tokens=2)
    windowed = fast(*args, **window)
    assert kv.max_rel_err(windowed, slow(*args, **window).double()) <= FP32_TOL
    # a sliding window changes the answer, so the windowed call really took the reference path
    assert not torch.allclose(windowed, out)


def test_cpu_kernel_checks_its_arguments(kv) -> None:
    gen = kv.generator("checks")
    paged = kv.build_paged_kv(gen, [4], 2, 64, 16, torch.float32)
    storage = paged.storage()
    query = kv.random_query(gen, (4, 4, 64), torch.float32)
    starts = torch.tensor([0, 4], dtype=torch.int32)

    def call(q, starts=starts, lens=paged.seq_lens):
        torch.ops.kvchat_cpu.prefill_attention(
            q,
            storage["key_cache"],
            storage["value_cache"],
            paged.block_tables,
            lens,
            starts,
            0.125,
            torch.empty_like(q),
        )

    with pytest.raises(RuntimeError, match="share a dtype"):
        call(query.bfloat16())
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        call(kv.random_query(gen, (4, 3, 64), torch.float32))
    with pytest.raises(RuntimeError, match="more new tokens than its length"):
        call(query, lens=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="num_seqs \\+ 1"):
        call(query, starts=torch.tensor([0, 2, 4], dtype=torch.int32))


# -- quantized caches --------------------------------------------------------------------------

QUANT_CASES = [  # (cache dtype, head_dim, group, block_size, query dtype)
    (torch.int8, 64, 3, 16, torch.float32),
    (torch.int8, 128, 4, 32, torch.bfloat16),
    (torch.int8, 32, 1, 8, torch.float16),
    (torch.float8_e4m3fn, 64, 1, 16, torch.float32),
    (torch.float8_e4m3fn, 64, 3, 16, torch.bfloat16),
    (torch.float8_e4m3fn, 128, 8, 16, torch.float32),
    (torch.uint8, 64, 3, 16, torch.float32),  # int4: two groups of 32 channels
    (torch.uint8, 128, 4, 32, torch.float32),  # four groups
    (torch.uint8, 64, 2, 8, torch.bfloat16),
    (torch.uint8, 32, 2, 16, torch.float16),  # one group, one AVX-512 vector of 16 bytes' halves
]
QUANT_NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.uint8: "int4"}


def quant_id(case: tuple) -> str:
    cache, head_dim, group, block_size, qdtype = case
    return f"{QUANT_NAMES[cache]}-d{head_dim}-g{group}-bs{block_size}-{str(qdtype)[6:]}"


def run_quantized(query, storage, batch, scale) -> torch.Tensor:
    out = torch.full_like(query, float("nan"))  # poison: an unwritten element fails
    torch.ops.kvchat_cpu.prefill_attention_quantized(
        query,
        storage["key_cache"],
        storage["value_cache"],
        storage["key_scale_cache"],
        storage["value_scale_cache"],
        batch["block_tables"],
        batch["seq_lens"],
        batch["query_start_loc"],
        scale,
        out,
    )
    return out


def quantized_case(kv, case_id: str, cache_dtype, head_dim, group, block_size, qdtype, seqs):
    gen = kv.generator(case_id)
    lens = [length for length, _ in seqs]
    q_lens = [new for _, new in seqs]
    num_kv_heads = 2
    paged = kv.build_paged_kv(gen, lens, num_kv_heads, head_dim, block_size, cache_dtype)
    query = kv.random_query(gen, (sum(q_lens), num_kv_heads * group, head_dim), qdtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    batch = dict(block_tables=paged.block_tables, seq_lens=paged.seq_lens, query_start_loc=starts)
    return paged, query, batch


@pytest.mark.parametrize("case", QUANT_CASES, ids=quant_id)
def test_quantized_kernel_matches_reference(case: tuple, kv) -> None:
    head_dim, qdtype = case[1], case[4]
    if not torch.ops.kvchat_cpu.prefill_attention_quantized_supported(head_dim):
        pytest.skip(f"this build's vector width does not divide head_dim {head_dim}")
    paged, query, batch = quantized_case(kv, f"quant-{quant_id(case)}", *case, SEQS)
    scale = head_dim**-0.5
    storage = paged.storage()
    out = run_quantized(query, storage, batch, scale)
    # the reference on the same codes and scales, dequantized in float64
    ref = paged_prefill_attention_ref(query.double(), scale=scale, **batch, **paged.storage_f64())
    tol = FP32_TOL if qdtype == torch.float32 else HALF_TOL
    assert kv.max_rel_err(out, ref) <= tol
    # and what the engine ran before (the reference, dequantizing through torch): the same
    same = paged_prefill_attention_ref(query, scale=scale, **batch, **storage)
    assert kv.max_rel_err(out, same.double()) <= tol


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("num_groups", [1, 2, 4, 8])
@pytest.mark.parametrize("cache_dtype", list(QUANT_NAMES), ids=QUANT_NAMES.get)
def test_quantized_kernel_takes_any_scale_layout(
    cache_dtype: torch.dtype, num_groups: int, scale_dtype: torch.dtype, kv
) -> None:
    """Scales of either dtype, in any number of groups dividing head_dim: one per row, groups
    of whole vectors (64 / 2, 64 / 4 on AVX-512) and groups smaller than a vector (64 / 8 on
    AVX-512: a per-channel scale row)."""
    case_id = f"layout-{QUANT_NAMES[cache_dtype]}-{num_groups}-{scale_dtype}"
    seqs = [(70, 70), (100, 33), (5, 1)]
    paged, query, batch = quantized_case(kv, case_id, cache_dtype, 64, 3, 16, torch.float32, seqs)
    shape = (*paged.key_cache.shape[:3], num_groups)
    gen = kv.generator(case_id + "-scales")
    storage = paged.storage()
    for name in ("key_scale_cache", "value_scale_cache"):  # random scales, 0.01 to 0.1
        storage[name] = (0.01 + 0.09 * torch.rand(shape, generator=gen)).to(scale_dtype)
    out = run_quantized(query, storage, batch, 0.125)
    f64 = dict(storage)
    for name in ("key_scale_cache", "value_scale_cache"):
        f64[name] = storage[name].double()
    ref = paged_prefill_attention_ref(query.double(), scale=0.125, **batch, **f64)
    assert kv.max_rel_err(out, ref) <= FP32_TOL


@pytest.mark.parametrize("cache_dtype", list(QUANT_NAMES), ids=QUANT_NAMES.get)
def test_step_prefill_takes_the_quantized_kernel(cache_dtype: torch.dtype, kv, monkeypatch) -> None:
    """StepPrefill runs the C++ kernel over a quantized cache (the reference is never called)
    and still takes the reference for a sliding window."""
    paged, query, batch = quantized_case(
        kv,
        f"step-{QUANT_NAMES[cache_dtype]}",
        cache_dtype,
        64,
        2,
        16,
        torch.float32,
        [(40, 40), (90, 20)],
    )
    args = (
        query,
        paged.key_cache,
        paged.value_cache,
        batch["block_tables"],
        batch["seq_lens"],
        batch["query_start_loc"],
        0.125,
    )
    scales = dict(key_scale_cache=paged.key_scale_cache, value_scale_cache=paged.value_scale_cache)
    ref = paged_prefill_attention_ref(*args, **scales)

    kv.assert_takes_the_quantized_kernel(
        StepPrefill(), args, scales, ref, monkeypatch, "paged_prefill_attention_ref"
    )


def test_quantized_kernel_checks_its_arguments(kv) -> None:
    paged, query, batch = quantized_case(
        kv, "quant-checks", torch.int8, 64, 2, 16, torch.float32, [(4, 4)]
    )
    storage = paged.storage()
    with pytest.raises(RuntimeError, match="quantized cache is int8"):
        plain = kv.build_paged_kv(kv.generator("plain"), [4], 2, 64, 16, torch.float32).storage()
        run_quantized(
            query, {**storage, **{k: plain[k] for k in ("key_cache", "value_cache")}}, batch, 0.125
        )
    with pytest.raises(RuntimeError, match="scale groups divide head_dim"):
        bad = torch.ones(*paged.key_cache.shape[:3], 3)
        run_quantized(
            query, {**storage, "key_scale_cache": bad, "value_scale_cache": bad}, batch, 1.0
        )
    with pytest.raises(RuntimeError, match="not the query's"):
        run_quantized(query[..., :32].contiguous(), storage, batch, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        run_quantized(query[:, :3].contiguous(), storage, batch, 0.125)
    with pytest.raises(RuntimeError, match="more new tokens than its length"):
        short = dict(batch, seq_lens=torch.tensor([3], dtype=torch.int32))
        run_quantized(query, storage, short, 0.125)
