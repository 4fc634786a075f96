"""Linear: y = x W^T + b, with W laid out once, at load, for the CPU's GEMM library.

On the CPU, torch's `F.linear` hands MKL the weight as stored on every call; for the few rows
of a decode step (1 to a few dozen) MKL re-packs it each time and reaches a fraction of the
memory bandwidth, and in bfloat16 it goes through a slow generic path. oneDNN's matmul with the
weight reordered once into its blocked layout (what inductor's freezing pass does for CPU
linears) keeps a batch-16 step close to a batch-1 step, and runs bfloat16 on AVX512-BF16 /
AMX. Elsewhere (CUDA, a torch without oneDNN, a dtype oneDNN cannot run natively on this CPU)
the weight stays as it is and `F.linear` runs.

Half-precision weights without native support keep a fast prefill by computing chunks of
many rows in float32 (the weight is upcast per call: an extra pass over the weight, far less
than the emulated half-precision GEMM costs); decode steps stay in half precision.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Rows from which a half-precision linear without native support computes in float32.
UPCAST_MIN_ROWS = 32


@functools.cache
def _onednn_dtypes() -> frozenset[torch.dtype]:
    """Weight dtypes oneDNN runs natively on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        dtypes.add(torch.float16)
    return frozenset(dtypes)


def prepacks(weight: torch.Tensor) -> bool:
    """Whether `Linear` lays this weight out for oneDNN."""
    return weight.device.type == "cpu" and weight.dtype in _onednn_dtypes()


class Linear:
    """A frozen linear layer (inference only). The prepacked weight is opaque: keep the
    original elsewhere if anything else (a tied embedding) reads it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        assert weight.dim() == 2, "weight must be [out_features, in_features]"
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.bias = bias
        self.is_prepacked = prepacks(weight)
        # float32 keeps the weight as stored too, for single-row calls (a decode step of one
        # sequence): MKL's GEMV streams it faster than oneDNN's (~4-7% on the bench model's
        # layers), at the cost of a second copy. A tied lm_head shares it with the embedding.
        self._plain = weight if self.is_prepacked and weight.dtype == torch.float32 else None
        # [out, in] as stored, or oneDNN's blocked layout of it.
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            if self.is_prepacked
            else weight
        )
        self._upcast_prefill = (
            weight.device.type == "cpu"
            and not self.is_prepacked
            and weight.dtype in (torch.bfloat16, torch.float16)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        if self._plain is not None and x.numel() == self.in_features:
            return F.linear(x, self._plain, self.bias)
        if self.is_prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self._upcast_prefill and x.numel() >= UPCAST_MIN_ROWS * self.in_features:
            bias = self.bias.float() if self.bias is not None else None
            return F.linear(x.float(), self.weight.float(), bias).to(self.dtype)
        return F.linear(x, self.weight, self.bias)
