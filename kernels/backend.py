"""Attention backend selection: the same three ops, from torch (reference, CPU) or Triton."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class AttentionOps:
    """The ops a decoder layer needs; every member has the signature of its `*_ref` twin."""

    name: str
    write_kv_cache: Callable[..., None]
    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., torch.Tensor]


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
        from .prefill_attention import paged_prefill_attention_ref
        from .torch_ops import StepCacheWrite, StepDecode

        # The references, with what the layers of a step share derived once (per engine).
        return AttentionOps("torch", StepCacheWrite(), StepDecode(), paged_prefill_attention_ref)
    from .cache_write import write_kv_cache
    from .decode_attention import paged_decode_attention
    from .prefill_attention import paged_prefill_attention

    return AttentionOps("triton", write_kv_cache, paged_decode_attention, paged_prefill_attention)
