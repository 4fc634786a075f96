"""Soak: N clients for M minutes against a started `kvchat serve` (its own, on the embedded
defaults, or one already running), each mixing REST turns, SSE streams, WebSocket turns, stops,
regenerations, budget changes (admin PUT) and evictions (admin evict), over loopback only,
bounded in time and stopping by itself.

    python bench/soak.py [--clients 8] [--minutes 10] [--model models/dev]
    python bench/soak.py --url http://127.0.0.1:8000 --key KEY --pid PID  # a running server

Samples the server's RSS (/proc/<pid>/status) and GET /v1/admin/memory while it runs; at the
end waits for the server to go idle and reports requests by kind, errors (any 5xx or other
unexpected status, any unexpected error frame, any hang or dropped connection), the KV pool's
used blocks against what the live sessions hold, and the RSS of the first half against the
second (flat within 3%?); writes bench/results/soak.md and soak.png."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets
from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.bench.serve_rest import WORDS, free_port, start_server

# (kind, weight): what a client does next, drawn from its own seeded generator.
MIX = (
    ("rest turn", 30),
    ("sse stream", 20),
    ("ws turn", 20),
    ("stop", 10),
    ("regenerate", 10),
    ("budget", 5),
    ("evict", 5),
)
KINDS = tuple(kind for kind, _ in MIX)
REQUEST_TIMEOUT_S = 120.0  # a request unanswered this long is a hang
TURNS_PER_CONVERSATION = 20  # then the client deletes it and starts another
RSS_FLAT = 0.03


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the start
    rss_bytes: int | None
    used_blocks: int
    held_blocks: int
    running: int


@dataclass
class Soak:
    """What a soak saw. `final` is GET /v1/admin/memory once the server was idle again."""

    clients: int
    duration_s: float
    requests: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)

    @property
    def pool(self) -> tuple[int, int]:
        """(used blocks of the KV pool, blocks the live sessions hold) once idle."""
        return pool_use(self.final)

    def rss_halves(self) -> tuple[float, float] | None:
        """Mean RSS (bytes) over the first and the second half of the run."""
        half = self.duration_s / 2
        first = [s.rss_bytes for s in self.samples if s.rss_bytes and s.t < half]
        second = [s.rss_bytes for s in self.samples if s.rss_bytes and s.t >= half]
        if not first or not second:
            return None
        return statistics.fmean(first), statistics.fmean(second)

    @property
    def rss_growth(self) -> float | None:
        halves = self.rss_halves()
        return None if halves is None else halves[1] / halves[0] - 1

    def rss_over_second_half(self) -> tuple[float, float] | None:
        """Mean RSS (bytes) at the start of the second half (its first tenth of the run) and
        at the end (the last tenth): whether memory still grows once warmed up."""
        d = self.duration_s
        start = [s.rss_bytes for s in self.samples if s.rss_bytes and d / 2 <= s.t < 0.6 * d]
        end = [s.rss_bytes for s in self.samples if s.rss_bytes and s.t >= 0.9 * d]
        if not start or not end:
            return None
        return statistics.fmean(start), statistics.fmean(end)

    @property
    def rss_second_half_growth(self) -> float | None:
        span = self.rss_over_second_half()
        return None if span is None else span[1] / span[0] - 1


def pool_use(report: dict[str, Any]) -> tuple[int, int]:
    """(used blocks of the KV pool, blocks the live sessions hold) in a GET /v1/admin/memory
    report. Equal when nothing leaked, as long as no two sessions share a block (each soak
    conversation has a system prompt of its own, so none does)."""
    held = sum(int(s["device_blocks"]) for s in report["sessions"])
    return int(report["pool"]["used_blocks"]), held


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc/<pid>/status, VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Failed(Exception):
    """A request that got something other than what the client expected."""


class Client:
    """One soak client: its own conversation (replaced every TURNS_PER_CONVERSATION turns),
    its own seeded choices."""

    def __init__(
        self,
        soak: Soak,
        http: httpx.AsyncClient,
        ws_base: str,
        headers: dict[str, str],
        index: int,
        seed: int,
        reply_tokens: int,
    ) -> None:
        self.soak, self.http, self.ws_base, self.headers = soak, http, ws_base, headers
        self.index = index
        self.rng = random.Random(seed * 7919 + index)
        self.reply_tokens = reply_tokens
        self.conversation: str | None = None
        self.turns = 0

    async def run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            kind = self.rng.choices(KINDS, [w for _, w in MIX])[0]
            try:
                if self.conversation is None or self.turns >= TURNS_PER_CONVERSATION:
                    await self.rotate()  # its errors count under the kind drawn
                if self.turns == 0 and kind == "regenerate":
                    kind = "rest turn"  # there is nothing to regenerate yet
                await getattr(self, kind.replace(" ", "_"))()
            except (httpx.TimeoutException, TimeoutError):
                self.soak.errors.append(f"{kind}: no answer within {REQUEST_TIMEOUT_S:.0f} s")
            except (httpx.TransportError, websockets.WebSocketException, OSError) as e:
                self.soak.errors.append(f"{kind}: connection dropped ({e!r})")
            except Failed as e:
                self.soak.errors.append(f"{kind}: {e}")
            self.soak.requests[kind] += 1

    # -- helpers ---------------------------------------------------------------------------------

    def words(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(5, 25)))

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        r = await self.http.request(method, path, **kw)
        if r.status_code != 200:
            raise Failed(f"{method} {path.split('?')[0]}: {r.status_code} {r.text[:200]}")
        return r.json()

    async def rotate(self) -> None:
        if self.conversation is not None:
            await self.call("DELETE", f"/v1/conversations/{self.conversation}")
        # A system prompt of its own: no KV block is shared with another conversation.
        conv = await self.call(
            "POST",
            "/v1/conversations",
            json={
                "system": f"Soak client {self.index}, conversation {time.monotonic_ns()}: be brief."
            },
        )
        self.conversation, self.turns = conv["id"], 0

    def turn_body(self, **extra: Any) -> dict[str, Any]:
        return {"content": self.words(), "max_tokens": self.reply_tokens, **extra}

    # -- what a client does ----------------------------------------------------------------------

    async def rest_turn(self) -> None:
        reply = await self.call(
            "POST", f"/v1/conversations/{self.conversation}/messages", json=self.turn_body()
        )
        if reply["status"] != "complete":
            raise Failed(f"reply {reply['id']} is {reply['status']}")
        self.turns += 1

    async def sse_stream(self) -> None:
        path = f"/v1/conversations/{self.conversation}/messages"
        async with self.http.stream("POST", path, json=self.turn_body(stream=True)) as r:
            if r.status_code != 200:
                raise Failed(f"POST {path}: {r.status_code} {(await r.aread())[:200]!r}")
            last = None
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    last = json.loads(line[6:])
                    if last["type"] == "error":
                        raise Failed(f"error event {last}")
            if last is None or last["type"] != "done":
                raise Failed(f"the stream ended without done (last event {last})")
        self.turns += 1

    async def ws_frames(
        self, frame: dict[str, Any], stop_after: int | None = None
    ) -> dict[str, Any]:
        """Send one frame on a new socket; the reply's frames until `done` (a `stop` frame
        after `stop_after` deltas). Returns the done frame."""
        url = f"{self.ws_base}/v1/conversations/{self.conversation}/ws"
        async with websockets.connect(
            url, additional_headers=self.headers, open_timeout=REQUEST_TIMEOUT_S
        ) as ws:
            await ws.send(json.dumps(frame))
            deltas = 0
            while True:
                got = json.loads(await asyncio.wait_for(ws.recv(), REQUEST_TIMEOUT_S))
                if got["type"] == "error":
                    raise Failed(f"error frame {got}")
                if got["type"] == "delta":
                    deltas += 1
                    if deltas == stop_after:
                        await ws.send(json.dumps({"type": "stop"}))
                if got["type"] == "done":
                    return got  # type: ignore[no-any-return]

    async def ws_turn(self) -> None:
        done = await self.ws_frames({"type": "message", **self.turn_body()})
        if done["status"] != "complete":
            raise Failed(f"reply {done['message_id']} is {done['status']}")
        self.turns += 1

    async def stop(self) -> None:
        """A long reply stopped after a few deltas: stored as cancelled (or complete, when it
        ended first)."""
        body = self.turn_body(max_tokens=10 * self.reply_tokens, ignore_eos=True)
        done = await self.ws_frames({"type": "message", **body}, stop_after=self.rng.randint(1, 4))
        if done["status"] not in ("cancelled", "complete"):
            raise Failed(f"stopped reply {done['message_id']} is {done['status']}")
        self.turns += 1

    async def regenerate(self) -> None:
        reply = await self.call(
            "POST",
            f"/v1/conversations/{self.conversation}/regenerate",
            json={"max_tokens": self.reply_tokens},
        )
        if reply["status"] != "complete":
            raise Failed(f"regenerated reply {reply['id']} is {reply['status']}")

    async def budget(self) -> None:
        # Budgets every turn of the mix fits in (a stop's reply budget is 10 replies).
        body = {
            "max_context_tokens": self.rng.choice([None, 512, 1024, 2048]),
            "max_kv_tokens": self.rng.choice([None, 128, 256, 1024]),
        }
        await self.call("PUT", f"/v1/admin/sessions/{self.conversation}", json=body)

    async def evict(self) -> None:
        offload = self.rng.choice(["true", "false"])
        await self.call("POST", f"/v1/admin/sessions/{self.conversation}/evict?offload={offload}")


async def memory_report(http: httpx.AsyncClient) -> dict[str, Any]:
    r = await http.get("/v1/admin/memory")
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


async def soak(
    url: str,
    key: str,
    pid: int | None,
    clients: int,
    duration_s: float,
    *,
    seed: int = 0,
    reply_tokens: int = 16,
    sample_every_s: float = 2.0,
    progress: Callable[[float, Soak], None] | None = None,
) -> Soak:
    """Run `clients` clients for `duration_s` seconds against the server at `url`, then wait
    for it to go idle (GET /v1/admin/memory: nothing running, waiting or swapped)."""
    result = Soak(clients, duration_s)
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=4 * clients + 4)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S, limits=limits
    ) as http:
        start = time.monotonic()
        deadline = start + duration_s
        done = asyncio.Event()

        async def sample() -> None:
            while True:
                report = await memory_report(http)
                used, held = pool_use(report)
                result.samples.append(
                    Sample(
                        time.monotonic() - start,
                        rss_bytes(pid) if pid else None,
                        used,
                        held,
                        int(report["requests"]["running"]),
                    )
                )
                if progress is not None:
                    progress(time.monotonic() - start, result)
                try:
                    await asyncio.wait_for(done.wait(), sample_every_s)
                    return
                except TimeoutError:
                    pass

        sampler = asyncio.ensure_future(sample())
        ws_base = url.replace("http", "ws", 1)
        await asyncio.gather(
            *(
                Client(result, http, ws_base, headers, i, seed, reply_tokens).run(deadline)
                for i in range(clients)
            )
        )
        done.set()
        await sampler
        idle_deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while True:
            report = await memory_report(http)
            requests = report["requests"]
            if not (requests["running"] or requests["waiting"] or requests["swapped"]):
                break
            if time.monotonic() > idle_deadline:
                result.errors.append(f"never idle: {requests}")
                break
            await asyncio.sleep(0.1)
        result.final = report
    return result


def write_report(result: Soak, header: str, path: Path) -> str:
    used, held = result.pool
    rows = [
        [kind, result.requests[kind], sum(e.startswith(f"{kind}:") for e in result.errors)]
        for kind in KINDS
    ]
    rows.append(["all", sum(result.requests.values()), len(result.errors)])
    report = header + "\n"
    report += markdown_table(["kind", "requests", "errors"], rows)
    report += f"\nErrors: {len(result.errors)} (goal 0)\n"
    for error in result.errors[:20]:
        report += f"- {error}\n"
    report += (
        f"\nOnce idle, the KV pool uses {used} blocks; the {len(result.final['sessions'])}"
        f" live sessions hold {held} ({'equal' if used == held else 'NOT equal'}).\n"
    )
    span = result.rss_over_second_half()
    if span is not None and result.rss_second_half_growth is not None:
        growth = result.rss_second_half_growth
        flat = abs(growth) <= RSS_FLAT
        report += (
            f"\nServer RSS over the second half (goal: flat within {RSS_FLAT:.0%}): "
            f"{span[0] / 2**20:.0f} MiB at its start, {span[1] / 2**20:.0f} MiB at the "
            f"end: {growth:+.1%} ({'flat' if flat else 'NOT flat'})."
        )
    halves = result.rss_halves()
    if halves is not None and result.rss_growth is not None:
        report += (
            f" The mean of the first half (warm-up included) was "
            f"{halves[0] / 2**20:.0f} MiB, of the second {halves[1] / 2**20:.0f} MiB "
            f"({result.rss_growth:+.1%}).\n"
        )
    report += f"\n![RSS and KV blocks over time]({path.with_suffix('.png').name})\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report)
    return report


def plot(result: Soak, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in result.samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    if any(s.rss_bytes for s in result.samples):
        top.plot(t, [(s.rss_bytes or 0) / 2**20 for s in result.samples])
    top.axvline(result.duration_s / 2, color="grey", lw=0.8, ls="--")
    top.set_ylabel("server RSS (MiB)")
    bottom.plot(t, [s.used_blocks for s in result.samples], label="KV pool: used blocks")
    bottom.plot(t, [s.held_blocks for s in result.samples], label="held by live sessions")
    bottom.set_xlabel("seconds")
    bottom.set_ylabel("blocks")
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--model",
        type=Path,
        default=REPO / "models" / "dev",
        help="the model of the server this script starts (not with --url)",
    )
    ap.add_argument("--url", help="soak this running server instead of starting one")
    ap.add_argument("--key", help="an admin key of the --url server")
    ap.add_argument("--pid", type=int, help="the --url server's process id (for its RSS)")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.md")
    args = ap.parse_args()
    if args.url and not args.key:
        ap.error("--url needs --key (an admin key)")
    duration_s = args.minutes * 60
    proc = None
    with tempfile.TemporaryDirectory() as data:
        if args.url:
            url, key, pid, server = args.url, args.key, args.pid, args.url
        else:
            model = ensure_model(args.model, "dev")
            port = free_port()
            proc, key = start_server(model, Path(data), port)
            url, pid = f"http://127.0.0.1:{port}", proc.pid
            server = (
                f"its own `kvchat serve` ({model.name} preset, SQLite, in-process coordination)"
            )
        title = f"Soak: {args.clients} clients x {args.minutes:g} minutes"
        settings: dict[str, object] = {
            "server": server,
            "mix": ", ".join(f"{kind} {w}%" for kind, w in MIX) + "; a conversation per "
            f"client, replaced every {TURNS_PER_CONVERSATION} turns",
            "reply tokens": f"{args.reply_tokens} (stops: {10 * args.reply_tokens}, stopped "
            "after 1-4 deltas)",
            "seed": args.seed,
            "command": f"python bench/soak.py --clients {args.clients} --minutes {args.minutes:g}",
        }
        bar = tqdm(total=round(duration_s), unit="s", desc="soak")

        def progress(elapsed: float, result: Soak) -> None:
            bar.update(min(round(elapsed), bar.total) - bar.n)
            bar.set_postfix(requests=sum(result.requests.values()), errors=len(result.errors))

        try:
            result = asyncio.run(
                soak(
                    url,
                    key,
                    pid,
                    args.clients,
                    duration_s,
                    seed=args.seed,
                    reply_tokens=args.reply_tokens,
                    progress=progress,
                )
            )
        finally:
            bar.close()
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    # The header once the run is over: its end time and load are the run's.
    print(write_report(result, machine_header(title, settings), args.out))
    plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
