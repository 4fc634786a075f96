"""Helpers shared by the benchmarks: the machine header, a copy-bandwidth probe, tables."""

from __future__ import annotations

import os
import platform
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvchat.kernels.cpu_ops import cpu_isa, cpu_model

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


# When the benchmark process started and how busy the machine was then: read when a script
# imports this module, before any of its work, so that a header written at the end of a run
# does not report the run's own load as the machine's.
PROCESS_START: tuple[time.struct_time, tuple[float, float, float]] = (
    time.gmtime(),
    os.getloadavg(),
)


def stop_servers_on_sigterm() -> None:
    """SIGTERM (a `kill`, a CI job's end) exits as Ctrl-C does, through the `finally` blocks
    that stop the servers a bench started, instead of leaving them running."""

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def machine_header(
    title: str,
    settings: dict[str, object],
    *,
    started: time.struct_time | None = None,
    load_start: tuple[float, float, float] | None = None,
    load_end: tuple[float, float, float] | None = None,
) -> str:
    """The results file's header: the machine (CPU model and ISA), when the run started and
    ended, and the load averages at both ends. `started` / `load_start` default to when the
    process started (PROCESS_START), `load_end` to now (the end, when the report is written);
    a script timing several sections passes each section's own."""
    start_time = started if started is not None else PROCESS_START[0]
    load = load_start if load_start is not None else PROCESS_START[1]
    end_load = load_end if load_end is not None else os.getloadavg()

    def loads(x: tuple[float, float, float]) -> str:
        return ", ".join(f"{v:.2f}" for v in x)

    lines = [
        f"# {title}",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}, "
        f"{' '.join(cpu_isa())}; torch's CPU kernels: {torch.backends.cpu.get_cpu_capability()}"
        f"), torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads"
        + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"),
        f"- started: {time.strftime('%Y-%m-%d %H:%M UTC', start_time)}, ended: "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        # Other work on the machine shows in every timing: say how busy it was.
        f"- load average at start (1, 5, 15 min): {loads(load)}; at end: {loads(end_load)}",
    ]
    lines += [f"- {key}: {value}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def copy_bandwidth(num_bytes: int = 256 * 1024**2, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy (bytes read + bytes written), best of N."""
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best


def ensure_model(path: Path, preset: str) -> Path:
    """Create a preset model the first time a benchmark needs it."""
    if not (path / "config.json").exists():
        from kvchat.inference.model.gguf_presets import GGUF_PRESETS, init_gguf_preset

        print(f"creating the {preset} model in {path}")
        if preset in GGUF_PRESETS:  # a real model, imported from the GGUF its preset names
            init_gguf_preset(path, preset, progress=True)
        else:
            from kvchat.inference.model.dev_model import init_model

            init_model(path, preset, seed=0)
    return path


def serve_command(model: Path, port: int, *flags: str) -> list[str]:
    """`kvchat serve` of `model` on `port` as a subprocess's argv, with this interpreter (its
    venv's kvchat), safe-path (-P: the working directory never shadows an import)."""
    return [
        sys.executable,
        "-P",
        "-m",
        "kvchat.app.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        *flags,
    ]
