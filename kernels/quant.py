"""KV-cache element types: how a cache dtype name maps to storage, and per-token quantization.

Quantized caches (`int8`, `fp8`) store one float32 scale per (token, kv head) next to the
values: x ≈ q * scale with scale = amax(|x|) / QMAX over the head_dim vector.

Keys are stored rotated (`key_rotation`): real models' keys carry a few outlier channels, and
one scale per vector then leaves the other channels a few codes each. An orthogonal matrix
spreads the outliers over every channel before quantization; the queries are turned by the
same matrix, so q·k, and attention, are unchanged up to the quantization (QuaRot's idea, done
after RoPE: a rotation that mixes channels does not commute with RoPE's). On
SmolLM2-135M-Instruct this takes int8's KL from 5.1e-4 to 1.7e-4 (bench/kv_quality.py).
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
# Smallest scale we store: keeps an all-zero vector from dividing by zero.
MIN_SCALE = 1e-10


# The quantized `kv_cache_dtype` settings (memory.kv_spec.KV_CACHE_DTYPES names them all).
QUANTIZED_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


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
    return cache_dtype in (torch.int8, torch.float8_e4m3fn)


def quant_max(cache_dtype: torch.dtype) -> float:
    if cache_dtype == torch.int8:
        return INT8_MAX
    if cache_dtype == torch.float8_e4m3fn:
        return FP8_E4M3_MAX
    raise ValueError(f"{cache_dtype} is not a quantized cache dtype")


def quantize_per_token_head(
    x: torch.Tensor, cache_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_tokens, num_kv_heads, head_dim] -> (q: same shape in cache_dtype,
    scale: [num_tokens, num_kv_heads] float32)."""
    qmax = quant_max(cache_dtype)
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1) / qmax).clamp_min(MIN_SCALE)
    scaled = x32 / scale.unsqueeze(-1)
    if cache_dtype == torch.int8:
        q = scaled.round().clamp(-qmax, qmax).to(torch.int8)
    else:
        q = scaled.clamp(-qmax, qmax).to(cache_dtype)
    return q, scale
