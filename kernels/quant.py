"""KV-cache element types: how a cache dtype name maps to storage, and the quantization.

Quantized caches store scales next to the values, x ≈ q * scale: one float16 scale per group
of SCALE_GROUP_SIZE (32) channels of each (token, kv head) vector (the whole vector when
head_dim is not a multiple of 32), scale = amax(|x|) / QMAX over the group, as llama.cpp's
q8_0 and q4_0 blocks are:

    int8  int8 codes in [-127, 127]: 1.0625 bytes a channel, 0.53x a bfloat16 cache;
    fp8   float8_e4m3fn values, the same bytes;
    int4  codes in [-7, 7], two per byte (channel 2j in the low nibble, 2j + 1 in the high,
          each stored as code + 8): 0.5625 bytes a channel, 0.28x a bfloat16 cache.

At head_dim 64 two float16 scales take the bytes one float32 scale per vector took, and on
real keys they keep more: on SmolLM2-135M-Instruct int8's KL against the unquantized cache
went from 1.6e-4 to 1.2e-4 (bench/kv_quality.py).

The scale cache is [num_blocks, block_size, num_kv_heads, num_groups]; a kernel reads the
group size from it (head_dim // num_groups) and the head_dim from the value cache (twice its
last dim when packed).

Keys are stored rotated (`key_rotation`): real models' keys carry a few outlier channels, and
one scale per vector then leaves the other channels a few codes each. An orthogonal matrix
spreads the outliers over every channel before quantization; the queries are turned by the
same matrix, so q·k, and attention, are unchanged up to the quantization (QuaRot's idea, done
after RoPE: a rotation that mixes channels does not commute with RoPE's). On
SmolLM2-135M-Instruct this takes int8's KL from 5.1e-4 to 1.7e-4 (bench/kv_quality.py).
"""

from __future__ import annotations

import sys

import torch

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
INT4_MAX = 7.0
INT4_OFFSET = 8  # a stored nibble is code + 8, in [1, 15]
SCALE_GROUP_SIZE = 32  # channels per scale (memory.kv_spec counts the bytes)
SCALE_DTYPE = torch.float16
# Smallest scale we store, float16's smallest normal: keeps an all-zero group from dividing
# by zero.
MIN_SCALE = 2.0**-14


# The quantized `kv_cache_dtype` settings (memory.kv_spec.KV_CACHE_DTYPES names them all).
# int4 is stored packed in uint8.
QUANTIZED_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}


KEY_ROTATION_SEED = 0  # part of the stored format: the KV store's fingerprint names it


def key_rotation(head_dim: int) -> torch.Tensor | None:
    """The orthogonal [head_dim, head_dim] float32 matrix quantized caches turn keys (and
    queries) by, k' = k @ R: a Hadamard matrix with random row signs, scaled by
    1/sqrt(head_dim). None when head_dim is not a power of two (keys are stored unturned)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        return None
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    generator = torch.Generator().manual_seed(KEY_ROTATION_SEED)
    signs = torch.randint(0, 2, (head_dim,), generator=generator).float() * 2 - 1
    return signs[:, None] * h / head_dim**0.5


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache tensors for a `kv_cache_dtype` setting (`auto`: the
    model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in QUANTIZED_STORAGE:
        return QUANTIZED_STORAGE[kv_cache_dtype]
    raise ValueError(
        f"kv_cache_dtype must be auto or one of {', '.join(QUANTIZED_STORAGE)}, "
        f"got {kv_cache_dtype!r}"
    )


def is_quantized(cache_dtype: torch.dtype) -> bool:
    return cache_dtype in (torch.int8, torch.float8_e4m3fn, torch.uint8)


def is_packed(cache_dtype: torch.dtype) -> bool:
    """int4: two codes per stored byte."""
    return cache_dtype == torch.uint8


def quant_max(cache_dtype: torch.dtype) -> float:
    if cache_dtype == torch.int8:
        return INT8_MAX
    if cache_dtype == torch.float8_e4m3fn:
        return FP8_E4M3_MAX
    if cache_dtype == torch.uint8:
        return INT4_MAX
    raise ValueError(f"{cache_dtype} is not a quantized cache dtype")


def scale_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """The scale cache's element type (the same for every quantized dtype)."""
    assert is_quantized(cache_dtype)
    return SCALE_DTYPE


def min_scale(cache_dtype: torch.dtype) -> float:
    assert is_quantized(cache_dtype)
    return MIN_SCALE


def group_size(cache_dtype: torch.dtype, head_dim: int) -> int:
    """Channels per scale: SCALE_GROUP_SIZE where head_dim divides by it, else the whole
    head (the same for every quantized dtype)."""
    assert is_quantized(cache_dtype)
    return SCALE_GROUP_SIZE if head_dim % SCALE_GROUP_SIZE == 0 else head_dim


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head_dim a [num_blocks, block_size, num_kv_heads, stored] cache holds."""
    return cache.shape[-1] * (2 if is_packed(cache.dtype) else 1)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_tokens, num_kv_heads, head_dim] -> (q: [num_tokens, num_kv_heads, head_dim]
    in cache_dtype, or [.., head_dim // 2] uint8 for int4; scale: [num_tokens, num_kv_heads,
    num_groups] float16). Codes are x divided by the scale as stored (rounded to float16
    first), int codes rounded half to even."""
    qmax = quant_max(cache_dtype)
    t, h, d = x.shape
    g = group_size(cache_dtype, d)
    x32 = x.float().view(t, h, d // g, g)
    scale = (x32.abs().amax(dim=-1) / qmax).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    scaled = (x32 / scale.float().unsqueeze(-1)).clamp(-qmax, qmax).view(t, h, d)
    if cache_dtype == torch.int8:
        q = scaled.round().to(torch.int8)
    elif is_packed(cache_dtype):
        if d % 2:
            raise ValueError(f"an int4 cache needs an even head_dim, got {d}")
        nibbles = (scaled.round() + INT4_OFFSET).to(torch.uint8)
        q = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    else:
        q = scaled.to(cache_dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize` on any leading shape: q [..., stored], scale [..., num_groups]
    -> [..., head_dim] in `dtype`."""
    if is_packed(q.dtype):
        # Both nibbles of a byte at once: the low one into the low 16 bits of an int32, the
        # high one into the high 16, read back as two int16 in channel order (little-endian).
        # 5x faster on the CPU than stacking the two nibble tensors.
        assert sys.byteorder == "little"
        word = q.to(torch.int32)
        pairs = (word & 0xF) | ((word >> 4) << 16)
        values = pairs.view(torch.int16).to(dtype).sub_(INT4_OFFSET)
    else:
        values = q.to(dtype)
    num_groups = scale.shape[-1]
    grouped = values.unflatten(-1, (num_groups, values.shape[-1] // num_groups))
    return (grouped * scale.to(dtype).unsqueeze(-1)).flatten(-2)
