"""Linear: y = x W^T + b, through the paths a `LinearPlan` chose for this machine.

A call of a few rows (a decode step of a few sequences) is a weight stream and takes the
plan's decode path for that many rows; a longer one (a prefill chunk) is a GEMM and takes its
prefill path. The weight is held once: as stored (the plain [out, in] tensor, shared with the
embedding when the lm_head is tied), or, where the plan chose oneDNN's prepacked matmul for the
layers, only in oneDNN's blocked layout. See inference/model/linear_plan.py for how the plan is
chosen.
"""

from __future__ import annotations

import torch

from .linear_plan import PATH_FNS, PREPACKED, LinearFn, LinearPlan, prepack


class Linear:
    """A frozen linear layer (inference only)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plan: LinearPlan,
        *,
        is_head: bool = False,
    ) -> None:
        assert weight.dim() == 2, "weight must be [out_features, in_features]"
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.bias = bias
        self.plan = plan
        self.is_prepacked = plan.prepacked and not is_head
        # [out, in] as stored, or (prepacked) oneDNN's blocked layout, which replaces it.
        self.weight = prepack(weight) if self.is_prepacked else weight
        table = plan.head_decode_paths if is_head else plan.decode_paths
        # (max elements of x, path) in increasing size
        self._decode: tuple[tuple[int, LinearFn], ...] = tuple(
            (rows * self.in_features, PATH_FNS[path if path != "cuda" else "torch"])
            for rows, path in table
        )
        prefill = plan.prefill_path
        if is_head and prefill == PREPACKED:
            prefill = "onednn"
        self._prefill = PATH_FNS[prefill]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        n = x.numel()
        if n:
            for max_numel, fn in self._decode:
                if n <= max_numel:
                    return fn(x, self.weight, self.bias)
        return self._prefill(x, self.weight, self.bias)
