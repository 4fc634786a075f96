"""The model's RMSNorm: the CPU op (kernels/cpu_rms_norm.cpp) rounds as the torch reference
(Hugging Face's: float32 statistics, a half-precision x normalised, rounded, then scaled and
rounded again), for one row, a decode step's few and a prefill's many."""

from __future__ import annotations

import pytest
import torch

from kvchat.inference.model.model import rms_norm, rms_norm_ref
from kvchat.kernels.cpu_ops import load_cpu_ops

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="needs a C++ compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 768), (3, 64), (16, 17), (97, 256), (2, 5, 48)], ids=str)
def test_cpu_op_matches_the_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    out = rms_norm(x, w, 1e-5)
    ref = rms_norm_ref(x, w, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    else:  # the statistics' summation order may move a value across one rounding step
        ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
        bound = 2 * ulp * ref.float().abs().clamp_min(1e-3)
        assert bool(((out.float() - ref.float()).abs() <= bound).all())
        assert (out == ref).float().mean().item() > 0.98


def test_non_contiguous_input_and_dtype_mismatch() -> None:
    x = torch.randn(8, 32).t()  # [32, 8], not contiguous
    w = torch.randn(8)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.kvchat_cpu.rms_norm(x, w.bfloat16(), 1e-6)
