"""WebSocket conversations against the engine alone, on the same load, in one run: N
concurrent conversations over loopback (multi-turn, think time between turns, some replies
stopped mid-way, some sockets dropped and the reply resumed from the last offset seen), on a
started `kvchat serve`; the engine alone runs the same turns (same prompts, same stops)
through AsyncEngine in this process.

    python bench/serve_ws.py [--conversations 8] [--turns 5] [--model models/bench]

Reports TTFT and inter-token latency p50/p99, tokens/s delivered vs the engine's own, stops
honoured within one step, characters lost or repeated across resumes, errors; writes
bench/results/serve_ws.md and serve_ws.png."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import websockets
from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.bench.serve_rest import WORDS, free_port, percentile, start_server

SYSTEM = "You are a helpful assistant in a chat window."


@dataclass(frozen=True)
class Turn:
    text: str
    think: float  # seconds before sending it
    stop_after: int | None  # deltas after which the client presses stop
    drop_after: int | None  # deltas after which the socket drops (then resume)


@dataclass
class Load:
    conversations: int
    turns: int
    reply_tokens: int
    seed: int = 0

    def script(self, conversation: int) -> list[Turn]:
        rng = random.Random(self.seed * 7919 + conversation)
        turns = []
        for _ in range(self.turns):
            kind = rng.random()
            turns.append(
                Turn(
                    text=" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 30))),
                    think=rng.uniform(0.2, 1.0),
                    stop_after=rng.randint(4, 12) if kind < 0.2 else None,
                    drop_after=rng.randint(3, 10) if 0.2 <= kind < 0.4 else None,
                )
            )
        return turns


@dataclass
class Run:
    name: str
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    stops: int = 0
    stops_late: int = 0  # more than one step's tokens after the stop frame
    resumes: int = 0
    resume_mismatches: int = 0  # characters lost or repeated (text != stored)
    errors: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0

    def merge(self, other: Run) -> None:
        for name in ("ttft", "itl", "errors"):
            getattr(self, name).extend(getattr(other, name))
        for name in ("tokens", "wall", "stops", "stops_late", "resumes", "resume_mismatches"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


async def run_engine(model: Path, load: Load, bar: tqdm) -> Run:
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
    run = Run("engine alone")
    params = SamplingParams(max_tokens=load.reply_tokens, temperature=0.0, ignore_eos=True)

    async def conversation(i: int) -> None:
        history = [ChatMessage("system", SYSTEM)]
        for t, turn in enumerate(load.script(i)):
            await asyncio.sleep(turn.think)
            history.append(ChatMessage("user", turn.text))
            sent = time.perf_counter()
            last = None
            ids: list[int] = []
            request = engine.check_request(template.render_ids(history), params, session_id=f"s{i}")
            async for out in runner.generate(f"c{i}-{t}", request):
                now = time.perf_counter()
                ids += out.new_token_ids
                if out.new_text:  # timed at visible text, as the service's delta frames are
                    if last is None:
                        run.ttft.append(now - sent)
                    else:
                        run.itl.append(now - last)
                    last = now
                if turn.stop_after is not None and len(ids) >= turn.stop_after:
                    break  # the consumer leaving aborts the request, like a stop
            run.tokens += len(ids)
            history.append(ChatMessage("assistant", None, token_ids=tuple(ids)))
            bar.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(conversation(i) for i in range(load.conversations)))
    run.wall = time.perf_counter() - start
    await asyncio.to_thread(runner.shutdown, 1.0)
    return run


async def run_service(url: str, key: str, load: Load, bar: tqdm) -> Run:
    run = Run("service over WebSocket")
    headers = {"Authorization": f"Bearer {key}"}
    ws_base = url.replace("http", "ws", 1)

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:

        async def conversation(i: int) -> None:
            r = await http.post("/v1/conversations", json={"system": SYSTEM})
            conv = r.json()["id"]
            socket_url = f"{ws_base}/v1/conversations/{conv}/ws"
            ws = await websockets.connect(socket_url, additional_headers=headers)
            try:
                for turn in load.script(i):
                    await asyncio.sleep(turn.think)
                    ws = await one_turn(http, ws, socket_url, headers, conv, turn)
                    bar.update(1)
            except Exception as e:  # a benchmark counts failures, it does not stop on them
                run.errors.append(repr(e))
            finally:
                await ws.close()

        async def one_turn(
            http: httpx.AsyncClient,
            ws: websockets.ClientConnection,
            socket_url: str,
            headers: dict[str, str],
            conv: str,
            turn: Turn,
        ) -> websockets.ClientConnection:
            await ws.send(
                json.dumps(
                    {
                        "type": "message",
                        "content": turn.text,
                        "temperature": 0,
                        "max_tokens": load.reply_tokens,
                        "ignore_eos": True,
                    }
                )
            )
            sent = time.perf_counter()
            text, message_id, deltas, last, after_stop = "", None, 0, None, None
            while True:
                frame = json.loads(await ws.recv())
                kind = frame["type"]
                if kind == "start":
                    message_id = frame["message_id"]
                elif kind == "delta":
                    now = time.perf_counter()
                    if frame["offset"] != len(text):
                        run.resume_mismatches += abs(frame["offset"] - len(text))
                    text = text[: frame["offset"]] + frame["text"]
                    if last is None:
                        run.ttft.append(now - sent)
                    else:
                        run.itl.append(now - last)
                    last = now
                    deltas += 1
                    if after_stop is not None:
                        after_stop += 1
                    if turn.stop_after is not None and deltas == turn.stop_after:
                        await ws.send(json.dumps({"type": "stop"}))
                        run.stops += 1
                        after_stop = 0
                    if turn.drop_after is not None and deltas == turn.drop_after:
                        await ws.close()  # the network drops; come back and resume
                        ws = await websockets.connect(socket_url, additional_headers=headers)
                        await ws.send(
                            json.dumps(
                                {"type": "resume", "message_id": message_id, "offset": len(text)}
                            )
                        )
                        run.resumes += 1
                elif kind == "done":
                    run.tokens += frame["usage"]["completion_tokens"]
                    if after_stop is not None and after_stop > 2:
                        run.stops_late += 1
                    break
                elif kind == "error":
                    run.errors.append(f"{frame['code']}: {frame['message']}")
                    return ws
            if turn.drop_after is not None:
                stored = (await http.get(f"/v1/conversations/{conv}/messages")).json()["data"]
                if stored[-1]["content"] != text:
                    run.resume_mismatches += max(
                        1, abs(len(stored[-1]["content"] or "") - len(text))
                    )
            return ws

        start = time.perf_counter()
        await asyncio.gather(*(conversation(i) for i in range(load.conversations)))
        run.wall = time.perf_counter() - start
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of engine alone then service, each with a fresh engine / server",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "serve_ws.md")
    args = ap.parse_args()
    model = ensure_model(args.model, "bench")
    engine, service = Run("engine alone"), Run("service over WebSocket")
    per_round: list[float] = []
    total = args.conversations * args.turns
    with tqdm(total=2 * total * args.rounds, desc="turns") as bar:
        for r in range(args.rounds):
            # Fresh conversations each round; the engine and the service get the same ones.
            load = Load(args.conversations, args.turns, args.reply_tokens, seed=r)
            alone = asyncio.run(run_engine(model, load, bar))
            port = free_port()
            with tempfile.TemporaryDirectory() as data:
                proc, key = start_server(model, Path(data), port)
                try:
                    served = asyncio.run(run_service(f"http://127.0.0.1:{port}", key, load, bar))
                finally:
                    proc.terminate()
                    proc.wait(60)
            engine.merge(alone)
            service.merge(served)
            per_round.append(served.tokens_per_second / alone.tokens_per_second)
    load = Load(args.conversations, args.turns, args.reply_tokens)
    runs = [engine, service]
    rows = [
        [
            r.name,
            f"{percentile(r.ttft, 50) * 1e3:.0f}",
            f"{percentile(r.ttft, 99) * 1e3:.0f}",
            f"{percentile(r.itl, 50) * 1e3:.1f}",
            f"{percentile(r.itl, 99) * 1e3:.1f}",
            f"{r.tokens_per_second:.1f}",
            f"{r.wall:.0f}",
        ]
        for r in runs
    ]
    ratio = service.tokens_per_second / engine.tokens_per_second
    report = machine_header(
        "WebSocket conversations vs the engine alone",
        {
            "model": f"{model.name} preset, bfloat16",
            "load": f"{load.conversations} concurrent conversations x {load.turns} turns, think "
            "time 0.2-1 s, 20% of replies stopped after 4-12 deltas, 20% of sockets "
            f"dropped after 3-10 deltas and resumed, {load.reply_tokens} greedy tokens "
            f"per reply; {args.rounds} rounds (engine alone, then a fresh server), figures "
            "pooled over the rounds",
            "command": "python bench/serve_ws.py",
        },
    )
    report += "\n" + markdown_table(
        ["variant", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "tokens/s", "wall s"],
        rows,
    )
    report += (
        f"\nService tokens/s as a share of the engine's on the same load: {ratio:.2f} "
        "(goal >= 0.90); per round: " + ", ".join(f"{x:.2f}" for x in per_round) + ".\n\n"
        f"- stops: {service.stops}, of which honoured later than one step: "
        f"{service.stops_late}\n"
        f"- resumes: {service.resumes}, characters lost or repeated: "
        f"{service.resume_mismatches} (goal 0)\n"
        f"- errors: {len(service.errors)} (goal 0)\n"
    )
    for error in service.errors[:5]:
        report += f"  - {error}\n"
    report += "\n![latencies](serve_ws.png)\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    plot(runs, args.out.with_suffix(".png"))


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for run in runs:
        for ax, values in ((left, run.ttft), (right, run.itl)):
            ordered = sorted(v * 1e3 for v in values)
            ax.plot(
                ordered, [i / max(1, len(ordered) - 1) for i in range(len(ordered))], label=run.name
            )
    left.set_xlabel("TTFT (ms)")
    right.set_xlabel("inter-token latency (ms)")
    for ax in (left, right):
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
