"""Triton cache write against its torch reference (interpreter on CPU).

Bound: the kernel is bit-exact with `write_kv_cache_ref` / `quant.quantize` for every
dtype: codes, scales and copies compare equal bit for bit (0 LSB), including int8 and int4
ties (half to even, like torch.round), fp8 values that round up into the next binade, and
int4's float16 group scales and nibble packing. Each test poisons the whole cache first (NaN;
-128 for int8 and byte 0 for int4, codes the quantizer never produces), then checks written
slots match and every other slot still holds the poison.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvchat.kernels.cache_write import write_kv_cache, write_kv_cache_ref
from kvchat.kernels.quant import (
    FP8_E4M3_MAX,
    INT4_MAX,
    INT8_MAX,
    MIN_SCALE,
    dequantize,
    group_size,
    is_packed,
    is_quantized,
    key_rotation,
    quantize,
    scale_dtype,
)


def _poison_value(dtype: torch.dtype) -> float:
    # Codes the quantizer never writes: int8 stays in [-127, 127]; an int4 byte holds two
    # nibbles in [1, 15], so never 0.
    if dtype == torch.int8:
        return -128.0
    if dtype == torch.uint8:
        return 0.0
    return float("nan")


def _stored_shape(shape: tuple[int, ...], cache_dtype: torch.dtype) -> tuple[int, ...]:
    """[..., head_dim] -> the cache's [..., stored]: head_dim // 2 bytes for int4."""
    return (*shape[:-1], shape[-1] // 2) if is_packed(cache_dtype) else shape


def _scale_shape(shape: tuple[int, ...], cache_dtype: torch.dtype) -> tuple[int, ...]:
    """[..., head_dim] -> the scale cache's [..., num_groups]."""
    return (*shape[:-1], shape[-1] // group_size(cache_dtype, shape[-1]))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaN == NaN and -0.0 != 0.0."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(width[t.element_size()])


@dataclass(frozen=True)
class WriteCase:
    cache: str
    head_dim: int
    num_kv_heads: int
    block_size: int
    key_dtype: str = "float32"  # input dtype for quantized caches

    @property
    def id(self) -> str:
        return (
            f"{self.cache}-d{self.head_dim}-h{self.num_kv_heads}-bs{self.block_size}"
            f"-{self.key_dtype}"
        )


CASES = [
    WriteCase("float32", 64, 2, 16),
    WriteCase("bfloat16", 80, 1, 32, "bfloat16"),
    WriteCase("float16", 128, 3, 16, "float16"),
    WriteCase("int8", 64, 3, 32),
    WriteCase("int8", 80, 2, 16, "bfloat16"),
    WriteCase("int8", 128, 1, 8),
    WriteCase("fp8", 64, 1, 16, "bfloat16"),
    WriteCase("fp8", 80, 3, 64),
    WriteCase("fp8", 128, 2, 32, "float16"),
    WriteCase("fp8", 32, 2, 16),
    WriteCase("int4", 64, 2, 16),
    WriteCase("int4", 96, 3, 32, "bfloat16"),  # 3 groups: the padded tile has a 4th
    WriteCase("int4", 128, 1, 8, "float16"),
    WriteCase("int4", 80, 2, 16),  # not a multiple of 32: one group over the whole head
    WriteCase("int4", 40, 3, 64, "bfloat16"),
]


class _Pool:
    """Poisoned caches (and scale caches) for one case, plus a copy for the reference."""

    def __init__(
        self,
        cache_dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        poison = _poison_value(cache_dtype)
        stored = _stored_shape(shape, cache_dtype)
        self.tensors = [torch.full(stored, poison).to(cache_dtype) for _ in range(2)]
        if is_quantized(cache_dtype):
            groups = _scale_shape(shape, cache_dtype)
            self.tensors += [
                torch.full(groups, float("nan"), dtype=scale_dtype(cache_dtype)) for _ in range(2)
            ]

    def clone(self) -> _Pool:
        other = object.__new__(_Pool)
        other.tensors = [t.clone() for t in self.tensors]
        return other

    def args(self) -> list[torch.Tensor]:
        return self.tensors


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_write_matches_reference_and_leaves_other_slots(case: WriteCase, kv) -> None:
    gen = kv.generator(case.id)
    cache_dtype = kv.CACHE_DTYPES[case.cache]
    key_dtype = kv.CACHE_DTYPES[case.key_dtype] if is_quantized(cache_dtype) else cache_dtype
    num_blocks, num_tokens = 7, 3 * case.block_size + 5
    shape = (num_tokens, case.num_kv_heads, case.head_dim)
    # Magnitudes from 1e-3 to 1e3 per token and head; one all-zero vector (MIN_SCALE).
    magnitude = torch.exp(3.0 * torch.randn(shape[:2] + (1,), generator=gen))
    key = (torch.randn(shape, generator=gen) * magnitude).to(key_dtype)
    value = torch.randn(shape, generator=gen).to(key_dtype)
    key[0, 0] = 0.0
    # Shuffled distinct slots over the pool, some tokens padded with -1.
    slots = torch.randperm(num_blocks * case.block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:4]] = -1

    pool = _Pool(cache_dtype, num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    ref_pool = pool.clone()
    write_kv_cache(key, value, *pool.args()[:2], slots, *pool.args()[2:])
    write_kv_cache_ref(key, value, *ref_pool.args()[:2], slots, *ref_pool.args()[2:])

    written = torch.zeros(num_blocks * case.block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for got, want in zip(pool.args(), ref_pool.args()):
        got_bits = _bits(got).reshape(num_blocks * case.block_size, -1)
        want_bits = _bits(want).reshape(num_blocks * case.block_size, -1)
        assert torch.equal(got_bits[written], want_bits[written])
        poison = _bits(torch.full((1,), _poison_value(got.dtype)).to(got.dtype))
        assert bool((got_bits[~written] == poison).all()), "a slot not in slot_mapping changed"


def test_int8_rounds_half_to_even_like_torch() -> None:
    # amax 127 -> scale 1, so x / scale is x itself: exact ties.
    row = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -2.5, 3.49, 0.0])
    key = torch.nn.functional.pad(row, (0, 6)).view(1, 1, 16)
    cache = torch.full((1, 8, 1, 16), -128, dtype=torch.int8)
    scales = torch.full((1, 8, 1, 1), float("nan"), dtype=torch.float16)
    write_kv_cache(
        key, key.clone(), cache, cache.clone(), torch.tensor([3]), scales, scales.clone()
    )
    expected = torch.tensor([127, 2, -4, 0, 0, 2, 126, -2, 3, 0], dtype=torch.int8)
    assert torch.equal(cache[0, 3, 0, :10], expected)
    assert scales[0, 3, 0, 0].item() == 1.0


def test_int4_rounds_half_to_even_clamps_and_packs_low_nibble_first() -> None:
    # Group 0's amax is 7 -> scale 1 (exact in float16), so x / scale is x: exact ties.
    # Group 1's amax is 0.7 -> scale 0.1 rounded to float16, 0.0999756: 0.7 / scale is just
    # over 7 and must clamp to 7, and 0.25 and 0.05, ties against 0.1 itself, land just past
    # them against the stored scale (2.5006 -> 3, 0.5001 -> 1): the codes divide by the
    # float16 scale, not by amax / 7.
    ties = [7.0, 2.5, -3.5, 0.5, -0.5, 1.5, 6.5, -2.5, 3.49, 0.0, -7.0, 5.5]
    group0 = torch.tensor(ties + [0.0] * 20)
    group1 = torch.zeros(32)
    group1[:4] = torch.tensor([0.7, -0.7, 0.25, 0.05])
    key = torch.cat([group0, group1]).view(1, 1, 64)
    cache = torch.zeros(1, 8, 1, 32, dtype=torch.uint8)
    scales = torch.full((1, 8, 1, 2), float("nan"), dtype=torch.float16)
    write_kv_cache(
        key, key.clone(), cache, cache.clone(), torch.tensor([6]), scales, scales.clone()
    )
    scale1 = torch.tensor(0.1, dtype=torch.float16)
    assert scale1.float().item() < 0.1 and 0.7 / scale1.float().item() > 7
    assert torch.equal(scales[0, 6, 0], torch.stack([torch.tensor(1.0).half(), scale1]))
    expected_codes = [7, 2, -4, 0, 0, 2, 6, -2, 3, 0, -7, 6] + [0] * 20
    expected_codes += [7, -7, 3, 1] + [0] * 28
    nibbles = torch.tensor(expected_codes) + 8
    expected = (nibbles[0::2] | (nibbles[1::2] << 4)).to(torch.uint8)
    assert torch.equal(cache[0, 6, 0], expected)
    assert cache[0, 6, 0, 0].item() == (7 + 8) | ((2 + 8) << 4)  # channel 0 in the low nibble


def test_fp8_rounds_to_nearest_even_like_torch() -> None:
    # amax 448 -> scale 1. Ties and carries into the next binade (1.97 -> 2, 15.9 -> 16),
    # the subnormal range (multiples of 2**-9) and values next to the maximum.
    row = torch.tensor(
        [
            448.0,
            1.0625,
            1.1875,
            17.0,
            1.97,
            15.9,
            2.0**-10,
            3 * 2.0**-10,
            0.0137,
            440.0,
            -433.0,
            0.0,
            -1.97,
            7.5 * 2.0**-9,
            2.0**-6,
            0.9999,
        ]
    )
    key = row.view(1, 1, 16)
    cache = torch.full((1, 8, 1, 16), float("nan")).to(torch.float8_e4m3fn)
    scales = torch.full((1, 8, 1, 1), float("nan"), dtype=torch.float16)
    write_kv_cache(
        key, key.clone(), cache, cache.clone(), torch.tensor([5]), scales, scales.clone()
    )
    expected = row.to(torch.float8_e4m3fn)
    assert torch.equal(_bits(cache[0, 5, 0]), _bits(expected))
    assert cache[0, 5, 0, 4].item() == 2.0 and cache[0, 5, 0, 1].item() == 1.0


@pytest.mark.parametrize("cache", ["int8", "fp8"])
def test_dequantized_values_within_quantization_step(cache: str, kv) -> None:
    """|x - q * scale| <= scale / 2 for int8; for fp8 e4m3, half a unit in the last place:
    2**-4 relative, and 2**-10 * scale in the subnormal range."""
    gen = kv.generator(f"roundtrip-{cache}")
    cache_dtype = kv.CACHE_DTYPES[cache]
    key = torch.randn(40, 2, 64, generator=gen) * torch.exp(
        2 * torch.randn(40, 2, 1, generator=gen)
    )
    caches = [torch.empty(5, 8, 2, 64, dtype=cache_dtype) for _ in range(2)]
    scales = [torch.empty(5, 8, 2, 2, dtype=torch.float16) for _ in range(2)]  # 2 groups of 32
    write_kv_cache(key, key.clone(), caches[0], caches[1], torch.arange(40), *scales)
    codes = caches[0].view(40, 2, 2, 32).float()
    scale = scales[0].view(40, 2, 2, 1).float()
    grouped = key.view(40, 2, 2, 32)
    qmax = INT8_MAX if cache == "int8" else FP8_E4M3_MAX
    expected = (grouped.abs().amax(-1, keepdim=True) / qmax).clamp_min(MIN_SCALE).half()
    torch.testing.assert_close(scale, expected.float(), rtol=0, atol=0)
    key = grouped  # a code clamped where the float16 scale rounded down is off by far less
    err = (codes * scale - key).abs()
    if cache == "int8":
        bound = 0.5 * scale * (1 + 1e-6)
    else:
        bound = torch.maximum(key.abs() * 2.0**-4, 2.0**-10 * scale) * (1 + 1e-6)
    assert bool((err <= bound).all())


@pytest.mark.parametrize("head_dim", [64, 96, 48])
def test_int4_dequantized_values_within_half_a_step(head_dim: int, kv) -> None:
    """|x - dequantize(q, scale)| <= scale / 2 per element of each group (a clamped code is
    off by less: the float16 scale is at most 2**-11 relative below amax / 7), plus float32
    rounding of the division, product and difference. head_dim 48 has one group."""
    gen = kv.generator(f"roundtrip-int4-{head_dim}")
    num_tokens, num_kv_heads = 40, 2
    group = group_size(torch.uint8, head_dim)
    assert group == (head_dim if head_dim % 32 else 32)
    shape = (num_tokens, num_kv_heads, head_dim)
    # Magnitudes vary per group, not only per vector, so the group scales differ.
    magnitude = torch.exp(
        2 * torch.randn(num_tokens, num_kv_heads, head_dim // group, 1, generator=gen)
    )
    key = (torch.randn(*shape[:2], head_dim // group, group, generator=gen) * magnitude).view(shape)
    key[0, 0] = 0.0  # all zero: the smallest float16 normal as the scale
    caches = [torch.empty(5, 8, num_kv_heads, head_dim // 2, dtype=torch.uint8) for _ in range(2)]
    scales = [
        torch.empty(5, 8, num_kv_heads, head_dim // group, dtype=torch.float16) for _ in range(2)
    ]
    write_kv_cache(key, key.clone(), caches[0], caches[1], torch.arange(num_tokens), *scales)
    q = caches[0].view(num_tokens, num_kv_heads, head_dim // 2)
    scale = scales[0].view(num_tokens, num_kv_heads, head_dim // group)
    grouped = key.view(num_tokens, num_kv_heads, head_dim // group, group)
    expected_scale = (grouped.abs().amax(-1) / INT4_MAX).clamp_min(MIN_SCALE).half()
    assert torch.equal(scale, expected_scale)
    assert scale[0, 0].eq(MIN_SCALE).all()
    err = (dequantize(q, scale, torch.float32) - key).abs()
    step = scale.float().repeat_interleave(group, dim=-1)
    assert bool((err <= 0.5 * step + 2.0**-21 * key.abs()).all())


def test_int4_quantize_and_dequantize_keep_the_nibble_order() -> None:
    """quant.quantize puts channel 2j in the low nibble of byte j and 2j + 1 in the high one
    (each as code + 8), and dequantize reads them back in that order: exact for values that
    are whole codes of a scale of 1."""
    codes = torch.tensor([[7, -7, 1, 2, -3, 0, 5, -1] * 4, [-6, 4, 3, -2, 0, 6, -5, 7] * 4])
    x = codes.float().view(2, 1, 32)  # amax 7 in each row: scale 1
    q, scale = quantize(x, torch.uint8)
    assert q.dtype == torch.uint8 and q.shape == (2, 1, 16)
    assert scale.dtype == torch.float16 and torch.equal(scale, torch.ones(2, 1, 1).half())
    nibbles = codes + 8
    assert torch.equal(q.view(2, 16), (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8))
    assert q[0, 0, 0].item() == 0x1F  # channel 0: 7 + 8 in the low nibble; channel 1: -7 + 8
    assert torch.equal(dequantize(q, scale, torch.float32), x)
    # And a hand-made byte: low nibble 15 -> +7 for channel 0, high nibble 9 -> +1 channel 1.
    byte = torch.full((1, 1, 16), 0x9F, dtype=torch.uint8)
    out = dequantize(byte, torch.full((1, 1, 1), 2.0, dtype=torch.float16), torch.float32)
    assert torch.equal(out.view(32)[:2], torch.tensor([14.0, 2.0]))


def test_strided_inputs_from_a_fused_qkv_tensor(kv) -> None:
    """key/value as views into one [tokens, (H + 2 * Hkv) * D] projection output."""
    gen = kv.generator("strided")
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 4, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.randperm(32, generator=gen)[:num_tokens]
    for dtype in (torch.float32, torch.int8, torch.uint8):
        shape = (4, 8, num_kv_heads, head_dim)
        got = [torch.zeros(_stored_shape(shape, dtype)).to(dtype) for _ in range(2)]
        want = [t.clone() for t in got]
        extra = []
        if is_quantized(dtype):
            extra = [
                torch.zeros(_scale_shape(shape, dtype), dtype=scale_dtype(dtype)) for _ in "kv"
            ]
        extra_ref = [t.clone() for t in extra]
        write_kv_cache(key, value, *got, slots, *extra)
        write_kv_cache_ref(key, value, *want, slots, *extra_ref)
        for a, b in zip(got + extra, want + extra_ref):
            assert torch.equal(a, b)


def test_no_tokens_and_all_padding_write_nothing() -> None:
    cache = torch.full((2, 16, 1, 64), float("nan"))
    write_kv_cache(
        torch.empty(0, 1, 64),
        torch.empty(0, 1, 64),
        cache,
        cache.clone(),
        torch.empty(0, dtype=torch.int64),
    )
    key = torch.randn(3, 1, 64)
    write_kv_cache(key, key, cache, cache.clone(), torch.full((3,), -1, dtype=torch.int64))
    assert bool(cache.isnan().all())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(key=a["key"][:, :, :32]), "key must be"),
        (lambda a: a.update(value=a["value"].half()), "key and value"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"][:2]), "slot_mapping"),
        (
            lambda a: a.update(
                key_cache=a["key_cache"].half(), value_cache=a["value_cache"].half()
            ),
            "unquantized",
        ),
        (
            lambda a: a.update(
                key_cache=a["key_cache"].to(torch.int8), value_cache=a["value_cache"].to(torch.int8)
            ),
            "scale_cache",
        ),
        (lambda a: a.update(value_cache=a["value_cache"][:1]), "value_cache"),
        # An int4 cache's last dim is head_dim // 2: a 64-wide uint8 cache holds head_dim 128.
        (
            lambda a: a.update(
                key_cache=a["key_cache"].to(torch.uint8),
                value_cache=a["value_cache"].to(torch.uint8),
                key_scale_cache=torch.zeros(2, 16, 2, 4, dtype=torch.float16),
                value_scale_cache=torch.zeros(2, 16, 2, 4, dtype=torch.float16),
            ),
            "key must be",
        ),
        # int4 scales are float16 groups of 32 channels, not int8's one float32 per vector.
        (
            lambda a: a.update(
                key_cache=torch.zeros(2, 16, 2, 32, dtype=torch.uint8),
                value_cache=torch.zeros(2, 16, 2, 32, dtype=torch.uint8),
                key_scale_cache=torch.zeros(2, 16, 2, 1),
                value_scale_cache=torch.zeros(2, 16, 2, 1),
            ),
            "key_scale_cache must be",
        ),
    ],
)
def test_write_rejects_bad_arguments(change, message: str) -> None:
    args = dict(
        key=torch.randn(3, 2, 64),
        value=torch.randn(3, 2, 64),
        key_cache=torch.zeros(2, 16, 2, 64),
        value_cache=torch.zeros(2, 16, 2, 64),
        slot_mapping=torch.tensor([0, 5, 17]),
    )
    change(args)
    with pytest.raises(ValueError, match=message):
        write_kv_cache(**args)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_the_key_rotation_is_orthogonal_fixed_and_spreads_an_outlier(head_dim: int) -> None:
    r = key_rotation(head_dim)
    assert r is not None and r.shape == (head_dim, head_dim) and r.dtype == torch.float32
    torch.testing.assert_close(r @ r.T, torch.eye(head_dim), rtol=0, atol=1e-6)
    assert torch.equal(r, key_rotation(head_dim))  # the stored format: the same every time
    assert torch.equal(r.abs(), torch.full_like(r, head_dim**-0.5))
    # A key whose one channel dwarfs the rest comes out with every channel alike.
    k = torch.zeros(head_dim)
    k[3] = 10.0
    assert torch.allclose((k @ r).abs(), torch.full((head_dim,), 10.0 * head_dim**-0.5))
    # q·k is kept.
    q, k = torch.randn(2, head_dim, generator=torch.Generator().manual_seed(1))
    assert torch.allclose((q @ r) @ (k @ r), q @ k, atol=1e-5)


def test_no_key_rotation_where_head_dim_is_not_a_power_of_two() -> None:
    assert key_rotation(80) is None and key_rotation(96) is None
