"""LinearPlan: how this machine runs the model's linear layers, chosen at start-up by measuring.

A decode step is a weight stream (every weight read once, a few multiply-adds each), a prefill
chunk a GEMM; which library path does each best depends on the CPU, not its vendor string:
MKL's GEMV takes a slow generic path on AMD, oneDNN's prepacked matmul loses to a plain
stream at one row on some CPUs and wins at a few rows on others, torch's own half-precision
GEMV is fast for float16 and slow for bfloat16. So the engine times the candidates on the
model's own weights (its layers' shapes, enough of them to stream from memory as a step
does) and keeps the fastest:

- decode (1 to `max_decode_rows` rows): `gemv` or `gemv-prefetch` (kvchat's kernel,
  kernels/cpu_gemv.cpp, without or with software prefetches ahead of its loads: which is
  faster depends on the CPU), `torch` (`F.linear`: MKL / torch's GEMV), or
  `onednn-prepacked` (oneDNN on the weight
  reordered into its blocked layout, which then replaces the plain copy: the model is held
  once either way);
- prefill (more rows): `torch`, `onednn` (oneDNN on the weight as stored), and where the CPU
  has no native half-precision GEMM, `widen` (kvchat's kernel: the half-precision weight
  widened to float32 a cache-sized block at a time, each block's GEMM in float32) or `upcast`
  (the whole weight widened to a float32 copy per call, then one float32 GEMM).

The tied lm_head reads the embedding's tensor and stays in the plain layout (one copy of the
largest weight); it takes the fastest plain decode path. Every path gives `F.linear`'s
result within float rounding (tests/inference/test_linear.py), so the choice never changes
tokens beyond that.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvchat.kernels.cpu_ops import GEMV_MAX_ROWS, cpu_isa, cpu_model, load_gemv, load_widen_gemm

LINEAR_PATHS = ("auto", "gemv", "gemv-prefetch", "torch", "onednn", "onednn-prepacked")
GEMV_PATHS = ("gemv", "gemv-prefetch")  # kvchat's decode kernel, without and with prefetches
DECODE_ROWS = (1, 4, GEMV_MAX_ROWS)  # probed row counts of a decode step
PREFILL_ROWS = 128
# Weights the probe streams per pass (the first layers, as many as fit): well past any
# last-level cache, so a pass runs from memory as a step does.
PROBE_BYTES = 256 * 2**20
# Passes per candidate; the fastest counts (other work on the machine only ever adds time).
PROBE_REPEATS = 5

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def cpu_description() -> dict[str, object]:
    """The CPU the paths were chosen on: its model, the ISA features that matter here and
    torch's own kernel level."""
    return {
        "model": cpu_model(),
        "isa": cpu_isa(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
    }


def torch_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's matmul; w is the plain [out, in] weight or its prepacked layout."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def upcast_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A half-precision weight without a native half GEMM: float32 GEMM on an upcast copy (an
    extra pass over the weight, far less than the emulated half-precision GEMM costs)."""
    return F.linear(x.float(), w.float(), b.float() if b is not None else None).to(x.dtype)


def gemv_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    gemv = load_gemv()
    assert gemv is not None
    return gemv(x, w, b)


def gemv_prefetch_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    gemv = load_gemv()
    assert gemv is not None
    return gemv(x, w, b, True)


def widen_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    widen = load_widen_gemm()
    assert widen is not None
    return widen(x, w, b)


PATH_FNS: dict[str, LinearFn] = {
    "gemv": gemv_linear,
    "gemv-prefetch": gemv_prefetch_linear,
    "torch": torch_linear,
    "onednn": onednn_linear,
    "onednn-prepacked": onednn_linear,
    "upcast": upcast_linear,
    "widen": widen_linear,
}


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of a [out, in] weight (opaque: only oneDNN reads it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


@functools.cache
def onednn_dtypes() -> frozenset[torch.dtype]:
    """Weight dtypes oneDNN runs natively on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        dtypes.add(torch.float16)
    return frozenset(dtypes)


PLAIN, PREPACKED = "plain", "onednn-prepacked"


@dataclass(frozen=True)
class LinearPlan:
    """The paths the linear layers of one model take on this machine."""

    dtype: torch.dtype
    layout: str  # how the layers hold their weights: PLAIN or PREPACKED
    # (max rows, path) in increasing rows: a call of up to that many rows takes that path
    decode_paths: tuple[tuple[int, str], ...]
    prefill_path: str  # calls of more rows
    head_decode_paths: tuple[tuple[int, str], ...]  # the lm_head's (always plain)
    # candidate -> {rows: ms per pass over the probe's weights}; empty when not measured
    probe_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    probe_bytes: int = 0
    reason: str = ""
    # The file the plan was loaded from (`cached`) or kept in after measuring; None: not kept.
    cache_file: str | None = None
    cached: bool = False

    @property
    def prepacked(self) -> bool:
        """Whether the layers hold oneDNN's blocked layout instead of the plain weight."""
        return self.layout == PREPACKED

    @property
    def decode_path(self) -> str:
        """The path of a single-sequence decode step's layers."""
        return self.decode_paths[0][1]

    def summary(self) -> str:
        measured = "; ".join(
            f"{name} " + "/".join(f"{ms:.1f}" for ms in by_rows.values())
            for name, by_rows in self.probe_ms.items()
        )

        def paths(table: tuple[tuple[int, str], ...]) -> str:
            return ", ".join(f"<= {rows} rows {path}" for rows, path in table)

        return (
            f"{self.dtype} weights {self.layout}: decode {paths(self.decode_paths)}; prefill "
            f"{self.prefill_path}; lm_head {paths(self.head_decode_paths)}"
            + (
                f" [ms per {self.probe_bytes / 2**20:.0f} MiB pass, by rows: {measured}]"
                if measured
                else ""
            )
            + (f" ({self.reason})" if self.reason else "")
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LinearPlan:
        """The plan `as_dict` wrote (without where it was kept); ValueError, KeyError or
        TypeError when `data` is not one."""
        dtype = getattr(torch, str(data["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {data['dtype']!r}")
        layout = str(data["weights"])
        if layout not in (PLAIN, PREPACKED):
            raise ValueError(f"unknown weight layout {layout!r}")

        def table(rows: Sequence[Mapping[str, Any]]) -> tuple[tuple[int, str], ...]:
            paths = tuple((int(row["max_rows"]), str(row["path"])) for row in rows)
            if not paths or [r for r, _ in paths] != sorted(r for r, _ in paths):
                raise ValueError(f"a path table needs rows in increasing order, got {paths}")
            return paths

        plan = cls(
            dtype=dtype,
            layout=layout,
            decode_paths=table(data["decode_paths"]),
            prefill_path=str(data["prefill_path"]),
            head_decode_paths=table(data["lm_head_decode_paths"]),
            probe_ms={
                str(name): {int(rows): float(ms) for rows, ms in by_rows.items()}
                for name, by_rows in data["probe_ms"].items()
            },
            probe_bytes=int(data["probe_bytes"]),
            reason=str(data["reason"]),
        )
        unknown = {
            path
            for _, path in (*plan.decode_paths, *plan.head_decode_paths, (0, plan.prefill_path))
        } - set(PATH_FNS)
        if unknown:
            raise ValueError(f"unknown linear paths {sorted(unknown)}")
        return plan

    def as_dict(self) -> dict[str, object]:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "weights": self.layout,
            "decode_paths": [{"max_rows": r, "path": p} for r, p in self.decode_paths],
            "prefill_path": self.prefill_path,
            "lm_head_decode_paths": [{"max_rows": r, "path": p} for r, p in self.head_decode_paths],
            "probe_bytes": self.probe_bytes,
            "probe_ms": {
                k: {str(r): round(ms, 3) for r, ms in v.items()} for k, v in self.probe_ms.items()
            },
            "reason": self.reason,
            "cached": self.cached,
            "cache_file": self.cache_file,
        }


def fixed_plan(dtype: torch.dtype, device: torch.device, path: str = "auto") -> LinearPlan:
    """A plan without measuring: CUDA (cuBLAS everywhere) or a path forced by the config."""
    if device.type != "cpu":
        return LinearPlan(dtype, PLAIN, ((0, "torch"),), "torch", ((0, "torch"),), reason="cuBLAS")
    assert path in LINEAR_PATHS and path != "auto", path
    if path in GEMV_PATHS and load_gemv() is None:
        raise ValueError(f"linear_path={path}: kvchat's CPU kernel could not be built here")
    if path == PREPACKED and dtype not in onednn_dtypes():
        raise ValueError(f"linear_path=onednn-prepacked: oneDNN has no native {dtype} here")
    rows = ((GEMV_MAX_ROWS, path),)
    if path == PREPACKED:
        return LinearPlan(
            dtype,
            PREPACKED,
            rows,
            PREPACKED,
            ((GEMV_MAX_ROWS, "torch"),),
            reason="set by linear_path",
        )
    return LinearPlan(dtype, PLAIN, rows, default_prefill(dtype), rows, reason="set by linear_path")


def default_prefill(dtype: torch.dtype) -> str:
    if dtype in onednn_dtypes():
        return "onednn"
    if dtype in (torch.bfloat16, torch.float16):
        return "widen" if load_widen_gemm() is not None else "upcast"
    return "torch"


def _time_pass(
    fn: LinearFn,
    weights: Sequence[torch.Tensor],
    in_dims: Sequence[int],
    xs: dict[int, torch.Tensor],
) -> float:
    """Seconds of one pass: each weight applied to the input of its width."""
    start = time.perf_counter()
    for w, in_features in zip(weights, in_dims):
        fn(xs[in_features], w, None)
    return time.perf_counter() - start


def measure_plan(layer_weights: Sequence[torch.Tensor], dtype: torch.dtype) -> LinearPlan:
    """Time the candidate paths on the model's layer weights ([out, in] each, in the order a
    step reads them) and choose. Takes a second or two on a 150M-parameter model on an idle
    machine, minutes on a busy one: inference/model/linear_plan_cache.py keeps the result."""
    probe: list[torch.Tensor] = []
    total = 0
    for w in layer_weights:
        if total >= PROBE_BYTES:
            break
        probe.append(w)
        total += w.numel() * w.element_size()
    # in_features of each probe weight (a prepacked weight's shape is not its [out, in])
    widths = [int(w.shape[1]) for w in probe]

    # Plain-layout candidates, then oneDNN's prepacked layout (a copy of the probe weights,
    # dropped after).
    candidates: dict[str, tuple[LinearFn, list[torch.Tensor]]] = {"torch": (torch_linear, probe)}
    if load_gemv() is not None:
        candidates["gemv"] = (gemv_linear, probe)
        candidates["gemv-prefetch"] = (gemv_prefetch_linear, probe)
    if dtype in onednn_dtypes():
        candidates["onednn"] = (onednn_linear, probe)
        candidates[PREPACKED] = (onednn_linear, [prepack(w) for w in probe])
    if dtype in (torch.bfloat16, torch.float16):
        candidates["upcast"] = (upcast_linear, probe)
        if load_widen_gemm() is not None:
            candidates["widen"] = (widen_linear, probe)
    gen = torch.Generator().manual_seed(0)
    # Prefill is compute-bound: a few layers say as much as many.
    few = max(1, min(len(probe), 8))

    times: dict[str, dict[int, list[float]]] = {name: {} for name in candidates}
    with torch.inference_mode():
        for rows in (*DECODE_ROWS, PREFILL_ROWS):
            xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in set(widths)}
            runs = {
                name: (fn, ws if rows <= GEMV_MAX_ROWS else ws[:few])
                for name, (fn, ws) in candidates.items()
                # gemv takes decode rows only; upcast and widen are prefill paths
                if not (name in GEMV_PATHS and rows > GEMV_MAX_ROWS)
                and not (name in ("upcast", "widen") and rows <= GEMV_MAX_ROWS)
            }
            for fn, ws in runs.values():  # warm-up: first calls allocate, build, fault in
                _time_pass(fn, ws[:4], widths, xs)
            for _ in range(PROBE_REPEATS):
                for name, (fn, ws) in runs.items():
                    seconds = _time_pass(fn, ws, widths, xs) * len(probe) / len(ws)
                    times[name].setdefault(rows, []).append(seconds)
    probe_ms = {
        name: {rows: min(v) * 1e3 for rows, v in by_rows.items()} for name, by_rows in times.items()
    }

    def fastest(names: Sequence[str], rows: int) -> str:
        present = [n for n in names if rows in probe_ms.get(n, {})]
        return min(present, key=lambda n: probe_ms[n][rows])

    plain = [n for n in (*GEMV_PATHS, "torch", "onednn") if n in candidates]
    # The layout is the one whose best path runs a single-sequence step fastest.
    best_plain = fastest(plain, 1)
    layout = (
        PREPACKED
        if fastest([best_plain, PREPACKED] if PREPACKED in candidates else [best_plain], 1)
        == PREPACKED
        else PLAIN
    )
    held = [PREPACKED] if layout == PREPACKED else plain
    prefill = (
        PREPACKED
        if layout == PREPACKED
        else fastest(
            [n for n in ("torch", "onednn", "upcast", "widen") if n in candidates], PREFILL_ROWS
        )
    )

    def by_rows(names: Sequence[str]) -> tuple[tuple[int, str], ...]:
        table = [(rows, fastest(names, rows)) for rows in DECODE_ROWS]
        # Beyond the last row count the decode path beats the prefill path at, calls are
        # prefill calls.
        kept = []
        for rows, path in table:
            if probe_ms[path][rows] > probe_ms.get(prefill, {}).get(rows, float("inf")):
                break
            kept.append((rows, path))
        return tuple(kept) or ((1, table[0][1]),)

    return LinearPlan(
        dtype, layout, by_rows(held), prefill, by_rows(plain), probe_ms, total, reason="measured"
    )
