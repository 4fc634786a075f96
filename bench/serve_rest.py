"""The REST service against the engine alone, on the same agent-style load, in one run:
N concurrent loops, each a multi-turn conversation that resends its whole history to
POST /v1/chat/completions (streamed), with X-Session-Id on and off. The engine alone runs the
same prompts (same template, replies spliced back by their ids) through AsyncEngine in this
process; the service runs as a real `kvchat serve` process driven over loopback.

    python bench/serve_rest.py [--loops 8] [--turns 6] [--model models/bench]

Reports TTFT p50/p99, tokens/s delivered by the service vs the engine's own tokens/s on the
same load, the cached-token fraction and errors; writes bench/results/serve_rest.md and
serve_rest.png."""

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
from tqdm import tqdm

from kvchat.bench.common import (
    REPO,
    RESULTS,
    ensure_model,
    machine_header,
    markdown_table,
    serve_command,
)

WORDS = [
    "river",
    "lantern",
    "copper",
    "orbit",
    "maple",
    "quartz",
    "harbor",
    "summit",
    "willow",
    "kettle",
    "velvet",
    "tundra",
    "how",
    "why",
    "when",
    "what",
    "does",
    "the",
    "a",
    "of",
    "to",
    "in",
    "and",
    "is",
    "it",
    "for",
    "on",
    "with",
]
SYSTEM = "You are a helpful agent. Keep answers short and precise."


@dataclass
class Load:
    loops: int
    turns: int
    reply_tokens: int
    seed: int = 0

    def user_messages(self, loop: int) -> list[str]:
        rng = random.Random(self.seed * 1000 + loop)
        return [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 40)))
            for _ in range(self.turns)
        ]


@dataclass
class Run:
    name: str
    ttft: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    wall: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.wall if self.wall else 0.0

    def merge(self, other: Run) -> None:
        self.ttft += other.ttft
        self.completion_tokens += other.completion_tokens
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.errors += other.errors
        self.wall += other.wall


# -- the engine alone ----------------------------------------------------------------------------


async def run_engine(model: Path, load: Load, sessions: bool, bar: tqdm) -> Run:
    from kvchat.app.settings import Settings
    from kvchat.inference.engine.async_engine import AsyncEngine
    from kvchat.inference.model.sampling_params import SamplingParams
    from kvchat.inference.text.chat_template import ChatMessage, load_chat_template

    # Built on its own thread, as the server builds it (inference/engine/thread.py)
    runner = AsyncEngine.build(Settings(model=model, dtype="bfloat16", seed=0).engine_config())
    engine = runner.engine
    assert engine.tokenizer is not None
    template = load_chat_template(model, engine.tokenizer)
    runner.start()
    run = Run(f"engine alone, sessions {'on' if sessions else 'off'}")
    params = SamplingParams(max_tokens=load.reply_tokens, temperature=0.0, ignore_eos=True)

    async def loop(i: int) -> None:
        history = [ChatMessage("system", SYSTEM)]
        for turn, text in enumerate(load.user_messages(i)):
            history.append(ChatMessage("user", text))
            prompt = template.render_ids(history)
            sent = time.perf_counter()
            first = None
            request = engine.check_request(prompt, params, session_id=f"s{i}" if sessions else None)
            async for out in runner.generate(f"e{i}-{turn}-{sessions}", request):
                if first is None and out.new_text:  # visible text, as the service's chunks
                    first = time.perf_counter()
                if out.finished:
                    run.ttft.append((first or time.perf_counter()) - sent)
                    run.completion_tokens += out.num_output_tokens
                    run.prompt_tokens += out.num_prompt_tokens
                    run.cached_tokens += out.num_cached_tokens
                    # As the service does: replies spliced back by their ids within a
                    # session; re-tokenized from their text without one.
                    history.append(
                        ChatMessage("assistant", None, token_ids=tuple(out.output_token_ids or ()))
                        if sessions
                        else ChatMessage("assistant", out.text or "")
                    )
            bar.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(load.loops)))
    run.wall = time.perf_counter() - start
    await asyncio.to_thread(runner.shutdown, 1.0)
    return run


# -- the service -----------------------------------------------------------------------------------


def start_server(model: Path, data_dir: Path, port: int) -> tuple[subprocess.Popen[str], str]:
    env = {
        **os.environ,
        "KVCHAT_DATA_DIR": str(data_dir),
        "KVCHAT_DTYPE": "bfloat16",
        "KVCHAT_SEED": "0",
        "KVCHAT_LOG_LEVEL": "warning",
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        serve_command(model, port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    key = None
    assert proc.stdout is not None
    for line in proc.stdout:  # the key is printed once the app has started
        if "created an admin API key" in line:
            key = line.rsplit(" ", 1)[-1].strip()
            break
    # Keep reading what the server prints, so its pipe never fills up and blocks it.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    assert key, "the server printed no key"
    return proc, key


async def run_service(
    url: str, key: str, model_name: str, load: Load, sessions: bool, bar: tqdm
) -> Run:
    run = Run(f"service, X-Session-Id {'on' if sessions else 'off'}")
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=load.loops * 2)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=600, limits=limits
    ) as client:

        async def loop(i: int) -> None:
            messages: list[dict[str, object]] = [{"role": "system", "content": SYSTEM}]
            extra = {"X-Session-Id": f"loop-{i}"} if sessions else {}
            for text in load.user_messages(i):
                messages.append({"role": "user", "content": text})
                body = {
                    "model": model_name,
                    "messages": messages,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "temperature": 0,
                    "max_tokens": load.reply_tokens,
                    "ignore_eos": True,
                }
                sent = time.perf_counter()
                first, content, usage = None, "", None
                try:
                    async with client.stream(
                        "POST", "/v1/chat/completions", json=body, headers=extra
                    ) as r:
                        if r.status_code != 200:
                            run.errors.append(f"{r.status_code}: {await r.aread()!r}")
                            return
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                run.errors.append(str(chunk["error"]))
                                return
                            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                                first = first or time.perf_counter()
                                content += chunk["choices"][0]["delta"]["content"]
                            if chunk.get("usage"):
                                usage = chunk["usage"]
                except httpx.HTTPError as e:
                    run.errors.append(repr(e))
                    return
                run.ttft.append((first or time.perf_counter()) - sent)
                assert usage is not None
                run.completion_tokens += usage["completion_tokens"]
                run.prompt_tokens += usage["prompt_tokens"]
                run.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                messages.append({"role": "assistant", "content": content})
                bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in range(load.loops)))
        run.wall = time.perf_counter() - start
    return run


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of the four variants, interleaved (each with a fresh engine "
        "and a fresh server)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "serve_rest.md")
    args = ap.parse_args()
    model = ensure_model(args.model, "bench")
    names = [
        "engine alone, sessions on",
        "engine alone, sessions off",
        "service, X-Session-Id on",
        "service, X-Session-Id off",
    ]
    merged = {name: Run(name) for name in names}
    per_round: list[tuple[float, float]] = []
    total = args.loops * args.turns
    with tqdm(total=4 * total * args.rounds, desc="turns") as bar:
        for r in range(args.rounds):
            # Fresh messages each round and each sessions setting (so no run finds another's
            # conversations in the prefix cache); the engine and the service get the same ones.
            loads = {
                on: Load(args.loops, args.turns, args.reply_tokens, seed=2 * r + (not on))
                for on in (True, False)
            }
            runs = [asyncio.run(run_engine(model, loads[on], on, bar)) for on in (True, False)]
            port = free_port()
            with tempfile.TemporaryDirectory() as data:
                proc, key = start_server(model, Path(data), port)
                try:
                    url = f"http://127.0.0.1:{port}"
                    runs += [
                        asyncio.run(run_service(url, key, model.name, loads[on], on, bar))
                        for on in (True, False)
                    ]
                finally:
                    proc.terminate()
                    proc.wait(60)
            for run in runs:
                merged[run.name].merge(run)
            per_round.append(
                (
                    runs[2].tokens_per_second / runs[0].tokens_per_second,
                    runs[3].tokens_per_second / runs[1].tokens_per_second,
                )
            )
    load = Load(args.loops, args.turns, args.reply_tokens)
    runs = [merged[name] for name in names]
    engine_on, engine_off, service_on, service_off = runs
    rows = [
        [
            r.name,
            f"{percentile(r.ttft, 50) * 1e3:.0f}" if r.ttft else "-",
            f"{percentile(r.ttft, 99) * 1e3:.0f}" if r.ttft else "-",
            f"{r.tokens_per_second:.1f}",
            f"{r.cached_tokens / max(1, r.prompt_tokens):.3f}",
            len(r.errors),
            f"{r.wall:.0f}",
        ]
        for r in runs
    ]
    ratio_on = service_on.tokens_per_second / engine_on.tokens_per_second
    ratio_off = service_off.tokens_per_second / engine_off.tokens_per_second
    errors = sum(len(r.errors) for r in runs)
    report = machine_header(
        "REST service vs the engine alone, agent-style load",
        {
            "model": f"{model.name} preset, bfloat16",
            "load": f"{load.loops} concurrent loops x {load.turns} turns, whole history resent "
            f"each turn, {load.reply_tokens} greedy tokens per reply, streamed; "
            f"{args.rounds} rounds of the four variants interleaved, each run with a fresh "
            "engine / server; figures pooled over the rounds",
            "command": "python bench/serve_rest.py",
        },
    )
    report += "\n" + markdown_table(
        [
            "variant",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "tokens/s delivered",
            "cached fraction",
            "errors",
            "wall s",
        ],
        rows,
    )
    report += (
        f"\nService tokens/s as a share of the engine's on the same load: "
        f"{ratio_on:.2f} with X-Session-Id, {ratio_off:.2f} without (goal >= 0.90); "
        f"errors: {errors} (goal 0).\n\nPer round (service / engine tokens/s, with and "
        f"without X-Session-Id): " + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in per_round) + ".\n"
    )
    for each in runs:
        for e in each.errors[:3]:
            report += f"\n- {each.name}: {e}"
    report += "\n\n![tokens/s](serve_rest.png)\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    plot(runs, args.out.with_suffix(".png"))


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r.name.replace(", ", "\n") for r in runs]
    left.bar(names, [r.tokens_per_second for r in runs], color=["C0", "C0", "C1", "C1"])
    left.set_ylabel("tokens/s delivered")
    right.bar(
        names,
        [statistics.median(r.ttft) * 1e3 if r.ttft else 0 for r in runs],
        color=["C0", "C0", "C1", "C1"],
    )
    right.set_ylabel("median TTFT (ms)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
