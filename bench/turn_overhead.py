"""What the service adds to a turn, as users hit it: one `kvchat serve` process (the dev model,
SQLite, what `make serve` runs), one conversation of N turns through the REST conversations
API and one through the WebSocket, short replies so the service's share shows. Per turn: the
wall time the client waits, the engine's TTFT and total (the reply's timings), the service's
share (wall - engine total); while the turns run a second client asks /healthz every 20 ms:
its latency is how long the event loop stalls for everyone else.

    python bench/turn_overhead.py [--turns 200] [--model models/dev] [--max-tokens 4]
                                  [--against REV] [--rounds 1]

`--against REV` measures the service at git revision REV too (its code exported from this
repository, served by this venv), in the same run, alternating with this checkout round by
round, and prints each transport's ratios: a change to the service is no slower when they
hold at 1.0 within the noise.

Goals (issue 20): median wall of turns 190-200 <= 1.3x that of turns 5-15; worst /healthz
latency <= 50 ms; the service's share <= 15 ms per turn at turn 200 (median of 190-200).
Writes bench/results/turn_overhead.md and turn_overhead.png."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets
from tqdm import tqdm

from kvchat.bench.common import (
    REPO,
    RESULTS,
    ensure_model,
    machine_header,
    markdown_table,
    serve_command,
)

KEY_LINE = re.compile(r"created an admin API key \(shown once, keep it\): (\S+)")
EARLY = (5, 15)  # 1-based turns the last ten are compared with


@dataclass
class Turn:
    wall_ms: float
    ttft_ms: float
    total_ms: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def service_ms(self) -> float:
        return self.wall_ms - self.total_ms


@dataclass
class Probe:
    """/healthz every `interval` s from its own thread and client, while `running`."""

    url: str
    interval: float = 0.02
    latencies_ms: list[float] = field(default_factory=list)
    running: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.running.set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while self.running.is_set():
                start = time.perf_counter()
                client.get(f"{self.url}/healthz")
                self.latencies_ms.append((time.perf_counter() - start) * 1e3)
                time.sleep(self.interval)

    def stop(self) -> list[float]:
        self.running.clear()
        if self.thread is not None:
            self.thread.join()
        return self.latencies_ms


def start_server(
    model: Path, data: Path, port: int, code: Path | None = None
) -> tuple[subprocess.Popen[str], str]:
    """`kvchat serve` on `port`: this checkout's code, or the tree at `code` (an exported
    revision, put first on the server's path)."""
    env = {
        **os.environ,
        **({"PYTHONPATH": str(code)} if code is not None else {}),
        "KVCHAT_DATA_DIR": str(data),
        "PYTHONUNBUFFERED": "1",
        "KVCHAT_LOG_LEVEL": "warning",
    }
    process = subprocess.Popen(
        serve_command(model, port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO if code is None else code,
    )
    key = None
    assert process.stdout is not None
    for line in process.stdout:
        match = KEY_LINE.search(line)
        if match:
            key = match.group(1)
            break
    if key is None:
        raise RuntimeError("the server printed no key")
    threading.Thread(target=lambda: [None for _ in process.stdout or ()], daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return process, key
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not become ready")


def body(turn: int, max_tokens: int) -> dict[str, object]:
    return {
        "content": f"Question {turn:04d}: what do you make of the weather today?",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def rest_turns(url: str, key: str, turns: int, max_tokens: int) -> list[Turn]:
    headers = {"Authorization": f"Bearer {key}"}
    out = []
    with httpx.Client(timeout=120) as client:
        conv = client.post(
            f"{url}/v1/conversations", headers=headers, json={"system": "You are terse."}
        ).json()["id"]
        for turn in tqdm(range(1, turns + 1), desc="REST turns"):
            start = time.perf_counter()
            r = client.post(
                f"{url}/v1/conversations/{conv}/messages",
                headers=headers,
                json=body(turn, max_tokens),
            )
            wall = (time.perf_counter() - start) * 1e3
            r.raise_for_status()
            reply = r.json()
            out.append(
                Turn(
                    wall,
                    reply["timings"]["ttft_ms"],
                    reply["timings"]["total_ms"],
                    reply["usage"]["prompt_tokens"],
                    reply["usage"]["cached_tokens"],
                )
            )
    return out


async def websocket_turns(url: str, key: str, turns: int, max_tokens: int) -> list[Turn]:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=120) as client:
        conv = (
            await client.post(
                f"{url}/v1/conversations", headers=headers, json={"system": "You are terse."}
            )
        ).json()["id"]
    out = []
    socket_url = url.replace("http", "ws", 1) + f"/v1/conversations/{conv}/ws"
    async with websockets.connect(socket_url, additional_headers=headers) as ws:
        for turn in tqdm(range(1, turns + 1), desc="WebSocket turns"):
            start = time.perf_counter()
            await ws.send(json.dumps({"type": "message", **body(turn, max_tokens)}))
            while (frame := json.loads(await ws.recv()))["type"] not in ("done", "error"):
                pass
            wall = (time.perf_counter() - start) * 1e3
            if frame["type"] == "error":
                raise RuntimeError(f"turn {turn}: {frame}")
            out.append(
                Turn(
                    wall,
                    frame["timings"]["ttft_ms"],
                    frame["timings"]["total_ms"],
                    frame["usage"]["prompt_tokens"],
                    frame["usage"]["cached_tokens"],
                )
            )
    return out


def median(turns: list[Turn], span: tuple[int, int], attr: str) -> float:
    values = [getattr(t, attr) for t in turns[span[0] - 1 : span[1]]]
    return statistics.median(values)


def summarize(name: str, turns: list[Turn], lag: list[float]) -> tuple[list[object], dict]:
    late_span = (max(1, len(turns) - 10), len(turns))
    early = median(turns, EARLY, "wall_ms")
    late = median(turns, late_span, "wall_ms")
    share = median(turns, late_span, "service_ms")
    row = [
        name,
        f"{early:.1f}",
        f"{late:.1f}",
        f"{late / early:.2f}x",
        f"{median(turns, EARLY, 'ttft_ms'):.1f} / {median(turns, late_span, 'ttft_ms'):.1f}",
        f"{median(turns, EARLY, 'service_ms'):.1f}",
        f"{share:.1f}",
        f"{max(lag):.1f}",
        f"{statistics.quantiles(lag, n=100)[98]:.1f}",
        turns[-1].prompt_tokens,
        turns[-1].cached_tokens,
    ]
    return row, {"ratio": late / early, "share": share, "lag": max(lag)}


def plot(results: dict[str, list[Turn]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), sharey=True)
    for ax, (name, turns) in zip(axes, results.items()):
        x = range(1, len(turns) + 1)
        ax.plot(x, [t.wall_ms for t in turns], label="wall (client)", lw=1)
        ax.plot(x, [t.total_ms for t in turns], label="engine total", lw=1)
        ax.plot(x, [t.ttft_ms for t in turns], label="engine TTFT", lw=1)
        ax.plot(x, [t.service_ms for t in turns], label="service share (wall - engine)", lw=1)
        ax.set_title(name)
        ax.set_xlabel("turn")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def git_revision() -> str:
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    # The results this script writes do not count as a change to what it measures.
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", ".", ":!bench/results"]
    ).returncode
    return head + (" with uncommitted changes" if dirty else "")


def export(revision: str, stack: contextlib.ExitStack) -> Path:
    """The tree of `revision`, exported from this repository into a temporary folder."""
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvchat-rev-")))
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def measure(
    args: argparse.Namespace, code: Path | None
) -> tuple[dict[str, list[Turn]], dict[str, list[float]]]:
    """One server (this checkout's code, or `code`), a conversation per transport."""
    from kvchat.bench.serve_rest import free_port

    with tempfile.TemporaryDirectory() as data:
        process, key = start_server(args.model, Path(data), port := free_port(), code)
        url = f"http://127.0.0.1:{port}"
        try:
            results: dict[str, list[Turn]] = {}
            lags: dict[str, list[float]] = {}
            for name in ("REST", "WebSocket"):
                probe = Probe(url)
                probe.start()
                if name == "REST":
                    results[name] = rest_turns(url, key, args.turns, args.max_tokens)
                else:
                    results[name] = asyncio.run(
                        websocket_turns(url, key, args.turns, args.max_tokens)
                    )
                lags[name] = probe.stop()
        finally:
            process.terminate()
            process.wait(60)
    return results, lags


Runs = dict[str, list[tuple[dict[str, list[Turn]], dict[str, list[float]]]]]


def pooled(variant_runs: list[Any], name: str, attr: str, last: int | None = None) -> float:
    """The median of `attr` over transport `name`'s turns in every round (its last turns)."""
    start = -last if last else 0
    return statistics.median(
        getattr(t, attr) for turns, _ in variant_runs for t in turns[name][start:]
    )


def compared(runs: Runs) -> str:
    """Per transport: this checkout's medians over the other revision's, every round pooled."""
    (_, ours), (theirs, other) = runs.items()
    rows = []
    for name in ("REST", "WebSocket"):

        def ratio(attr: str, last: int | None = None, name: str = name) -> str:
            return f"{pooled(ours, name, attr, last) / pooled(other, name, attr, last):.3f}"

        rows.append(
            [
                name,
                ratio("wall_ms"),
                ratio("wall_ms", 10),
                f"{pooled(ours, name, 'service_ms'):.1f} / {pooled(other, name, 'service_ms'):.1f}",
                ratio("total_ms"),
            ]
        )
    table = markdown_table(
        [
            "transport",
            "wall p50, every turn: ours / theirs",
            "wall p50, last 10 turns: ours / theirs",
            "service share p50 (ms): ours / theirs",
            "engine total p50: ours / theirs",
        ],
        rows,
    )
    return f"\nThis checkout against {theirs} (below 1: this checkout is faster):\n\n{table}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "dev")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS / "turn_overhead.md")
    parser.add_argument(
        "--against", help="a git revision whose service is measured too, in the same run"
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds per variant")
    args = parser.parse_args()
    if args.turns < EARLY[1] + 10:
        parser.error(f"--turns must be at least {EARLY[1] + 10}")
    load_start = os.getloadavg()
    ensure_model(args.model, "dev")
    variants: dict[str, Path | None] = {"this checkout": None}
    with contextlib.ExitStack() as stack:
        if args.against:
            variants[args.against] = export(args.against, stack)
        runs: Runs = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant, code in variants.items():
                runs[variant].append(measure(args, code))
    load_end = os.getloadavg()
    # Each variant's last round is the one tabled in full; the ratios use every round.
    results = {
        name if len(variants) == 1 else f"{name} ({variant})": turns
        for variant, variant_runs in runs.items()
        for name, turns in variant_runs[-1][0].items()
    }
    lags = {
        name if len(variants) == 1 else f"{name} ({variant})": lag
        for variant, variant_runs in runs.items()
        for name, lag in variant_runs[-1][1].items()
    }
    load_end = os.getloadavg()
    rows, verdicts = [], {}
    for name, turns in results.items():
        row, verdict = summarize(name, turns, lags[name])
        rows.append(row)
        verdicts[name] = verdict
    header = machine_header(
        "What the service adds to a turn (bench/turn_overhead.py)",
        {
            "server": f"kvchat serve --model {args.model.name} (SQLite, in-process coordination)",
            "turns": f"{args.turns} per transport, {args.max_tokens}-token replies (greedy, "
            "ignore_eos), one conversation each",
            **(
                {
                    "compared": f"this checkout ({git_revision()}) and {args.against}, "
                    f"{args.rounds} round(s) each, alternating"
                }
                if args.against
                else {}
            ),
        },
        load_start=load_start,
        load_end=load_end,
    )
    table = markdown_table(
        [
            "transport",
            f"wall p50 turns {EARLY[0]}-{EARLY[1]} (ms)",
            "wall p50 last 10 turns (ms)",
            "ratio",
            "engine TTFT p50 early / late (ms)",
            "service share early (ms)",
            "service share late (ms)",
            "worst /healthz (ms)",
            "p99 /healthz (ms)",
            "prompt tokens at the last turn",
            "cached at the last turn",
        ],
        rows,
    )
    goals = []
    for name, v in verdicts.items():
        goals.append(
            f"- {name}: late/early wall {v['ratio']:.2f}x (goal <= 1.3x: "
            f"{'met' if v['ratio'] <= 1.3 else 'not met'}); service share "
            f"{v['share']:.1f} ms (goal <= 15 ms: "
            f"{'met' if v['share'] <= 15 else 'not met'}); worst /healthz "
            f"{v['lag']:.1f} ms (goal <= 50 ms: {'met' if v['lag'] <= 50 else 'not met'})"
        )
    text = (
        header
        + "\n"
        + table
        + "\n"
        + "\n".join(goals)
        + "\n"
        + (compared(runs) if args.against else "")
        + "\n\n"
        + (
            "The service's share is the client's wall time minus the engine's total for the "
            "reply (from its creation to its last token): planning, rendering, storing, HTTP or "
            "the WebSocket frame. /healthz is asked every 20 ms by another client while the "
            "turns run; its latency includes loopback HTTP (about a millisecond).\n\n"
            "![per turn](turn_overhead.png)\n"
        )
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    plot(results, args.out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
