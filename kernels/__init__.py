"""Paged-attention kernels (Triton) and their torch reference twins (same signatures).

Without CUDA, Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1): slow but
exact, which is how the kernel tests run on CPU machines. The variable must be set before
any `@triton.jit` function is defined, hence here, before the kernel modules are imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .backend import ATTENTION_BACKENDS, AttentionOps, get_attention_ops, resolve_backend
from .quant import is_quantized, kv_storage_dtype

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionOps",
    "get_attention_ops",
    "is_quantized",
    "kv_storage_dtype",
    "resolve_backend",
]
