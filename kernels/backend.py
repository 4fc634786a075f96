"""Attention backend selection: the same three ops, from torch (reference, CPU) or Triton."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class AttentionOps:
    """The ops a decoder layer needs; every member has the signature of its `*_ref` twin."""

    name: str
    write_kv_cache: Callable[..., None]
    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., torch.Tensor]
    # RoPE on q and k with the cache write in one op, where the backend has one for these
    # arguments: (qkv, cos, signed_sin, key_cache, value_cache, slot_mapping, num_heads,
    # num_kv_heads, key_scale_cache) -> rotated q [T, Hq, D], or None (take the separate ops).
    rotary_cache_write: Callable[..., torch.Tensor | None] | None = None


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto` picks Triton on CUDA and torch elsewhere."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}"
        )
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def get_attention_ops(backend: str, device: torch.device) -> AttentionOps:
    name = resolve_backend(backend, device)
    if name == "torch":
        from .torch_ops import StepCacheWrite, StepDecode, StepPrefill, rotary_cache_write_cpu

        # The references, with what the layers of a step share derived once (per engine); on
        # the CPU, kvchat's C++ ops where they apply.
        return AttentionOps(
            "torch",
            StepCacheWrite(),
            StepDecode(),
            StepPrefill(),
            rotary_cache_write_cpu if device.type == "cpu" else None,
        )
    from .cache_write import write_kv_cache
    from .decode_attention import paged_decode_attention
    from .prefill_attention import paged_prefill_attention

    return AttentionOps("triton", write_kv_cache, paged_decode_attention, paged_prefill_attention)
