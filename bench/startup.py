"""Start-up time of `kvchat serve`: from the process's start to /readyz answering 200, cold (no
kept linear plan: the engine probes the CPU's linear paths) and warm (the plan its cold start
kept, inference/model/linear_plan_cache.py), on an idle machine and beside a CPU-bound process
(`python -c "while True: pass"`), in the same run. Each start gets a fresh data directory
(a new SQLite database each time, so cold and warm pay the same for it) and its own plan
directory; the probe's own seconds are read from the server's log.

    python bench/startup.py [--model models/dev] [--dtypes float32,bfloat16] [--repeats 2]

Writes bench/results/startup.md."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvchat.bench.common import (
    REPO,
    RESULTS,
    ensure_model,
    machine_header,
    markdown_table,
    serve_command,
)
from kvchat.kernels.cpu_ops import load_cpu_ops

READY_TIMEOUT_S = 900.0
MEASURED = re.compile(r"linear layers \(measured in ([\d.]+) s")
CACHED = re.compile(r"linear layers \(cached in ")


@dataclass(frozen=True)
class Start:
    seconds: float  # process start to the first /readyz 200
    probe_seconds: float | None  # the linear-path probe's own time; None: the plan was kept


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_once(model: Path, dtype: str, plan_dir: Path, work: Path) -> Start:
    """One `kvchat serve` from process start to /readyz 200, then stopped."""
    data = Path(tempfile.mkdtemp(dir=work, prefix="data-"))
    log_path = data / "serve.log"
    port = free_port()
    command = serve_command(
        model,
        port,
        "--dtype",
        dtype,
        "--data-dir",
        str(data),
        "--linear-plan-dir",
        str(plan_dir),
        "--kv-cache-bytes",
        str(64 * 2**20),
        "--host-cache-bytes",
        str(32 * 2**20),
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    with log_path.open("w") as log:
        begun = time.perf_counter()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            seconds = wait_ready(process, f"http://127.0.0.1:{port}", begun, log_path)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    text = log_path.read_text()
    measured = MEASURED.search(text)
    if measured is None and CACHED.search(text) is None:
        raise RuntimeError(f"no linear plan line in the server's log:\n{text[-3000:]}")
    shutil.rmtree(data, ignore_errors=True)
    return Start(seconds, float(measured.group(1)) if measured else None)


def wait_ready(process: subprocess.Popen[bytes], url: str, begun: float, log: Path) -> float:
    deadline = begun + READY_TIMEOUT_S
    with httpx.Client(timeout=2) as client:
        while time.perf_counter() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"kvchat serve exited:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/readyz").status_code == 200:
                    return time.perf_counter() - begun
            time.sleep(0.05)
    raise RuntimeError(f"kvchat serve was not ready in {READY_TIMEOUT_S:.0f} s")


@contextlib.contextmanager
def busy_neighbour(enabled: bool) -> Iterator[None]:
    """A CPU-bound process beside the server while the block runs (killed after)."""
    if not enabled:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)  # let it take its core before the server starts
        yield
    finally:
        spinner.kill()
        spinner.wait()


def cold_and_warm(model: Path, dtype: str, work: Path) -> tuple[Start, Start]:
    """A start with no kept plan, then one with the plan that start kept."""
    plan_dir = work / "linear_plans"
    shutil.rmtree(plan_dir, ignore_errors=True)
    cold = start_once(model, dtype, plan_dir, work)
    warm = start_once(model, dtype, plan_dir, work)
    assert cold.probe_seconds is not None, "the cold start did not probe"
    assert warm.probe_seconds is None, "the warm start probed: its plan was not kept"
    return cold, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "dev")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=2, help="cold/warm pairs per row")
    parser.add_argument("--out", type=Path, default=RESULTS / "startup.md")
    args = parser.parse_args()
    model = ensure_model(args.model, "dev") if args.model.name == "dev" else args.model
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]

    rows = []
    with tempfile.TemporaryDirectory(prefix="kvchat-startup-") as tmp:
        work = Path(tmp)
        # The CPU kernels are built once, here, into a directory of this run's own: every start
        # below loads them, none builds them (another checkout's server building into the
        # shared ~/.cache/kvchat/extensions would otherwise show up as a slow start).
        os.environ["KVCHAT_EXTENSIONS_DIR"] = str(work / "extensions")
        begun = time.perf_counter()
        built = load_cpu_ops()
        print(f"CPU kernels built in {time.perf_counter() - begun:.0f} s ({built=})", flush=True)
        for loaded in (False, True):
            for dtype in dtypes:
                colds, warms, probes = [], [], []
                with busy_neighbour(loaded):
                    for _ in range(args.repeats):
                        cold, warm = cold_and_warm(model, dtype, work)
                        colds.append(cold.seconds)
                        warms.append(warm.seconds)
                        probes.append(cold.probe_seconds or 0.0)
                cold_s, warm_s = statistics.median(colds), statistics.median(warms)
                row = [
                    "beside a CPU-bound process" if loaded else "idle",
                    dtype,
                    round(cold_s, 2),
                    round(statistics.median(probes), 2),
                    round(warm_s, 2),
                    f"{cold_s / warm_s:.2f}x",
                ]
                print(" | ".join(str(v) for v in row), flush=True)
                rows.append(row)

    header = [
        "machine",
        "dtype",
        "cold start to /readyz (s)",
        "of which the probe (s)",
        "warm start to /readyz (s)",
        "cold / warm",
    ]
    table = markdown_table(header, rows)
    print(table)
    text = machine_header(
        "Start-up time of kvchat serve, cold vs a kept linear plan (bench/startup.py)",
        {
            "model": f"{model.name} ({model})",
            "server": "kvchat serve --kv-cache-bytes 64MiB --host-cache-bytes 32MiB, SQLite, "
            "a fresh data directory per start",
            "cold": "no kept linear plan: the engine probes the CPU's linear paths and keeps "
            "the result; warm: the next start, loading it",
            "busy": "`python -c 'while True: pass'` beside the server (started 1 s before)",
            "repeats": f"{args.repeats} cold/warm pair(s) per row, medians",
            "CPU kernels": "built once before the starts, in a directory of the run's own",
        },
    )
    args.out.write_text(text + "\n" + table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
