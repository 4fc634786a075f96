"""Triton paged prefill / extend attention against its torch reference (interpreter on CPU).

Every case is one launch over a mixed batch of (context, new tokens) pairs: a fresh single
token, a prefill of block_size - 1 tokens, 3 new tokens after a one-block prefix,
block_size + 1 fresh tokens, 2 blocks of new tokens after a 1-block-plus prefix, one new
token after 5 blocks, and a sequence with no new tokens; block ids are shuffled and, in
some cases, shared between two sequences' prefixes.

Quantized caches come from the conftest builders in kernels.quant's layout: scale caches
[num_blocks, block_size, num_kv_heads, num_groups]; int4 packs two codes per byte with a
float16 scale per 32 channels (two groups at head_dim 64, four at 128) or per head where
head_dim does not divide by 32 (80: one group, the kernel's per-vector scale path).

Error bounds (see test_decode_attention.py for the measures): float32 max_rel_err <= 1e-4
vs float64; bf16 <= 1.5e-2; int8 / fp8 / int4 with a float32 query <= 1e-4 vs the float64
reference on the same quantized cache, and vs the unquantized float64 reference int8
rel_l2 <= 0.03, max_rel_err <= 0.045, fp8 rel_l2 <= 0.15, max_rel_err <= 0.25 (worst of 120
random configurations of these builders: int8 0.011 / 0.026, fp8 0.040 / 0.097), int4
rel_l2 <= 0.22, max_rel_err <= 0.8: the worst of 320 random configurations (head_dim 32,
64, 80, 128, head groups 1-8, windows) was 0.173 / 0.568, both at head_dim 80, where one
scale spans 80 channels; rel_l2 stays in 0.12-0.17, while the stored int4 values read with
the wrong group's scale score >= 0.26 and with swapped nibbles >= 1.35, so the rel_l2 bound
separates them (max_rel_err does not: it is a sanity bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvchat.kernels.prefill_attention import (
    PrefillConfig,
    causal_attention_cpu,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    paged_prefill_attention_with_config,
)

FP32_TOL = 1e-4
BF16_TOL = 1.5e-2
# (rel_l2, max_rel_err) vs the unquantized float64 reference; measured in the docstring
QUANT_VS_FULL = {"int8": (0.03, 0.045), "fp8": (0.15, 0.25), "int4": (0.22, 0.8)}


@dataclass(frozen=True)
class PrefillCase:
    cache: str
    head_dim: int
    group: int
    block_size: int
    window: int | None = None
    sinks: int = 0
    shared_prefix_blocks: int = 0
    drop_outside_window: bool = False
    block_m: int | None = None  # None: the launcher's default config
    block_n: int | None = None
    query: str | None = None
    num_kv_heads: int = 2

    @property
    def id(self) -> str:
        parts = [self.cache, f"d{self.head_dim}", f"g{self.group}", f"bs{self.block_size}"]
        if self.window is not None:
            parts.append(f"win{self.window}+{self.sinks}")
        if self.shared_prefix_blocks:
            parts.append("shared")
        if self.drop_outside_window:
            parts.append("dropped")
        if self.block_m:
            parts.append(f"bm{self.block_m}-bn{self.block_n}")
        if self.query:
            parts.append(f"q{self.query}")
        return "-".join(parts)


CASES = [
    PrefillCase("float32", 64, 1, 16),
    PrefillCase("float32", 80, 4, 32, window=20),
    PrefillCase("float32", 128, 8, 16, window=40, sinks=4, block_m=16, block_n=16),
    PrefillCase("float32", 64, 8, 32, shared_prefix_blocks=1, block_m=32, block_n=64),
    PrefillCase("float32", 80, 1, 16, window=16, sinks=3, drop_outside_window=True),
    PrefillCase("float32", 32, 4, 16, window=50, sinks=1, shared_prefix_blocks=1),
    PrefillCase("bfloat16", 128, 4, 32, block_m=32, block_n=32),
    PrefillCase("bfloat16", 64, 8, 16, window=24, sinks=2),
    PrefillCase("int8", 64, 4, 16, block_m=16, block_n=16),
    PrefillCase("int8", 128, 1, 32, window=33, shared_prefix_blocks=1),
    PrefillCase("fp8", 80, 8, 16, window=30, sinks=5, drop_outside_window=True),
    PrefillCase("fp8", 128, 4, 32),
    PrefillCase("fp8", 64, 4, 16, query="bfloat16"),
    PrefillCase("int4", 64, 4, 16, block_m=16, block_n=16),  # two scale groups
    PrefillCase("int4", 128, 1, 32, window=33, shared_prefix_blocks=1),  # four
    PrefillCase("int4", 80, 2, 16, window=30, sinks=5, drop_outside_window=True),  # one
    PrefillCase("int4", 64, 8, 16, query="bfloat16"),
]


def _batch(case: PrefillCase) -> tuple[list[int], list[int]]:
    """(seq_lens, new-token counts) of the batch."""
    bs = case.block_size
    pairs = [
        (1, 1),
        (bs - 1, bs - 1),
        (bs, 3),
        (bs + 1, bs + 1),
        (3 * bs + 5, 2 * bs),
        (5 * bs, 1),
        (2 * bs, 0),
    ]
    if case.shared_prefix_blocks:  # sequences 0 and 1 need cached prefixes to share
        pairs = [pairs[4], pairs[5]] + pairs[:4] + pairs[6:]
    return [n for n, _ in pairs], [q for _, q in pairs]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_prefill_matches_reference(case: PrefillCase, kv) -> None:
    gen = kv.generator(case.id)
    cache_dtype = kv.CACHE_DTYPES[case.cache]
    seq_lens, q_lens = _batch(case)
    paged = kv.build_paged_kv(
        gen,
        seq_lens,
        case.num_kv_heads,
        case.head_dim,
        case.block_size,
        cache_dtype,
        shared_prefix_blocks=case.shared_prefix_blocks,
    )
    if case.drop_outside_window:
        assert case.window is not None
        first_pos = [n - q for n, q in zip(seq_lens, q_lens)]
        assert kv.drop_blocks_outside_window(paged, first_pos, case.window, case.sinks) > 0
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    num_heads = case.num_kv_heads * case.group
    query_dtype = kv.query_dtype_for(cache_dtype, kv.CACHE_DTYPES.get(case.query or ""))
    query = kv.random_query(gen, (sum(q_lens), num_heads, case.head_dim), query_dtype)
    scale = case.head_dim**-0.5
    window = dict(sliding_window=case.window, num_sink_tokens=case.sinks)
    batch = dict(
        block_tables=paged.block_tables, seq_lens=paged.seq_lens, query_start_loc=query_start_loc
    )

    out = torch.full_like(query, float("nan"))
    if case.block_m is None:
        result = paged_prefill_attention(
            query, scale=scale, out=out, **batch, **paged.storage(), **window
        )
    else:
        assert case.block_n is not None
        config = PrefillConfig(block_m=case.block_m, block_n=case.block_n)
        result = paged_prefill_attention_with_config(
            query, scale=scale, config=config, out=out, **batch, **paged.storage(), **window
        )
    assert result is out

    ref = paged_prefill_attention_ref(
        query.double(), scale=scale, **batch, **paged.storage_f64(), **window
    )
    tol = FP32_TOL if query_dtype == torch.float32 else BF16_TOL
    assert kv.max_rel_err(out, ref) <= tol

    if case.cache in QUANT_VS_FULL:
        full = paged_prefill_attention_ref(
            query.double(), scale=scale, **batch, **paged.full_f64(), **window
        )
        l2_bound, max_bound = QUANT_VS_FULL[case.cache]
        assert kv.rel_l2_err(out, full) <= l2_bound
        assert kv.max_rel_err(out, full) <= max_bound


def test_prefill_long_prompt_spans_many_query_tiles(kv) -> None:
    """One sequence whose new tokens need many query tiles and key tiles (causal diagonal
    inside a tile, several tiles per row), next to a short one."""
    gen = kv.generator("long-prompt")
    paged = kv.build_paged_kv(gen, [150, 7], 1, 64, 16, torch.float32)  # 150 and 3 new
    query_start_loc = torch.tensor([0, 150, 153], dtype=torch.int32)
    query = kv.random_query(gen, (153, 2, 64), torch.float32)
    out = torch.full_like(query, float("nan"))
    batch = dict(
        block_tables=paged.block_tables, seq_lens=paged.seq_lens, query_start_loc=query_start_loc
    )
    paged_prefill_attention_with_config(
        query, scale=0.125, config=PrefillConfig(32, 32), out=out, **batch, **paged.storage()
    )
    ref = paged_prefill_attention_ref(query.double(), scale=0.125, **batch, **paged.storage_f64())
    assert kv.max_rel_err(out, ref) <= FP32_TOL


def test_prefill_no_new_tokens_is_a_no_op(kv) -> None:
    paged = kv.build_paged_kv(kv.generator("no-tokens"), [5, 9], 1, 64, 16, torch.float32)
    query = torch.empty(0, 1, 64)
    out = paged_prefill_attention(
        query,
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
        query_start_loc=torch.zeros(3, dtype=torch.int32),
        scale=0.125,
        **paged.storage(),
    )
    assert out.shape == (0, 1, 64)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(query_start_loc=a["query_start_loc"][:2]), "query_start_loc"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"].float()), "query_start_loc"),
        (lambda a: a.update(num_sink_tokens=-1), "num_sink_tokens"),
        (lambda a: a.update(query=a["query"].transpose(1, 2)), "contiguous head_dim"),
    ],
)
def test_prefill_rejects_bad_arguments(kv, change, message: str) -> None:
    paged = kv.build_paged_kv(kv.generator("bad-args"), [5, 9], 2, 64, 16, torch.float32)
    args = dict(
        query=torch.randn(14, 4, 64),
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
        query_start_loc=torch.tensor([0, 5, 14], dtype=torch.int32),
        scale=0.125,
        **paged.storage(),
    )
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(**args)


@pytest.mark.parametrize("cache", ["int8", "int4"])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        # The 3-d scale cache of the layout before groups: one scale per vector, no group dim.
        (lambda s: s[..., 0], "key_scale_cache must be"),
        (lambda s: s.float() if s.dtype == torch.float16 else s.half(), "key_scale_cache must be"),
        (lambda s: s.transpose(0, 3).contiguous().transpose(0, 3), "contiguous groups"),
    ],
    ids=["3d", "dtype", "group-stride"],
)
def test_prefill_rejects_bad_scale_caches(kv, cache: str, change, message: str) -> None:
    """Scale caches must be [num_blocks, block_size, num_kv_heads, num_groups] in the
    cache dtype's scale dtype with contiguous groups (the kernel assumes group stride 1)."""
    paged = kv.build_paged_kv(kv.generator("bad-scales"), [5, 9], 2, 64, 16, kv.CACHE_DTYPES[cache])
    assert paged.key_scale_cache is not None and paged.value_scale_cache is not None
    args = dict(
        query=torch.randn(14, 4, 64),
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
        query_start_loc=torch.tensor([0, 5, 14], dtype=torch.int32),
        scale=0.125,
        **paged.storage(),
    )
    args.update(
        key_scale_cache=change(paged.key_scale_cache),
        value_scale_cache=change(paged.value_scale_cache),
    )
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(**args)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention written out in float64 with an explicit bottom-right causal mask:
    query i (of Q, the last Q of L positions) sees keys 0 .. L - Q + i."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    num_new, total = q.shape[2], k.shape[2]
    scores = (q.double() @ k.transpose(-1, -2)) * scale  # [1, H, Q, L]
    query_pos = torch.arange(total - num_new, total).view(-1, 1)
    scores = scores.masked_fill(torch.arange(total).view(1, -1) > query_pos, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize(
    ("num_new", "total", "heads", "kv_heads", "dtype"),
    [
        (7, 7, 4, 4, torch.float32),  # a whole prompt: the square causal block alone
        (5, 40, 6, 2, torch.float32),  # a later chunk after 35 cached tokens, head groups
        (33, 100, 9, 3, torch.float32),
        (1, 16, 3, 1, torch.float32),  # one new token over a long past
        (64, 200, 9, 3, torch.bfloat16),
    ],
)
def test_causal_attention_cpu_merges_the_past_and_the_chunk_exactly(
    num_new: int, total: int, heads: int, kv_heads: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(num_new * 1000 + total)
    q = torch.randn(1, heads, num_new, 64, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, total, 64, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, total, 64, generator=g).to(dtype)
    out = causal_attention_cpu(q, k, v, 0.125)
    ref = masked_attention(q, k, v, 0.125)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max().item() <= tol * ref.abs().max().item()
