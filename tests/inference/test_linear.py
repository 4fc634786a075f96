"""Linear: the prepacked (oneDNN) and plain paths compute x W^T + b like F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import inference.linear as linear_module
from inference.linear import UPCAST_MIN_ROWS, Linear, prepacks

ROWS = [0, 1, 2, 16, UPCAST_MIN_ROWS - 1, UPCAST_MIN_ROWS, 97]


def weights(dtype: torch.dtype, bias: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(96, 80, generator=g) * 0.1).to(dtype)
    b = (torch.randn(96, generator=g) * 0.1).to(dtype) if bias else None
    return w, b


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float64 x W^T + b of the same (rounded) values."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_float64_reference(rows: int, bias: bool) -> None:
    w, b = weights(torch.float32, bias, seed=rows)
    lin = Linear(w, b)
    x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(rows + 1))
    out = lin(x)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, w, b), rtol=1e-5, atol=1e-5)


def test_leading_dimensions_are_kept() -> None:
    w, b = weights(torch.float32, True, seed=0)
    x = torch.randn(3, 5, 80)
    torch.testing.assert_close(Linear(w, b)(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 97])
def test_half_precision_is_close_to_float64(dtype: torch.dtype, rows: int) -> None:
    w, b = weights(dtype, True, seed=rows)
    x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(rows)).to(dtype)
    out = Linear(w, b)(x)
    assert out.dtype == dtype
    ref = reference(x, w, b)
    # One rounding of the output to the half type, plus accumulation differences.
    assert (out.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_half_without_native_support_computes_prefill_in_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(linear_module, "_onednn_dtypes", lambda: frozenset({torch.float32}))
    w, b = weights(torch.bfloat16, True, seed=3)
    lin = Linear(w, b)
    assert not lin.is_prepacked
    for rows in (1, UPCAST_MIN_ROWS):
        x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        out = lin(x)
        assert out.dtype == torch.bfloat16
        if rows >= UPCAST_MIN_ROWS:  # computed in float32, rounded once at the end
            expected = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
            assert torch.equal(out, expected)
        else:
            assert torch.equal(out, F.linear(x, w, b))


def test_cpu_float32_weights_are_prepacked_when_onednn_is_there() -> None:
    w, _ = weights(torch.float32, False, seed=0)
    assert prepacks(w) == torch.backends.mkldnn.is_available()
