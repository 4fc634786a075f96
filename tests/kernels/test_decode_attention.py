"""Triton paged decode attention against its torch reference (run under the interpreter on
CPU). Every case holds a mixed batch with context lengths 1, block_size - 1, block_size,
block_size + 1 and several blocks, in a shuffled block pool.

Error bounds (max_rel_err = max|out - ref| / max|ref|, rel_l2 = ||out - ref|| / ||ref||):
- float32: max_rel_err <= 1e-4 against the float64 reference (measured ~1e-7).
- bf16 query/cache: max_rel_err <= 1.5e-2 against the float64 reference on the same bf16
  values (P and the output are rounded to bf16; measured <= 8e-3, and 9.5e-3 over a
  grouped int4 cache, whose dequantized K/V are rounded to bf16 too).
- int8 / fp8 / int4 caches with a float32 query: max_rel_err <= 1e-4 against the reference
  run in float64 on the same quantized cache (scale caches [num_blocks, block_size,
  num_kv_heads, num_groups]), and against the float64 reference of the unquantized K/V:
  int8 rel_l2 <= 0.03, max_rel_err <= 0.045; fp8 rel_l2 <= 0.15, max_rel_err <= 0.25.
  Those are about twice the worst of 300 random configurations of these builders, measured
  with the reference (int8: 0.016 / 0.022, fp8: 0.082 / 0.129).
  int4 (7 levels a side) is far coarser; from 300 random configurations (head_dim 32, 64,
  80, 128), measured with the reference:
  - head_dim a multiple of 32 (float16 scales per 32 channels): worst rel_l2 0.169,
    max_rel_err 0.354 (median 0.12 / 0.13); bound rel_l2 <= 0.22, max_rel_err <= 0.45.
    Tight enough to fail one scale for all groups (group 0's everywhere: rel_l2 0.27),
    which the comparison on the same stored values catches anyway.
  - otherwise (one scale per vector, head_dim 80): worst 0.317 / 0.533, the next 0.173 /
    0.378; bound rel_l2 <= 0.35, max_rel_err <= 0.6.
  A wrong channel order (swapped nibbles) gives rel_l2 1.36.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kvchat.kernels.decode_attention as decode_module
from kvchat.kernels.decode_attention import (
    DecodeConfig,
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_with_config,
)
from kvchat.kernels.quant import SCALE_GROUP_SIZE

FP32_TOL = 1e-4
BF16_TOL = 1.5e-2
# (rel_l2, max_rel_err) of the quantized result against the unquantized one (see above).
QUANT_VS_FULL = {"int8": (0.03, 0.045), "fp8": (0.15, 0.25), "int4": (0.22, 0.45)}
INT4_ONE_GROUP_VS_FULL = (0.35, 0.6)  # head_dim not a multiple of SCALE_GROUP_SIZE


@dataclass(frozen=True)
class DecodeCase:
    cache: str  # float32 | bfloat16 | int8 | fp8 | int4
    head_dim: int
    group: int  # query heads per KV head
    block_size: int
    window: int | None = None
    sinks: int = 0
    num_splits: int | None = None
    shared_prefix_blocks: int = 0
    drop_outside_window: bool = False
    block_n: int | None = None  # None: the launcher's default tile
    query: str | None = None  # query dtype for quantized caches (default float32)
    num_kv_heads: int = 2

    @property
    def id(self) -> str:
        parts = [self.cache, f"d{self.head_dim}", f"g{self.group}", f"bs{self.block_size}"]
        if self.window is not None:
            parts.append(f"win{self.window}+{self.sinks}")
        if self.num_splits is not None:
            parts.append(f"split{self.num_splits}")
        if self.shared_prefix_blocks:
            parts.append("shared")
        if self.drop_outside_window:
            parts.append("dropped")
        if self.block_n:
            parts.append(f"bn{self.block_n}")
        if self.query:
            parts.append(f"q{self.query}")
        return "-".join(parts)


# A covering set: every head_dim, group, block size, dtype, window/sink and split setting
# appears, pairs of them vary across cases.
CASES = [
    DecodeCase("float32", 64, 1, 16),
    DecodeCase("float32", 80, 4, 32, window=20, num_splits=3),
    DecodeCase("float32", 128, 8, 16, window=40, sinks=4, num_splits=4, block_n=16),
    DecodeCase("float32", 64, 8, 32, num_splits=1, shared_prefix_blocks=2),
    DecodeCase("float32", 128, 4, 16, num_splits=8),  # more splits than key tiles
    DecodeCase("float32", 80, 1, 16, window=16, sinks=3, drop_outside_window=True, num_splits=2),
    DecodeCase("float32", 32, 4, 32, window=50, sinks=1, shared_prefix_blocks=1),
    DecodeCase("bfloat16", 128, 4, 16, num_splits=2),
    DecodeCase("bfloat16", 80, 1, 32, window=40, block_n=32),
    DecodeCase("bfloat16", 64, 8, 32, window=24, sinks=2),
    DecodeCase("int8", 64, 4, 16, num_splits=2, block_n=16),
    DecodeCase("int8", 128, 1, 32, window=33, num_splits=3, shared_prefix_blocks=1),
    DecodeCase("fp8", 80, 8, 16, window=30, sinks=5, num_splits=2, drop_outside_window=True),
    DecodeCase("fp8", 128, 4, 32, block_n=128),
    DecodeCase("fp8", 64, 1, 16),
    DecodeCase("fp8", 64, 4, 16, num_splits=3, query="bfloat16"),
    # int4: two scale groups; four; three, with the head padded to 128 (the padding's
    # group index is past the last group); one per vector (80 is no multiple of 32, the
    # packed head padded); grouped with a bf16 query (dequantized tiles rounded to bf16).
    DecodeCase("int4", 64, 4, 16, num_splits=2, block_n=16),
    DecodeCase("int4", 128, 1, 32, window=33, sinks=2, num_splits=3, shared_prefix_blocks=1),
    DecodeCase("int4", 96, 4, 16, window=30, sinks=5, drop_outside_window=True, num_kv_heads=1),
    DecodeCase("int4", 80, 8, 16, window=24, num_splits=2, num_kv_heads=1),
    DecodeCase("int4", 64, 8, 32, query="bfloat16", num_kv_heads=1),
]


def _lens(case: DecodeCase) -> list[int]:
    bs = case.block_size
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 5 * bs]
    # Sequences 0 and 1 share leading blocks, so they must be the long ones.
    return lens[::-1] if case.shared_prefix_blocks else lens


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_decode_matches_reference(case: DecodeCase, kv) -> None:
    gen = kv.generator(case.id)
    cache_dtype = kv.CACHE_DTYPES[case.cache]
    lens = _lens(case)
    paged = kv.build_paged_kv(
        gen,
        lens,
        case.num_kv_heads,
        case.head_dim,
        case.block_size,
        cache_dtype,
        shared_prefix_blocks=case.shared_prefix_blocks,
    )
    if case.drop_outside_window:
        assert case.window is not None
        dropped = kv.drop_blocks_outside_window(
            paged, [n - 1 for n in lens], case.window, case.sinks
        )
        assert dropped > 0, "the case should free some blocks"
    num_heads = case.num_kv_heads * case.group
    query_dtype = kv.query_dtype_for(cache_dtype, kv.CACHE_DTYPES.get(case.query or ""))
    query = kv.random_query(gen, (len(lens), num_heads, case.head_dim), query_dtype)
    scale = case.head_dim**-0.5
    window = dict(sliding_window=case.window, num_sink_tokens=case.sinks)
    tables = dict(block_tables=paged.block_tables, seq_lens=paged.seq_lens)

    out = torch.full_like(query, float("nan"))  # poison: an unwritten element fails
    if case.block_n is None:
        result = paged_decode_attention(
            query,
            scale=scale,
            out=out,
            num_splits=case.num_splits,
            **tables,
            **paged.storage(),
            **window,
        )
    else:
        config = DecodeConfig(block_n=case.block_n)
        result = paged_decode_attention_with_config(
            query,
            scale=scale,
            config=config,
            out=out,
            num_splits=case.num_splits,
            **tables,
            **paged.storage(),
            **window,
        )
    assert result is out

    ref = paged_decode_attention_ref(
        query.double(), scale=scale, **tables, **paged.storage_f64(), **window
    )
    tol = FP32_TOL if query_dtype == torch.float32 else BF16_TOL
    assert kv.max_rel_err(out, ref) <= tol

    if case.cache in QUANT_VS_FULL:
        full = paged_decode_attention_ref(
            query.double(), scale=scale, **tables, **paged.full_f64(), **window
        )
        l2_bound, max_bound = QUANT_VS_FULL[case.cache]
        if case.cache == "int4" and case.head_dim % SCALE_GROUP_SIZE:
            l2_bound, max_bound = INT4_ONE_GROUP_VS_FULL
        assert kv.rel_l2_err(out, full) <= l2_bound
        assert kv.max_rel_err(out, full) <= max_bound


@pytest.mark.parametrize("cache", ["fp8", "int4"])
@pytest.mark.parametrize("magnitude", [3e4, 1e-6])
def test_decode_quantized_cache_bf16_query_any_magnitude(kv, cache: str, magnitude: float) -> None:
    """Large and tiny bf16 queries over a quantized cache (fp8 codes, or int4 values
    dequantized per group, are converted to the query dtype for the dots): no overflow, no
    loss of accuracy."""
    gen = kv.generator(f"{cache}-bf16-{magnitude}")
    paged = kv.build_paged_kv(gen, [1, 40, 100], 2, 64, 16, kv.CACHE_DTYPES[cache])
    query = (kv.random_query(gen, (3, 8, 64), torch.float32) * magnitude).to(torch.bfloat16)
    out = paged_decode_attention(
        query,
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
        scale=0.125,
        num_splits=2,
        **paged.storage(),
    )
    ref = paged_decode_attention_ref(
        query.double(),
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
        scale=0.125,
        **paged.storage_f64(),
    )
    assert kv.max_rel_err(out, ref) <= BF16_TOL


def test_decode_empty_context_gives_zero_and_others_unaffected(kv) -> None:
    """A padded batch slot (seq_len 0, no blocks) yields 0; the reference has no answer
    (softmax over nothing), so the other rows are compared on their own."""
    gen = kv.generator("empty-context")
    paged = kv.build_paged_kv(gen, [0, 17, 40], 2, 64, 16, torch.float32)
    query = kv.random_query(gen, (3, 4, 64), torch.float32)
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(
        query,
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
        scale=0.125,
        out=out,
        num_splits=2,
        **paged.storage(),
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    ref = paged_decode_attention_ref(
        query[1:].double(),
        block_tables=paged.block_tables[1:],
        seq_lens=paged.seq_lens[1:],
        scale=0.125,
        **paged.storage_f64(),
    )
    assert kv.max_rel_err(out[1:], ref) <= FP32_TOL


def test_decode_empty_batch_returns_out(kv) -> None:
    paged = kv.build_paged_kv(kv.generator("empty-batch"), [5], 1, 64, 16, torch.float32)
    query = torch.empty(0, 2, 64)
    out = paged_decode_attention(
        query,
        block_tables=paged.block_tables[:0],
        seq_lens=paged.seq_lens[:0],
        scale=0.125,
        **paged.storage(),
    )
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "max_keys", "expected"),
    [
        (1, 8, 32768, 64),  # one long sequence: as many splits as allowed
        (32, 8, 4096, 3),  # 256 programs: 3 splits reach 4 waves of 132 SMs
        (256, 8, 512, 1),  # the batch alone fills the device
        (1, 8, 300, 2),  # short context: at least 256 keys per split
        (4, 1, 0, 1),
    ],
)
def test_default_num_splits_fills_the_device(
    monkeypatch: pytest.MonkeyPatch,
    num_seqs: int,
    num_kv_heads: int,
    max_keys: int,
    expected: int,
) -> None:
    monkeypatch.setattr(decode_module, "_sm_count", lambda device: 132)
    got = default_num_splits(num_seqs, num_kv_heads, max_keys, torch.device("cuda"))
    assert got == expected


def _valid_args(kv) -> dict:
    paged = kv.build_paged_kv(kv.generator("valid-args"), [5, 9], 2, 64, 16, torch.float32)
    return dict(
        query=torch.randn(2, 4, 64),
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
        scale=0.125,
        **paged.storage(),
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(query=a["query"][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.update(query=a["query"].double()), "query must be"),
        (lambda a: a.update(query=a["query"][..., :32]), "head_dim"),
        (lambda a: a.update(value_cache=a["value_cache"].half()), "value_cache"),
        (
            lambda a: a.update(
                key_cache=a["key_cache"].half(), value_cache=a["value_cache"].half()
            ),
            "query dtype",
        ),
        (
            lambda a: a.update(
                key_cache=a["key_cache"].to(torch.int8), value_cache=a["value_cache"].to(torch.int8)
            ),
            "scale_cache",
        ),
        (lambda a: a.update(block_tables=a["block_tables"].float()), "block_tables"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "sequences"),
        (lambda a: a.update(sliding_window=0), "sliding_window"),
        (lambda a: a.update(num_splits=0), "num_splits"),
        (lambda a: a.update(out=torch.empty(2, 4, 32)), "out must be"),
    ],
)
def test_decode_rejects_bad_arguments(kv, change, message: str) -> None:
    args = _valid_args(kv)
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)


@pytest.mark.parametrize(
    ("cache", "cut"),
    [
        ("int8", lambda s: s[..., 0]),  # the old per-token layout, no group axis
        ("int4", lambda s: s[..., 0]),
        ("int4", lambda s: s[..., :1].contiguous()),  # one scale per vector, not per group
    ],
    ids=["int8-3d", "int4-3d", "int4-one-group"],
)
def test_decode_rejects_scale_caches_of_another_layout(kv, cache: str, cut) -> None:
    """Scale caches that are not [num_blocks, block_size, num_kv_heads, num_groups] with the
    dtype's groups are refused before the kernel could read them with the wrong strides."""
    gen = kv.generator(f"3d-{cache}")
    paged = kv.build_paged_kv(gen, [5, 9], 2, 64, 16, kv.CACHE_DTYPES[cache])
    args = dict(
        query=torch.randn(2, 4, 64),
        block_tables=paged.block_tables,
        seq_lens=paged.seq_lens,
        scale=0.125,
        **paged.storage(),
    )
    args["key_scale_cache"] = cut(args["key_scale_cache"])
    args["value_scale_cache"] = cut(args["value_scale_cache"])
    with pytest.raises(ValueError, match="num_groups"):
        paged_decode_attention(**args)
