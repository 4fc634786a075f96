"""KV-cache element types: how a cache dtype name maps to storage, and per-token quantization.

Quantized caches (`int8`, `fp8`) store one float32 scale per (token, kv head) next to the
values: x ≈ q * scale with scale = amax(|x|) / QMAX over the head_dim vector.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
# Smallest scale we store: keeps an all-zero vector from dividing by zero.
MIN_SCALE = 1e-10


# The quantized `kv_cache_dtype` settings (memory.kv_spec.KV_CACHE_DTYPES names them all).
QUANTIZED_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


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


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_per_token_head: q [..., head_dim], scale [...] -> dtype."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
