"""Linear and its paths: every path a LinearPlan may choose computes x W^T + b like F.linear
(within the rounding of its dtype), on shapes that cross the kernels' vector widths, so the
per-CPU choice never changes tokens beyond rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvchat.inference.model.linear import Linear
from kvchat.inference.model.linear_plan import (
    DECODE_ROWS,
    PATH_FNS,
    PREFILL_ROWS,
    PREPACKED,
    LinearPlan,
    fixed_plan,
    measure_plan,
    onednn_dtypes,
    prepack,
)
from kvchat.kernels.cpu_ops import GEMV_MAX_ROWS, load_gemv, load_widen_gemm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# in_features around the vector widths (8 and 16 float32, 32 bfloat16 per dot-product step)
# and the unrolled steps (64); out_features from one row up.
# (out, in); (1000, 40): several panels of the widen path's many-row GEMM, the last one short
SHAPES = [(1, 1), (3, 15), (37, 16), (5, 17), (16, 33), (96, 80), (17, 127), (64, 768), (1000, 40)]
CPU = torch.device("cpu")


def paths_for(dtype: torch.dtype) -> list[str]:
    paths = ["torch", "upcast"]
    if load_gemv() is not None:
        paths += ["gemv", "gemv-prefetch"]
    if load_widen_gemm() is not None and dtype in (torch.bfloat16, torch.float16):
        paths.append("widen")
    if dtype in onednn_dtypes():
        paths += ["onednn", PREPACKED]
    return paths


def tolerance(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """One rounding of the output to the dtype plus accumulation-order differences."""
    scale = max(ref.abs().max().item(), 1.0)
    return {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype] * scale


def operands(
    out_f: int, in_f: int, rows: int, dtype: torch.dtype, bias: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g).to(dtype)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    return x, w, b


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float64 x W^T + b of the same (rounded) values."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_path_matches_f_linear(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    out_f, in_f = shape
    for path in paths_for(dtype):
        fn = PATH_FNS[path]
        rows_list = [1, 2, 3, 4, 5, GEMV_MAX_ROWS] if path.startswith("gemv") else [1, 4, 17, 97]
        for rows in rows_list:
            for bias in (False, True):
                x, w, b = operands(out_f, in_f, rows, dtype, bias, seed=rows + out_f + in_f)
                weight = prepack(w) if path == PREPACKED else w
                out = fn(x, weight, b)
                ref = reference(x, w, b)
                assert out.shape == (rows, out_f) and out.dtype == dtype, (path, rows)
                err = (out.double() - ref).abs().max().item()
                assert err <= tolerance(dtype, ref), (path, rows, bias, err)
                # and against F.linear in the same dtype: the same result up to rounding
                same = F.linear(x, w, b).double()
                assert (out.double() - same).abs().max().item() <= 2 * tolerance(dtype, ref)


@pytest.mark.skipif(load_gemv() is None, reason="needs a C++ compiler")
def test_gemv_rejects_what_it_does_not_take() -> None:
    gemv = load_gemv()
    assert gemv is not None
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="rows"):
        gemv(torch.randn(GEMV_MAX_ROWS + 1, 16), w, None)
    with pytest.raises(RuntimeError, match="in_features"):
        gemv(torch.randn(1, 15), w, None)
    with pytest.raises(RuntimeError, match="same dtype"):
        gemv(torch.randn(1, 16).bfloat16(), w, None)


@pytest.mark.skipif(load_widen_gemm() is None, reason="needs a C++ compiler")
def test_widen_gemm_rejects_what_it_does_not_take_and_keeps_leading_dims() -> None:
    widen = load_widen_gemm()
    assert widen is not None
    w = torch.randn(50, 16).half()
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        widen(torch.randn(3, 16), w.float(), None)
    with pytest.raises(RuntimeError, match="in_features"):
        widen(torch.randn(3, 15).half(), w, None)
    with pytest.raises(RuntimeError, match="same dtype"):
        widen(torch.randn(3, 16).bfloat16(), w, None)
    x = torch.randn(2, 21, 16).half()
    out = widen(x, w, None)
    assert out.shape == (2, 21, 50) and out.dtype == torch.float16
    assert widen(x[:, :0], w, None).shape == (2, 0, 50)
    ref = reference(x.reshape(42, 16), w, None).reshape(2, 21, 50)
    assert (out.double() - ref).abs().max().item() <= tolerance(torch.float16, ref)


@pytest.mark.parametrize("path", ["gemv", "gemv-prefetch", "torch", "onednn", PREPACKED])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_with_each_forced_plan(path: str, dtype: torch.dtype) -> None:
    if path.startswith("gemv") and load_gemv() is None:
        pytest.skip("needs a C++ compiler")
    if path in ("onednn", PREPACKED) and dtype not in onednn_dtypes():
        with pytest.raises(ValueError) if path == PREPACKED else _no_error():
            fixed_plan(dtype, CPU, path)
        return
    plan = fixed_plan(dtype, CPU, path)
    x0, w, b = operands(96, 80, 97, dtype, True, seed=7)
    lin = Linear(w, b, plan)
    assert lin.is_prepacked == (path == PREPACKED)
    for rows in (0, 1, 2, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 97):  # decode and prefill calls
        x = x0[:rows]
        out = lin(x)
        ref = reference(x, w, b)
        assert out.shape == (rows, 96)
        if rows:
            assert (out.double() - ref).abs().max().item() <= tolerance(dtype, ref), rows
    # leading dimensions are kept
    x3 = x0[:15].reshape(3, 5, 80)
    assert lin(x3).shape == (3, 5, 96)


class _no_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_a_tied_head_stays_plain_and_shares_the_tensor() -> None:
    w = torch.randn(64, 32)
    lin = Linear(
        w,
        None,
        fixed_plan(torch.float32, CPU, PREPACKED)
        if torch.float32 in onednn_dtypes()
        else fixed_plan(torch.float32, CPU, "torch"),
        is_head=True,
    )
    assert not lin.is_prepacked and lin.weight is w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_measured_plan_names_real_paths_and_its_choice_is_the_fastest(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    layers = [
        torch.randn(n, k, generator=g).to(dtype)
        for n, k in [(96, 64), (64, 64), (256, 64), (64, 128)] * 2
    ]
    plan = measure_plan(layers, dtype)
    assert plan.reason == "measured" and plan.probe_bytes == sum(
        w.numel() * w.element_size() for w in layers
    )
    assert plan.prefill_path in PATH_FNS
    if dtype not in onednn_dtypes() and load_widen_gemm() is not None:
        # no native half GEMM here: kvchat's widening GEMM is a measured prefill candidate
        assert PREFILL_ROWS in plan.probe_ms["widen"]
        assert set(plan.probe_ms["widen"]) == {PREFILL_ROWS}
    for table in (plan.decode_paths, plan.head_decode_paths):
        rows = [r for r, _ in table]
        assert rows == sorted(rows) and rows[0] == 1 and set(rows) <= set(DECODE_ROWS)
        for r, path in table:
            assert path in PATH_FNS and r in plan.probe_ms[path]
    # the head's single-row path is the fastest plain path the probe measured
    plain = {
        n: v[1]
        for n, v in plan.probe_ms.items()
        if n in ("gemv", "gemv-prefetch", "torch", "onednn")
    }
    assert plan.head_decode_paths[0][1] == min(plain, key=plain.__getitem__)
    lin = Linear(layers[0], None, plan)
    x = torch.randn(3, 64, generator=g).to(dtype)
    ref = reference(x, layers[0], None)
    assert (lin(x).double() - ref).abs().max().item() <= tolerance(dtype, ref)
    assert plan.as_dict()["weights"] == plan.layout
    assert plan.decode_path in plan.summary()


def test_cuda_and_forced_plans_do_not_measure() -> None:
    plan = fixed_plan(torch.bfloat16, torch.device("cuda"))
    assert plan.probe_ms == {} and plan.reason == "cuBLAS"
    assert isinstance(fixed_plan(torch.float32, CPU, "torch"), LinearPlan)
