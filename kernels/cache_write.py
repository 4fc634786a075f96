"""Cache write: scatter the new tokens' K and V into their slots of the paged block pool.

Layout (shared by every kernel in this package; `kernels.quant` defines the formats):
    key_cache, value_cache:             [num_blocks, block_size, num_kv_heads, head_dim],
                                        or [.., head_dim // 2] uint8 for int4 (two codes a
                                        byte: channel 2j in the low nibble, 2j + 1 high)
    key_scale_cache, value_scale_cache: [num_blocks, block_size, num_kv_heads, num_groups]
                                        float16 (only for quantized caches), groups of
                                        SCALE_GROUP_SIZE channels (one group if head_dim is
                                        not a multiple)
    slot_mapping:                       [num_tokens] int64, block_id * block_size + offset;
                                        -1 marks a token that is not written (padding).

The Triton kernel quantizes exactly as `quant.quantize` does, bit for bit:
scale = max(amax / QMAX, min_scale) and x / scale with IEEE division (`div_rn`), int8 and
int4 codes rounded half to even like torch's `round()` (`_rint`), fp8 e4m3 encoded with
round-to-nearest-even by integer arithmetic on the float32 bits and stored through a uint8
view. (Triton 3.9's interpreter drops the carry when an fp32 -> fp8 cast rounds up into the
next binade, 1.97 -> 1.0; the integer encoding is exact both there and compiled.) The amax is
taken per group, the scale rounded to float16 (round to nearest even in both the interpreter
and compiled code) and x divided by that rounded value, as the reference does; int4 then
packs channel pairs into bytes. Bit-exact with the torch reference on the CPU; on CUDA, torch
divides by the Python scalar QMAX as a multiplication by its reciprocal, so the reference's
scales there can differ in the last bit (and a code by one step); bench/gpu_kernels.py checks
the kernel bit-exact against amax / QMAX with IEEE division and within one quantization step
of the CUDA reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_common import check_cache_pair
from .quant import cache_head_dim, is_quantized, min_scale, quant_max, quantize


def write_kv_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale_cache: torch.Tensor | None = None,
    value_scale_cache: torch.Tensor | None = None,
) -> None:
    """Torch reference (and CPU path) of the cache write; quantizes on the way in."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    write_kv_slots_ref(
        key, value, key_cache, value_cache, slots, key_scale_cache, value_scale_cache
    )


def write_kv_slots_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [num_tokens] int64, no padding
    key_scale_cache: torch.Tensor | None = None,
    value_scale_cache: torch.Tensor | None = None,
) -> None:
    """`write_kv_cache_ref` once padding tokens are dropped."""
    _, _, num_kv_heads, stored = key_cache.shape
    flat_k = key_cache.view(-1, num_kv_heads, stored)
    flat_v = value_cache.view(-1, num_kv_heads, stored)
    if is_quantized(key_cache.dtype):
        assert key_scale_cache is not None and value_scale_cache is not None
        qk, sk = quantize(key, key_cache.dtype)
        qv, sv = quantize(value, value_cache.dtype)
        flat_k[slots] = qk
        flat_v[slots] = qv
        num_groups = key_scale_cache.shape[-1]
        key_scale_cache.view(-1, num_kv_heads, num_groups)[slots] = sk
        value_scale_cache.view(-1, num_kv_heads, num_groups)[slots] = sv
    else:
        flat_k[slots] = key if key.dtype == key_cache.dtype else key.to(key_cache.dtype)
        flat_v[slots] = value if value.dtype == value_cache.dtype else value.to(value_cache.dtype)


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Quantization modes of the kernel (a compile-time constant).
_QUANT_NONE, _QUANT_INT8, _QUANT_FP8, _QUANT_INT4 = 0, 1, 2, 3


@triton.jit
def _rint(x):
    """Round float32 to the nearest integer, ties to even (torch.round). Exact: x - floor(x)
    is exact for |x| < 2**23."""
    f = tl.floor(x)
    frac = x - f
    is_odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & is_odd)
    return f + up.to(tl.float32)


@triton.jit
def _fp32_to_e4m3_bits(x):
    """float32 with |x| <= 448 -> float8_e4m3fn bit pattern (uint8), round to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    mag = bits & 0x7FFFFFFF
    # Normal range (|x| >= 2**-6): keep 3 of 23 mantissa bits with round-half-even (a carry
    # runs into the exponent), then rebias the exponent from 127 to 7: 120 << 3.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals are multiples of 2**-9; 8 * 2**-9 rounds up to the smallest normal, 0x08.
    subnormal = _rint(tl.abs(x) * 512.0).to(tl.int32)
    code = tl.where(mag < 0x3C800000, subnormal, normal)  # 0x3C800000 = 2**-6
    return (sign | code).to(tl.uint8)


@triton.jit
def _quantize_store(
    x,  # [NUM_KV_HEADS_PAD, HEAD_DIM_PAD] float32, zero where masked
    cache_ptr,  # this token's slot: element (head h, stored channel c) at h * stride_ch + c
    scale_ptr,  # this token's scales: (head h, group g) at h * stride_sh + g
    offs_h,
    mask_h,
    stride_ch,
    stride_sh,
    NUM_KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    NUM_GROUPS_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE_: tl.constexpr,
):
    offs_g = tl.arange(0, NUM_GROUPS_PAD)
    mask_g = mask_h[:, None] & (offs_g < NUM_GROUPS)[None, :]
    scale_ptrs = scale_ptr + offs_h[:, None] * stride_sh + offs_g[None, :]
    # One scale per group of GROUP_PAD channels (NUM_GROUPS_PAD * GROUP_PAD == HEAD_DIM_PAD;
    # with one group it spans the padding too, which holds zeros and so leaves the amax
    # alone). The view is [heads, groups, channels of the group].
    x3 = tl.reshape(x, [NUM_KV_HEADS_PAD, NUM_GROUPS_PAD, GROUP_PAD])
    amax = tl.max(tl.abs(x3), axis=2)  # [NUM_KV_HEADS_PAD, NUM_GROUPS_PAD]
    # The scale is stored as float16, and the codes divide by that stored value (as
    # quant.quantize does), so round it before dividing. MIN_SCALE_ is a float16 normal:
    # clamping before or after the rounding gives the same.
    scale16 = tl.maximum(tl.math.div_rn(amax, QMAX), MIN_SCALE_).to(tl.float16)
    scaled = tl.math.div_rn(x3, scale16.to(tl.float32)[:, :, None])
    scaled = tl.minimum(tl.maximum(scaled, -QMAX), QMAX)
    scaled = tl.reshape(scaled, [NUM_KV_HEADS_PAD, HEAD_DIM_PAD])
    if QUANT == 3:
        nibbles = (_rint(scaled) + 8.0).to(tl.int32)  # code + 8, in [1, 15]
        # Channel 2j goes to the low nibble of byte j, channel 2j + 1 to the high one:
        # split the (row-major) channel axis into pairs.
        pairs = tl.reshape(nibbles, [NUM_KV_HEADS_PAD, HEAD_DIM_PAD // 2, 2])
        low, high = tl.split(pairs)
        packed = (low | (high << 4)).to(tl.uint8)  # [NUM_KV_HEADS_PAD, HEAD_DIM_PAD // 2]
        offs_p = tl.arange(0, HEAD_DIM_PAD // 2)
        mask_p = mask_h[:, None] & (offs_p < HEAD_DIM // 2)[None, :]
        tl.store(cache_ptr + offs_h[:, None] * stride_ch + offs_p[None, :], packed, mask=mask_p)
    else:
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
        cache_ptrs = cache_ptr + offs_h[:, None] * stride_ch + offs_d[None, :]
        if QUANT == 1:
            tl.store(cache_ptrs, _rint(scaled).to(tl.int8), mask=mask)
        else:
            tl.store(cache_ptrs, _fp32_to_e4m3_bits(scaled), mask=mask)
    tl.store(scale_ptrs, scale16, mask=mask_g)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, stored]; uint8 view for fp8
    value_cache_ptr,
    key_scale_ptr,  # [num_blocks, block_size, num_kv_heads, num_groups] (quantized only)
    value_scale_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    stride_kt,
    stride_kh,  # key; head_dim stride is 1
    stride_vt,
    stride_vh,  # value
    stride_cb,
    stride_ct,
    stride_ch,  # both caches (same strides), stored-channel stride is 1
    stride_sb,
    stride_st,
    stride_sh,  # both scale caches, group stride is 1
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    NUM_GROUPS_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE_: tl.constexpr,
):
    # One program per token: a [kv_heads, head_dim] tile of K and of V.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, NUM_KV_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_h = offs_h < NUM_KV_HEADS
    mask = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]

    src = token.to(tl.int64)
    k = tl.load(
        key_ptr + src * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        value_ptr + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    slot_base = block * stride_cb + offset * stride_ct
    if QUANT == 0:  # same dtype: a plain copy
        dst = slot_base + offs_h[:, None] * stride_ch + offs_d[None, :]
        tl.store(key_cache_ptr + dst, k, mask=mask)
        tl.store(value_cache_ptr + dst, v, mask=mask)
    else:
        scale_base = block * stride_sb + offset * stride_st
        _quantize_store(
            k.to(tl.float32),
            key_cache_ptr + slot_base,
            key_scale_ptr + scale_base,
            offs_h,
            mask_h,
            stride_ch,
            stride_sh,
            NUM_KV_HEADS_PAD,
            HEAD_DIM,
            HEAD_DIM_PAD,
            NUM_GROUPS,
            NUM_GROUPS_PAD,
            GROUP_PAD,
            QUANT,
            QMAX,
            MIN_SCALE_,
        )
        _quantize_store(
            v.to(tl.float32),
            value_cache_ptr + slot_base,
            value_scale_ptr + scale_base,
            offs_h,
            mask_h,
            stride_ch,
            stride_sh,
            NUM_KV_HEADS_PAD,
            HEAD_DIM,
            HEAD_DIM_PAD,
            NUM_GROUPS,
            NUM_GROUPS_PAD,
            GROUP_PAD,
            QUANT,
            QMAX,
            MIN_SCALE_,
        )


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale_cache: torch.Tensor | None = None,
    value_scale_cache: torch.Tensor | None = None,
) -> None:
    """Triton cache write (same contract as `write_kv_cache_ref`)."""
    _check_cache_write_args(
        key, value, key_cache, value_cache, slot_mapping, key_scale_cache, value_scale_cache
    )
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, _ = key_cache.shape
    head_dim = cache_head_dim(key_cache)
    head_dim_pad = triton.next_power_of_2(head_dim)
    num_groups = num_groups_pad = 1
    group_pad = head_dim_pad
    if is_quantized(key_cache.dtype):
        assert key_scale_cache is not None and value_scale_cache is not None
        quant = {torch.int8: _QUANT_INT8, torch.float8_e4m3fn: _QUANT_FP8}.get(
            key_cache.dtype, _QUANT_INT4
        )
        qmax, floor = quant_max(key_cache.dtype), min_scale(key_cache.dtype)
        k_dst, v_dst = key_cache, value_cache
        if quant == _QUANT_FP8:  # fp8 bits are computed in the kernel and stored as bytes
            k_dst, v_dst = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        k_scale, v_scale = key_scale_cache, value_scale_cache
        scale_strides = key_scale_cache.stride()[:3]  # the group stride is 1 (checked)
        num_groups = key_scale_cache.shape[-1]
        if num_groups > 1:
            # The kernel views the padded head as [groups, group] tiles, so the group must be
            # a power of two (then it divides head_dim_pad too). check_cache_pair has held
            # multi-group scales to SCALE_GROUP_SIZE channels.
            group_pad = head_dim // num_groups
            assert group_pad & (group_pad - 1) == 0, f"group size {group_pad}"
            num_groups_pad = head_dim_pad // group_pad
    else:
        quant, qmax, floor = _QUANT_NONE, 1.0, 0.0
        k_dst, v_dst = key_cache, value_cache
        k_scale, v_scale = key_cache, value_cache  # unused placeholders
        scale_strides = (0, 0, 0)
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_dst,
        v_dst,
        k_scale,
        v_scale,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        *scale_strides,
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        NUM_GROUPS=num_groups,
        NUM_GROUPS_PAD=num_groups_pad,
        GROUP_PAD=group_pad,
        BLOCK_SIZE=block_size,
        QUANT=quant,
        QMAX=qmax,
        MIN_SCALE_=floor,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def _check_cache_write_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale_cache: torch.Tensor | None,
    value_scale_cache: torch.Tensor | None,
) -> None:
    devices = check_cache_pair(key_cache, value_cache, key_scale_cache, value_scale_cache)
    _, block_size, num_kv_heads, _ = key_cache.shape
    # A packed (int4) cache stores head_dim // 2 bytes per vector.
    expected = (key.shape[0], num_kv_heads, cache_head_dim(key_cache))
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != expected:
            raise ValueError(
                f"{name} must be [num_tokens, num_kv_heads, head_dim] = "
                f"{expected}, got {tuple(t.shape)}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous head_dim, got strides {t.stride()}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (
        torch.int64,
        torch.int32,
    ):
        raise ValueError(
            f"slot_mapping must be [num_tokens] = [{key.shape[0]}] int64, got "
            f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    devices |= {t.device for t in (key, value, slot_mapping)}
    if key.dtype not in _FLOAT_DTYPES or value.dtype != key.dtype:
        raise ValueError(
            f"key and value must be float16, bfloat16 or float32, got {key.dtype}, {value.dtype}"
        )
    if not is_quantized(key_cache.dtype) and key_cache.dtype != key.dtype:
        # An unquantized cache holds the model dtype (kv_cache_dtype "auto"); the copy does
        # not convert.
        raise ValueError(
            f"an unquantized {key_cache.dtype} cache needs {key_cache.dtype} key/value, got "
            f"{key.dtype}"
        )
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
