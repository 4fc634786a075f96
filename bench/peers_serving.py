"""Serving against a peer: multi-round chat at a fixed request rate, `kvchat serve` against
llama.cpp's own `llama-server` on the same weights, one server at a time, the same threads.

    pip install -e ".[peers]" && python bench/peers_serving.py

The workload has the shape of vLLM production-stack's multi-round QA benchmark: U users, each
with R rounds; every request carries a shared system prompt, the user's whole history and a
new question, and asks for a short greedy answer (ignore_eos, so both servers generate the same
number of tokens). Requests start on a fixed schedule, `rate` per second over all users (user
u's round r at (r * U + u) / rate), or as soon as the user's previous answer is in, if later:
a server that keeps up serves `rate` requests per second; one that does not falls behind and
its queue grows, its answers come later than each user's next slot and the rounds start
later and later. The rate is stepped up until a server stops keeping up (served < 90% of
offered, or the last round starting more than half a user's interval behind the schedule);
the knee is the highest rate it sustained. (TTFT itself grows with the rounds at any rate,
as each round resends a longer history, so it is no measure of the queue.)

Both are driven through the same OpenAI Chat Completions client code (httpx, streaming, usage
in the last chunk). llama-server runs with several slots, its prompt cache (`--cache-ram`),
`--cache-reuse` and ChatML; kvchat with its defaults (prefix cache; no X-Session-Id, as a plain
OpenAI client sends none). The GGUF is llama.cpp's own conversion of the bench model
(bench/gguf_export.py), in the type kvchat serves (by default the half-precision type the
CPU runs natively: bfloat16 with AVX512-BF16 or AMX, else float16). The llama-server build
and the GGUF files are cached under models/.peers.

Writes bench/results/peers_serving.md and peers_serving.png."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

from kvchat.bench.common import (
    REPO,
    RESULTS,
    ensure_model,
    machine_header,
    markdown_table,
    serve_command,
)
from kvchat.bench.llama_server import CACHE, PACKAGE, VERSION, free_port, server_binary, wait_ready

GGUF_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
WORDS = (
    "the",
    "model",
    "keeps",
    "each",
    "conversation",
    "cache",
    "pinned",
    "between",
    "turns",
    "so",
    "next",
    "turn",
    "prefills",
    "only",
    "what",
    "is",
    "new",
    "while",
    "shared",
    "system",
    "prompt",
    "computed",
    "once",
    "for",
    "all",
    "users",
    "of",
    "service",
    "and",
    "short",
    "answers",
    "stream",
    "back",
    "river",
    "mountain",
    "lantern",
    "copper",
    "violet",
    "harbor",
    "meadow",
    "signal",
    "quartz",
    "ember",
    "canyon",
    "orbit",
    "saddle",
    "timber",
    "walnut",
    "falcon",
    "glacier",
    "pepper",
    "marble",
    "thistle",
)


@dataclass(frozen=True)
class Workload:
    users: int
    rounds: int
    system_words: int
    question_words: int
    answer_tokens: int
    seed: int = 0

    def system_prompt(self) -> str:
        rng = random.Random(self.seed)
        return "You are a helpful assistant. " + " ".join(
            rng.choice(WORDS) for _ in range(self.system_words)
        )

    def question(self, user: int, round_: int) -> str:
        rng = random.Random(self.seed * 1_000_003 + user * 1009 + round_)
        return (
            f"User {user}, question {round_}: "
            + " ".join(rng.choice(WORDS) for _ in range(self.question_words))
            + "?"
        )


@dataclass
class Turn:
    user: int
    round: int  # 1-based
    scheduled: float
    sent: float = 0.0
    ttft: float = 0.0
    done: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class RateRun:
    server: str
    rate: float
    turns: list[Turn] = field(default_factory=list)

    @property
    def ok(self) -> list[Turn]:
        return [t for t in self.turns if t.error is None]

    @property
    def served_rate(self) -> float:
        ok = self.ok
        if len(ok) < 2:
            return 0.0
        span = max(t.done for t in ok) - min(t.sent for t in ok)
        return len(ok) / span if span > 0 else 0.0

    def ttft(self, q: float, rounds: set[int] | None = None) -> float:
        values = [t.ttft for t in self.ok if rounds is None or t.round in rounds]
        return quantile(values, q)

    @property
    def user_interval(self) -> float:
        """Seconds between one user's rounds on the schedule (users / rate)."""
        users = len({t.user for t in self.turns})
        return users / self.rate

    @property
    def behind(self) -> float:
        """How late the last round's requests started against the schedule (p50, seconds).
        Each user sends its next round when the schedule says, or when its previous answer is
        in: a server that keeps up is answered before each user's next slot and every request
        starts on time, whatever its TTFT grows to with the history; one whose queue grows
        answers later and later, so each round starts later than the one before."""
        ok = self.ok
        if not ok:
            return float("nan")
        last = max(t.round for t in ok)
        return statistics.median(t.sent - t.scheduled for t in ok if t.round == last)

    @property
    def sustained(self) -> bool:
        """Every request answered, served >= 90% of the offered rate, and the last round less
        than half a user's interval behind the schedule (the queue is not growing)."""
        return (
            len(self.ok) == len(self.turns)
            and self.served_rate >= 0.9 * self.rate
            and self.behind <= 0.5 * self.user_interval
        )


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- the client ------------------------------------------------------------------------------


async def run_rate(
    url: str,
    headers: dict[str, str],
    model: str,
    workload: Workload,
    rate: float,
    server: str,
    bar: tqdm,
) -> RateRun:
    run = RateRun(server, rate)
    system = workload.system_prompt()
    start = time.perf_counter() + 0.5
    limits = httpx.Limits(max_connections=workload.users * 2)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=900, limits=limits
    ) as client:

        async def user_loop(user: int) -> None:
            messages: list[dict[str, str]] = [{"role": "system", "content": system}]
            for r in range(workload.rounds):
                turn = Turn(user, r + 1, start + (r * workload.users + user) / rate)
                run.turns.append(turn)
                await asyncio.sleep(max(0.0, turn.scheduled - time.perf_counter()))
                messages.append({"role": "user", "content": workload.question(user, r)})
                answer = await chat(client, model, messages, workload.answer_tokens, turn)
                bar.update(1)
                if turn.error is not None:
                    return
                messages.append({"role": "assistant", "content": answer})

        await asyncio.gather(*(user_loop(u) for u in range(workload.users)))
    return run


async def chat(
    client: httpx.AsyncClient,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    turn: Turn,
) -> str:
    body = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    parts: list[str] = []
    turn.sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                turn.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if not parts:
                            turn.ttft = time.perf_counter() - turn.sent
                        parts.append(text)
                usage = chunk.get("usage")
                if usage:
                    turn.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    turn.completion_tokens = int(usage.get("completion_tokens", 0))
                    details = usage.get("prompt_tokens_details") or {}
                    turn.cached_tokens = int(details.get("cached_tokens") or 0)
    except httpx.HTTPError as e:
        turn.error = f"{type(e).__name__}: {e}"
        return ""
    turn.done = time.perf_counter()
    if not parts:
        turn.error = "no content"
    return "".join(parts)


# -- the servers -----------------------------------------------------------------------------


class Server:
    name: str
    url: str
    model: str
    headers: dict[str, str]
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class KVChatServer(Server):
    def __init__(self, model_dir: Path, dtype: str, threads: int, data_dir: Path) -> None:
        port = free_port()
        self.name, self.url, self.model = "kvchat", f"http://127.0.0.1:{port}", model_dir.name
        env = {
            **os.environ,
            "KVCHAT_DATA_DIR": str(data_dir),
            "KVCHAT_DTYPE": dtype,
            "KVCHAT_SEED": "0",
            "KVCHAT_LOG_LEVEL": "warning",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(threads),
        }
        self.proc = subprocess.Popen(
            serve_command(model_dir, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        key = None
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:  # the key is printed once the app has started
            line = raw.decode(errors="replace")
            if "created an admin API key" in line:
                key = line.rsplit(" ", 1)[-1].strip()
                break
        if key is None:
            raise RuntimeError(f"kvchat serve exited ({self.proc.poll()}) before printing a key")
        threading.Thread(
            target=lambda: [None for _ in self.proc.stdout],  # type: ignore[union-attr]
            daemon=True,
        ).start()
        self.headers = {"Authorization": f"Bearer {key}"}
        wait_ready(f"{self.url}/readyz", self.proc)


class LlamaServer(Server):
    def __init__(
        self, binary: Path, gguf: Path, threads: int, slots: int, ctx: int, kv_type: str
    ) -> None:
        port = free_port()
        self.name, self.url, self.model = "llama-server", f"http://127.0.0.1:{port}", gguf.stem
        self.headers = {}
        self.args = [
            str(binary),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(ctx),
            "-np",
            str(slots),
            "--cache-reuse",
            "256",
            "--cache-ram",
            "4096",
            "--chat-template",
            "chatml",
            "-ctk",
            kv_type,
            "-ctv",
            kv_type,
            "--no-webui",
            "--log-disable",
        ]
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_ready(f"{self.url}/health", self.proc)


# -- the run ---------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *GGUF_TYPES],
        help="the weights' type in both servers (auto: the half-precision type "
        "this CPU runs natively, as bench/peers.py chooses)",
    )
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=200)
    ap.add_argument("--question-words", type=int, default=40)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument(
        "--rates",
        default="0.2,0.4,0.8,1.2,1.6,2.4,3.2,4.8",
        help="offered request rates (req/s), stepped up in this order",
    )
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--slots", type=int, default=4, help="llama-server's parallel slots")
    ap.add_argument("--out", type=Path, default=RESULTS / "peers_serving.md")
    args = ap.parse_args()
    if args.dtype == "auto":
        from kvchat.bench.peers import native_half

        args.dtype = native_half()

    from kvchat.bench.gguf_export import gguf_files

    load_start, started = os.getloadavg(), time.gmtime()
    model_dir = ensure_model(args.model, "bench")
    gguf = gguf_files(model_dir, CACHE, PACKAGE, VERSION, (GGUF_TYPES[args.dtype],))[
        GGUF_TYPES[args.dtype]
    ]
    binary = server_binary()
    workload = Workload(
        args.users, args.rounds, args.system_words, args.question_words, args.answer_tokens
    )
    rates = [float(r) for r in args.rates.split(",")]
    ctx = 16384
    runs: dict[str, list[RateRun]] = {"kvchat": [], "llama-server": []}
    total = len(rates) * workload.users * workload.rounds * 2
    with (
        tqdm(total=total, desc="requests", unit="req") as bar,
        tempfile.TemporaryDirectory(prefix="kvchat-peers-serving-") as tmp,
    ):
        starters = {
            "kvchat": lambda i: KVChatServer(
                model_dir, args.dtype, args.threads, Path(tmp) / f"data-{i}"
            ),
            "llama-server": lambda i: LlamaServer(
                binary,
                gguf,
                args.threads,
                args.slots,
                ctx,
                GGUF_TYPES[args.dtype] if args.dtype != "float32" else "f16",
            ),
        }
        # Rates interleaved: at each rate, each server in turn on a fresh process (empty
        # caches), alternating which goes first; a server is dropped a rate after it stopped
        # keeping up.
        stopped: set[str] = set()
        for i, rate in enumerate(rates):
            order = list(starters) if i % 2 == 0 else list(reversed(starters))
            for name in order:
                if name in stopped:
                    bar.update(workload.users * workload.rounds)
                    continue
                server = starters[name](i)
                try:
                    run = asyncio.run(
                        run_rate(
                            server.url, server.headers, server.model, workload, rate, name, bar
                        )
                    )
                finally:
                    server.stop()
                runs[name].append(run)
                if not run.sustained and sum(not r.sustained for r in runs[name]) >= 2:
                    stopped.add(name)
            if len(stopped) == len(starters):
                bar.update(bar.total - bar.n)
                break
    load_end = os.getloadavg()
    report = build_report(args, workload, runs, load_start, load_end, started, gguf)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    plot(runs, args.out.with_suffix(".png"))
    return 0


def knee(runs: list[RateRun]) -> float:
    """The highest offered rate sustained below the first one that was not."""
    best = 0.0
    for run in sorted(runs, key=lambda r: r.rate):
        if not run.sustained:
            break
        best = run.rate
    return best


def build_report(
    args: argparse.Namespace,
    workload: Workload,
    runs: dict[str, list[RateRun]],
    load_start: tuple[float, float, float],
    load_end: tuple[float, float, float],
    started: time.struct_time,
    gguf: Path,
) -> str:
    header = machine_header(
        "Serving against llama-server: multi-round chat at a fixed request rate",
        {
            "model": f"bench preset ({args.model.name}), {args.dtype}; llama-server on "
            f"{gguf.name} (llama.cpp's own conversion of the same weights)",
            "workload": f"{workload.users} users x {workload.rounds} rounds; shared system "
            f"prompt of {workload.system_words} words, {workload.question_words}-"
            f"word questions, whole history resent, {workload.answer_tokens} greedy "
            "answer tokens (ignore_eos)",
            "kvchat": "kvchat serve, defaults (prefix cache, no X-Session-Id)",
            "llama-server": f"{PACKAGE} {VERSION}'s llama.cpp, -np {args.slots}, --cache-reuse "
            f"256, --cache-ram 4096, ChatML, {args.threads} threads",
            "command": "python bench/peers_serving.py",
        },
        started=started,
        load_start=load_start,
        load_end=load_end,
    )
    rows = []
    for name, server_runs in runs.items():
        for run in server_runs:
            ok = run.ok
            sent = sum(t.prompt_tokens for t in ok)
            computed = sum(t.prompt_tokens - t.cached_tokens for t in ok)
            rows.append(
                [
                    name,
                    f"{run.rate:g}",
                    f"{run.served_rate:.2f}",
                    f"{len(ok)}/{len(run.turns)}",
                    f"{run.ttft(0.5, {1}) * 1e3:.0f}",
                    f"{run.ttft(0.5, set(range(2, 99))) * 1e3:.0f}",
                    f"{run.ttft(0.9, set(range(2, 99))) * 1e3:.0f}",
                    f"{run.behind:.2f}",
                    f"{computed:,} / {sent:,}",
                    "yes" if run.sustained else "no",
                ]
            )
    table = markdown_table(
        [
            "server",
            "offered req/s",
            "served req/s",
            "ok",
            "TTFT p50 round 1 ms",
            "TTFT p50 rounds >= 2 ms",
            "TTFT p90 rounds >= 2 ms",
            "last round behind s",
            "prompt tokens computed / sent",
            "sustained",
        ],
        rows,
    )
    by_round_rows = []
    for name, server_runs in runs.items():
        for run in server_runs:
            by_round_rows.append(
                [name, f"{run.rate:g}"]
                + [
                    f"{run.ttft(0.5, {r}) * 1e3:.0f} / {run.ttft(0.9, {r}) * 1e3:.0f}"
                    for r in range(1, workload.rounds + 1)
                ]
            )
    by_round = markdown_table(
        ["server", "offered req/s"] + [f"round {r}" for r in range(1, workload.rounds + 1)],
        by_round_rows,
    )
    knees = {name: knee(server_runs) for name, server_runs in runs.items()}
    both = [
        r
        for r in (run.rate for run in runs["kvchat"] if run.sustained)
        if any(o.rate == r and o.sustained for o in runs["llama-server"])
    ]
    goals = []
    if both:
        rate = max(r for r in both if r <= 0.4) if any(r <= 0.4 for r in both) else min(both)
        mine = next(r for r in runs["kvchat"] if r.rate == rate)
        theirs = next(r for r in runs["llama-server"] if r.rate == rate)
        late = set(range(2, workload.rounds + 1))
        ratio = mine.ttft(0.5, late) / theirs.ttft(0.5, late)
        goals.append(
            [
                f"TTFT p50 at rounds >= 2, kvchat / llama-server, at {rate:g} req/s",
                f"{ratio:.2f}x",
                "<= 0.3x",
            ]
        )
    # A server that kept up at every rate it was sent has its knee above the last one: the
    # figure is a lower bound (">=").
    bound = {
        name: ">= " if all(r.sustained for r in server_runs) else ""
        for name, server_runs in runs.items()
    }
    if knees["llama-server"] and not bound["llama-server"]:
        ratio_text = f"{bound['kvchat']}{knees['kvchat'] / knees['llama-server']:.2f}x"
    else:
        ratio_text = (
            "not established (llama-server's knee not found)"
            if knees["llama-server"]
            else "not established (llama-server sustained no rate)"
        )
    goals.append(
        [
            "knee (highest sustained req/s), kvchat / llama-server",
            f"{bound['kvchat']}{knees['kvchat']:g} / {bound['llama-server']}"
            f"{knees['llama-server']:g}: {ratio_text}",
            ">= 2x",
        ]
    )
    return (
        header + "\nSustained: every request answered, served >= 90% of the offered rate, and the "
        "last round's requests started (p50) less than half a user's interval (users / rate) "
        "behind the schedule: the queue is not growing. Each "
        "server runs on a fresh process at each rate; prompt tokens computed = prompt "
        "tokens - cached tokens, as each server's usage reports them.\n\n"
        + "## By offered rate\n\n"
        + table
        + "\n## TTFT by round, p50 / p90 (ms)\n\n"
        + by_round
        + "\n## Goals\n\n"
        + markdown_table(["measure", "measured", "goal"], goals)
        + "\n![served rate and TTFT against offered rate](peers_serving.png)\n"
    )


def plot(runs: dict[str, list[RateRun]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"kvchat": "#2a7ab9", "llama-server": "#999999"}
    for name, server_runs in runs.items():
        rates = [r.rate for r in server_runs]
        a.plot(rates, [r.served_rate for r in server_runs], "o-", color=colors[name], label=name)
        b.plot(
            rates,
            [r.ttft(0.5, set(range(2, 99))) * 1e3 for r in server_runs],
            "o-",
            color=colors[name],
            label=name,
        )
    top = max((r.rate for rs in runs.values() for r in rs), default=1.0)
    a.plot([0, top], [0, top], ":", color="#cccccc", label="served = offered")
    a.set_xlabel("offered requests/s")
    a.set_ylabel("served requests/s")
    a.legend()
    b.set_xlabel("offered requests/s")
    b.set_ylabel("TTFT p50, rounds >= 2 (ms)")
    b.set_yscale("log")
    b.legend()
    fig.suptitle("multi-round chat on the bench model, CPU: kvchat vs llama-server")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
