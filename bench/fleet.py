"""Multi-round chat through HAProxy in front of a fleet of replicas (app.fleet: real HAProxy,
Postgres, Redis, `kvchat serve` processes of a random-weight model: the bench preset by
default, ~150M parameters, so a prefill costs what it does next to a decode step on a real
model; the dev model's is nearly free): N users x M rounds with a shared
system prompt and a history of their own, think time between rounds — the shape of vLLM
production-stack's multi-round QA benchmark. Half the users are stateless clients resending
their history to /v1/chat/completions with no session key (HAProxy routes them by their
conversation's opening), half keep it on the server (/v1/conversations/{id}/messages, routed
by the id); every call streams.

    python bench/fleet.py [--users 9] [--rounds 8] [--replicas 3] [--variants all] [--preset bench]

Variants, each on a fleet of its own (fresh caches), in one run:
- affinity: HAProxy's consistent hash of each conversation's routing key (the fleet's config);
- roundrobin: `balance roundrobin`, every call to the next replica;
- restart: affinity, with the replica most calls went to restarted (SIGTERM: drain, exit,
  start) halfway, while every user thinks between two rounds, and no KV store: its
  conversations recompute their history on their first turn after it;
- restart+kvstore: the same with the KV store on (a directory the replicas share): the
  drain makes sure the pinned sessions' blocks are on disk, and the first turns after the
  restart load them instead of recomputing;
- affinity+kvstore, roundrobin+kvstore: the first two with the store on (kvchat's default):
  a session a replica had to drop, or one another replica holds, is loaded from disk.
Variants without "+kvstore" run with the store off: what they measure is the replicas'
memory alone.

Per variant: prompt tokens served from cache (each reply's `cached_tokens`, kvchat's own
count) against the ideal (every token of the history the fleet has seen: the previous call's
prompt and reply), the same from the replicas' /metrics counters, TTFT p50/p99 overall and
for each user's first turn after the restart, requests failed after retries, messages lost
(stored conversations checked against what their clients were answered), and the KV store's
write-behind (the engine thread's copies plus the writer thread's time, from the replicas'
/metrics) as a share of the time the calls took. Goals (issue 22): affinity serves >= 0.95
of the ideal from cache (round-robin near 1/3); TTFT p50 with affinity >= 3x lower than
round-robin at 1-2k-token histories; the first turn after a restart with the store <= 0.3x
of its TTFT without; write-behind <= 5% of turn time; 0 failed, 0 lost.
Writes bench/results/fleet.md and fleet.png."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table

_WORD_LIST = (
    "river stone light quiet market winter garden paper engine signal harbor violet silver "
    "forest window letter bridge candle thunder meadow orbit pepper mirror planet rocket "
    "saddle timber velvet whisper anchor basket canyon desert ember falcon glacier hollow "
    "island jungle kettle lantern marble nectar oyster pillar quartz ribbon summit tunnel "
    "umbrella valley walnut yonder zephyr amber beacon cobalt dagger echo fable granite "
    "harvest ivory jasper kingdom lagoon mosaic nomad opal prism quiver relic sapphire "
    "tapestry utopia vortex willow"
)
WORDS = tuple(_WORD_LIST.split(" "))
MAX_RETRIES = 4  # connection errors, 409 (a lock another replica still holds), 5xx
REPLICA_ENV = {"KVCHAT_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1", "KVCHAT_SEED": "0"}


@dataclass(frozen=True)
class Variant:
    """One way to run the fleet: HAProxy's balance, and whether a replica restarts mid-run.
    `replica_env`: settings of every replica (the KV store's, for part 2's twin)."""

    name: str
    balance: str = "affinity"
    restart_mid_run: bool = False
    replica_env: tuple[tuple[str, str], ...] = ()


STORE_OFF = (("KVCHAT_KV_STORE_BYTES", "0"),)
STORE_ON = (("KVCHAT_KV_STORE_BYTES", str(8 * 2**30)),)
VARIANTS = {
    "affinity": Variant("affinity", replica_env=STORE_OFF),
    "roundrobin": Variant("roundrobin", balance="roundrobin", replica_env=STORE_OFF),
    "affinity+kvstore": Variant("affinity+kvstore", replica_env=STORE_ON),
    "roundrobin+kvstore": Variant("roundrobin+kvstore", balance="roundrobin", replica_env=STORE_ON),
}
# A rolling restart mid-run, without the KV store and with it (the fleet's run directory
# holds the store every replica shares: app.fleet sets KVCHAT_KV_STORE_DIR).
RESTART_VARIANTS = {
    "restart": Variant("restart", restart_mid_run=True, replica_env=STORE_OFF),
    "restart+kvstore": Variant("restart+kvstore", restart_mid_run=True, replica_env=STORE_ON),
}
ALL_VARIANTS = {**VARIANTS, **RESTART_VARIANTS}


@dataclass(frozen=True)
class Call:
    user: int
    round: int  # 1-based
    api: str
    started: float  # monotonic
    ttft_s: float
    total_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ideal_cached: int  # the history before the new message (0 in round 1)
    replica: str


@dataclass
class User:
    """One user: their opening, their questions, and what they were answered."""

    index: int
    api: str  # "chat" (stateless, keyless) or "conversation" (kept on the server)
    opening: str
    questions: list[str]
    think_s: float
    calls: list[Call] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    answered: list[tuple[str, str]] = field(default_factory=list)  # (question, reply)
    conversation_id: str | None = None


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_users(
    num_users: int, rounds: int, seed: int, opening_words: int, question_words: int, think_s: float
) -> list[User]:
    rng = random.Random(seed)
    return [
        User(
            index=i,
            api="chat" if i % 2 == 0 else "conversation",
            opening=f"User {i} (seed {seed}) opens: {words(rng, opening_words)}",
            questions=[f"Round {r + 1}: {words(rng, question_words)}?" for r in range(rounds)],
            think_s=think_s,
        )
        for i in range(num_users)
    ]


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line[6:] != "[DONE]":
            yield json.loads(line[6:])


class Driver:
    """Runs users against the fleet's URL, each in a thread, with retries."""

    def __init__(self, url: str, key: str, model: str, system: str, max_tokens: int) -> None:
        self.url = url
        self.key = key
        self.model = model
        self.system = system
        self.max_tokens = max_tokens
        self.mark: float | None = None  # set when a restarted replica is back in rotation
        # The restart variant: after `pause_after` rounds every user waits at `paused` (the
        # bench restarts a replica meanwhile) until `resumed` is set.
        self.pause_after: int | None = None
        self.paused: threading.Barrier | None = None
        self.resumed = threading.Event()

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, timeout=300, headers={"Authorization": f"Bearer {self.key}"}
        )

    def run(self, user: User) -> None:
        http = self.client()
        history: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        previous: Call | None = None
        if user.api == "conversation":
            r = self._retry(
                user, lambda: http.post("/v1/conversations", json={"system": self.system})
            )
            if r is None:
                return
            user.conversation_id = r.json()["id"]
        for round_, question in enumerate(user.questions, start=1):
            content = f"{user.opening}\n{question}" if round_ == 1 else question
            history.append({"role": "user", "content": content})
            call = self._call(http, user, round_, history, content, previous)
            if call is None:
                history.pop()
                continue
            previous = call
            if round_ == self.pause_after and self.paused is not None:
                self.paused.wait()
                self.resumed.wait()
            time.sleep(user.think_s)

    def _retry(self, user: User, send: Callable[[], httpx.Response]) -> httpx.Response | None:
        for attempt in range(MAX_RETRIES + 1):
            try:
                r = send()
                if r.status_code < 300:
                    return r
                if r.status_code not in (409, 429) and r.status_code < 500:
                    user.failures.append(f"{r.status_code}: {r.text[:200]}")
                    return None
            except httpx.HTTPError as e:
                if attempt == MAX_RETRIES:
                    user.failures.append(repr(e))
                    return None
            time.sleep(0.5 * 2**attempt)
        user.failures.append("retries exhausted")
        return None

    def _call(
        self,
        http: httpx.Client,
        user: User,
        round_: int,
        history: list[dict[str, Any]],
        content: str,
        previous: Call | None,
    ) -> Call | None:
        for attempt in range(MAX_RETRIES + 1):
            started = time.monotonic()
            try:
                result = self._stream(http, user, history, content, attempt)
            except (httpx.HTTPError, RuntimeError) as e:
                if attempt == MAX_RETRIES:
                    user.failures.append(f"round {round_}: {e!r}")
                    return None
                time.sleep(0.5 * 2**attempt)
                continue
            ttft, text, usage, replica = result
            total = time.monotonic() - started
            history.append({"role": "assistant", "content": text})
            user.answered.append((content, text))
            ideal = (previous.prompt_tokens + previous.completion_tokens) if previous else 0
            call = Call(
                user.index,
                round_,
                user.api,
                started,
                ttft,
                total,
                usage["prompt_tokens"],
                usage["completion_tokens"],
                usage["cached_tokens"],
                ideal,
                replica,
            )
            user.calls.append(call)
            return call
        return None

    def _stream(
        self,
        http: httpx.Client,
        user: User,
        history: list[dict[str, Any]],
        content: str,
        attempt: int,
    ) -> tuple[float, str, dict[str, int], str]:
        sampling = {
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        if user.api == "chat":
            path = "/v1/chat/completions"
            body: dict[str, Any] = {
                "model": self.model,
                "messages": history,
                "stream_options": {"include_usage": True},
                **sampling,
            }
            headers = {}
        else:
            path = f"/v1/conversations/{user.conversation_id}/messages"
            body = {"content": content, **sampling}
            headers = {"Idempotency-Key": f"u{user.index}-{len(user.answered)}"}
        start = time.monotonic()
        ttft, text, usage = None, "", None
        with http.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
            replica = r.headers.get("x-kvchat-replica", "?")
            for event in sse_events(r):
                if user.api == "chat":
                    if event.get("usage"):
                        u = event["usage"]
                        usage = {
                            "prompt_tokens": u["prompt_tokens"],
                            "completion_tokens": u["completion_tokens"],
                            "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                        }
                    for choice in event.get("choices", []):
                        piece = choice["delta"].get("content") or ""
                        if piece and ttft is None:
                            ttft = time.monotonic() - start
                        text += piece
                elif event["type"] == "delta":
                    if ttft is None:
                        ttft = time.monotonic() - start
                    text += event["text"]
                elif event["type"] == "done":
                    u = event["usage"]
                    usage = {
                        k: u[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens")
                    }
                elif event["type"] == "error":
                    raise RuntimeError(f"error event: {event}")
        if usage is None or ttft is None:
            raise RuntimeError("the stream ended without usage or text")
        return ttft, text, usage, replica


COUNTERS = {
    "kvchat:prompt_tokens_total": "prompt",
    "kvchat:session_drops_total": "session_drops",
    "kvchat:kv_store_copy_seconds_total": "store_copy_s",
    "kvchat:kv_store_write_seconds_total": "store_write_s",
    'kvchat:cached_tokens_total{source="kv_store"}': "from_store",
}


def counters(url: str) -> dict[str, float]:
    """The replica's counters: prompt tokens, cached tokens (all sources, and the KV store's),
    the KV store's write-behind seconds."""
    out = {
        "prompt": 0.0,
        "cached": 0.0,
        "store_copy_s": 0.0,
        "store_write_s": 0.0,
        "from_store": 0.0,
        "session_drops": 0.0,
    }
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in COUNTERS:
            out[COUNTERS[name]] = float(value)
        if line.startswith("kvchat:cached_tokens_total{"):
            out["cached"] += float(value)
    return out


@dataclass
class Outcome:
    variant: Variant
    users: list[User]
    counters: dict[str, float]
    restart_s: float | None = None
    lost: int = 0
    back_at: float | None = None  # monotonic: the restarted replica was in rotation again
    restarted: str | None = None

    @property
    def calls(self) -> list[Call]:
        return [c for u in self.users for c in u.calls]

    @property
    def failed(self) -> int:
        return sum(len(u.failures) for u in self.users)


def run_variant(
    variant: Variant, args: argparse.Namespace, users: list[User], system: str, run_dir: Path
) -> Outcome:
    from kvchat.app.fleet import Fleet, FleetConfig

    env = {
        **REPLICA_ENV,
        "KVCHAT_KV_CACHE_BYTES": str(args.kv_cache_mib * 2**20),
        "KVCHAT_HOST_CACHE_BYTES": str(args.host_cache_mib * 2**20),
        **dict(variant.replica_env),
    }
    with bench_database(
        f"{args.postgres_url}/kvchat_bench_fleet_{os.getpid()}_{variant.name.replace('+', '_')}"
    ) as url:
        config = FleetConfig(
            model=args.model,
            database_url=url,
            redis_url=args.redis_url,
            num_replicas=args.replicas,
            run_dir=run_dir / variant.name,
            redis_prefix=f"kvchat-bench-{os.getpid()}-{variant.name}:",
            balance=variant.balance,  # type: ignore[arg-type]
            check_interval_ms=500,
            replica_env=env,
            create_database=True,
        )
        with Fleet(config) as fleet:
            assert fleet.admin_key is not None
            driver = Driver(
                fleet.url, fleet.admin_key, args.model.resolve().name, system, args.max_tokens
            )
            if variant.restart_mid_run:
                driver.pause_after = len(users[0].questions) // 2
                driver.paused = threading.Barrier(len(users) + 1, timeout=1800)
            threads = [threading.Thread(target=driver.run, args=(u,)) for u in users]
            for thread in threads:
                thread.start()
            totals = dict.fromkeys(counters(fleet.replicas[0].url), 0.0)
            restart_s, busiest = None, None
            if driver.paused is not None:
                # Half the rounds are in: restart the replica most calls went to (SIGTERM:
                # it drains, exits, starts again and HAProxy routes to it again).
                driver.paused.wait()
                busiest = statistics.mode([c.replica for u in users for c in u.calls])
                before = counters(fleet.replica(busiest).url)
                began = time.monotonic()
                fleet.restart(busiest)
                restart_s = time.monotonic() - began
                driver.mark = time.monotonic()
                totals = {k: totals[k] + before[k] for k in totals}
                driver.resumed.set()
            for thread in threads:
                thread.join()
            for replica in fleet.replicas:
                now = counters(replica.url)
                totals = {k: totals[k] + now[k] for k in totals}
            return Outcome(
                variant,
                users,
                totals,
                restart_s,
                count_lost(driver, users),
                driver.mark,
                busiest if driver.paused is not None else None,
            )


@contextlib.contextmanager
def bench_database(url: str) -> Iterator[str]:
    """A Postgres database of the run's own (the fleet creates and migrates it), dropped
    after."""
    from kvchat.app.fleet import drop_postgres_database

    try:
        yield url
    finally:
        asyncio.run(drop_postgres_database(url))


def count_lost(driver: Driver, users: list[User]) -> int:
    """Answered turns of server-side conversations missing from the stored branch."""
    http = driver.client()
    lost = 0
    for user in users:
        if user.conversation_id is None:
            continue
        stored = http.get(f"/v1/conversations/{user.conversation_id}/messages").json()["data"]
        pairs = list(zip([m["content"] for m in stored[::2]], [m["content"] for m in stored[1::2]]))
        lost += sum(1 for pair in user.answered if pair not in pairs)
    return lost


def pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(outcome: Outcome) -> dict[str, Any]:
    later = [c for c in outcome.calls if c.round > 1]
    cached = sum(c.cached_tokens for c in later)
    ideal = sum(c.ideal_cached for c in later)
    ttft = [c.ttft_s * 1000 for c in outcome.calls]
    long_history = [c.ttft_s * 1000 for c in later if 1000 <= c.prompt_tokens <= 2000]
    after = []  # the first turn after the restart of each conversation that was there
    after_computed: list[int] = []  # the prompt tokens those turns computed
    if outcome.back_at is not None:
        for user in outcome.users:
            before = [c for c in user.calls if c.started < outcome.back_at]
            first = next((c for c in user.calls if c.started >= outcome.back_at), None)
            if first is not None and before and before[-1].replica == outcome.restarted:
                after.append(first.ttft_s * 1000)
                after_computed.append(first.prompt_tokens - first.cached_tokens)
    return {
        "cache_fraction": cached / ideal if ideal else float("nan"),
        "metrics_fraction": outcome.counters["cached"] / outcome.counters["prompt"]
        if outcome.counters["prompt"]
        else float("nan"),
        "ttft_p50": statistics.median(ttft),
        "ttft_p99": pct(ttft, 99),
        "ttft_long_p50": statistics.median(long_history) if long_history else float("nan"),
        "after_restart_p50": statistics.median(after) if after else None,
        "after_restart_computed": sum(after_computed),
        "session_drops": outcome.counters["session_drops"],
        "failed": outcome.failed,
        "lost": outcome.lost,
        "calls": len(outcome.calls),
        "max_prompt": max(c.prompt_tokens for c in outcome.calls),
        "replicas": len({c.replica for c in outcome.calls}),
        "write_behind": (outcome.counters["store_copy_s"] + outcome.counters["store_write_s"])
        / sum(c.total_s for c in outcome.calls),
        "from_store": outcome.counters["from_store"],
    }


def plot(outcomes: list[Outcome], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rounds = max(c.round for o in outcomes for c in o.calls)
    for outcome in outcomes:
        by_round = [
            [c.ttft_s * 1000 for c in outcome.calls if c.round == r] for r in range(1, rounds + 1)
        ]
        left.plot(
            range(1, rounds + 1),
            [statistics.median(v) if v else float("nan") for v in by_round],
            marker="o",
            label=outcome.variant.name,
        )
        later = [c for c in outcome.calls if c.round > 1]
        right.plot(
            range(2, rounds + 1),
            [
                sum(c.cached_tokens for c in later if c.round == r)
                / max(1, sum(c.ideal_cached for c in later if c.round == r))
                for r in range(2, rounds + 1)
            ],
            marker="o",
            label=outcome.variant.name,
        )
    left.set(title="TTFT p50 by round (through HAProxy)", xlabel="round", ylabel="ms")
    right.set(title="cached / ideal (the history) by round", xlabel="round", ylim=(0, 1.1))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument(
        "--variants",
        default="all",
        help=f"all, or a comma-separated list of {', '.join(ALL_VARIANTS)}",
    )
    parser.add_argument(
        "--preset",
        choices=("dev", "bench"),
        default="bench",
        help="the model preset (created in models/<preset> if missing)",
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="a model directory (default: models/<preset>)"
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--postgres-url",
        default="postgresql://postgres@127.0.0.1:5432",
        help="a Postgres server: each variant's fleet gets a database of its "
        "own there, dropped after",
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--system-words", type=int, default=200)
    parser.add_argument("--opening-words", type=int, default=120)
    parser.add_argument("--question-words", type=int, default=100)
    parser.add_argument("--think", type=float, default=0.3, help="seconds between rounds")
    parser.add_argument(
        "--kv-cache-mib",
        type=int,
        default=96,
        help="each replica's KV pool (the bench preset: 12 KiB a token, so 96 "
        "MiB hold 8k tokens: a replica's share of the histories, not all)",
    )
    parser.add_argument(
        "--host-cache-mib",
        type=int,
        default=64,
        help="each replica's host pool for offloaded sessions",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "fleet.md")
    args = parser.parse_args()
    names = list(ALL_VARIANTS) if args.variants == "all" else args.variants.split(",")
    unknown = [n for n in names if n not in ALL_VARIANTS]
    if unknown:
        parser.error(f"unknown variants {', '.join(unknown)}")
    if args.users < 1 or args.rounds < 2:
        parser.error("--users must be >= 1 and --rounds >= 2")
    load_start = os.getloadavg()
    args.model = args.model or REPO / "models" / args.preset
    ensure_model(args.model, args.preset)
    system = "You are the fleet benchmark's assistant. " + words(
        random.Random(args.seed - 1), args.system_words
    )
    outcomes = []
    with tempfile.TemporaryDirectory() as run_dir:
        for name in names:
            users = make_users(
                args.users,
                args.rounds,
                args.seed,
                args.opening_words,
                args.question_words,
                args.think,
            )
            print(
                f"variant {name}: {args.replicas} replicas, {args.users} users x "
                f"{args.rounds} rounds",
                flush=True,
            )
            outcomes.append(run_variant(ALL_VARIANTS[name], args, users, system, Path(run_dir)))
    load_end = os.getloadavg()
    summaries = {o.variant.name: summarize(o) for o in outcomes}
    rows = []
    for outcome in outcomes:
        s = summaries[outcome.variant.name]
        after = s["after_restart_p50"]
        rows.append(
            [
                outcome.variant.name,
                s["calls"],
                s["replicas"],
                f"{s['cache_fraction']:.3f}",
                f"{s['metrics_fraction']:.3f}",
                f"{s['ttft_p50']:.0f}",
                f"{s['ttft_p99']:.0f}",
                f"{s['ttft_long_p50']:.0f}",
                "-" if after is None else f"{after:.0f}",
                "-" if after is None else s["after_restart_computed"],
                int(s["session_drops"]),
                s["failed"],
                s["lost"],
                s["max_prompt"],
                int(s["from_store"]),
                "-"
                if not s["from_store"] and not s["write_behind"]
                else f"{100 * s['write_behind']:.2f}%",
            ]
        )
    header = machine_header(
        "A fleet behind HAProxy: affinity vs round-robin (bench/fleet.py)",
        {
            "fleet": f"HAProxy in front of {args.replicas} replicas of `kvchat serve --model "
            f"{args.model.name}` ({args.preset} preset; Postgres, Redis, one torch "
            "thread each, all on this machine)",
            "workload": f"{args.users} users x {args.rounds} rounds, half stateless keyless chat "
            f"completions, half server-side conversations; shared system prompt of "
            f"{args.system_words} words, openings of {args.opening_words}, questions "
            f"of {args.question_words}; {args.max_tokens}-token greedy replies; "
            f"{args.think} s think time",
            "memory": f"each replica's KV pool {args.kv_cache_mib} MiB, host pool "
            f"{args.host_cache_mib} MiB: about its share of the users' histories (what "
            "a fleet is for: more live conversations than one replica holds)",
        },
        load_start=load_start,
        load_end=load_end,
    )
    table = markdown_table(
        [
            "variant",
            "calls",
            "replicas used",
            "cached / ideal (replies)",
            "cached / prompt (/metrics)",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
            "TTFT p50, 1-2k-token prompts (ms)",
            "TTFT p50, first turn after the restart of its replica (ms)",
            "prompt tokens those first turns computed",
            "sessions dropped",
            "failed",
            "lost",
            "largest prompt (tokens)",
            "tokens loaded from the KV store",
            "KV store write-behind / turn time",
        ],
        rows,
    )
    goals = []
    for suffix in ("", "+kvstore"):
        if "affinity" + suffix not in summaries:
            continue
        a = summaries["affinity" + suffix]
        goals.append(
            f"- affinity{suffix} serves {a['cache_fraction']:.3f} of the ideal from "
            f"cache (goal >= 0.95: {'met' if a['cache_fraction'] >= 0.95 else 'not met'}"
            f"; {a['session_drops']:.0f} sessions dropped for room)"
        )
        if "roundrobin" + suffix in summaries:
            r = summaries["roundrobin" + suffix]
            ratio = r["ttft_long_p50"] / a["ttft_long_p50"]
            goals.append(
                f"- roundrobin{suffix} serves {r['cache_fraction']:.3f} of the ideal"
                + (
                    " (about 1/3 expected with 3 replicas)"
                    if not suffix
                    else " (the rest loaded from the shared store)"
                )
            )
            goals.append(
                f"- TTFT p50 at 1-2k-token prompts: roundrobin{suffix} / "
                f"affinity{suffix} = {ratio:.2f}x (goal >= 3x: "
                f"{'met' if ratio >= 3 else 'not met'})"
            )
    if "restart" in summaries and "restart+kvstore" in summaries:
        without = summaries["restart"]["after_restart_p50"]
        with_store = summaries["restart+kvstore"]["after_restart_p50"]
        if without and with_store:
            ratio = with_store / without
            goals.append(
                f"- first turn after the restart of its replica, TTFT p50: with the "
                f"KV store {with_store:.0f} ms, without {without:.0f} ms = "
                f"{ratio:.2f}x (goal <= 0.3x: {'met' if ratio <= 0.3 else 'not met'})"
                f"; the prompt tokens those turns computed: "
                f"{summaries['restart+kvstore']['after_restart_computed']} with the "
                f"store, {summaries['restart']['after_restart_computed']} without"
            )
        share = summaries["restart+kvstore"]["write_behind"]
        goals.append(
            f"- KV store write-behind (engine-thread copies + writer thread) = "
            f"{100 * share:.2f}% of the calls' time (goal <= 5%: "
            f"{'met' if share <= 0.05 else 'not met'})"
        )
    failed = sum(s["failed"] for s in summaries.values())
    lost = sum(s["lost"] for s in summaries.values())
    goals.append(
        f"- failed requests {failed}, lost messages {lost} (goal 0 and 0: "
        f"{'met' if failed == lost == 0 else 'not met'})"
    )
    text = (
        header
        + "\n"
        + table
        + "\n"
        + "\n".join(goals)
        + "\n\n"
        + (
            "cached / ideal: the replies' `cached_tokens` summed over rounds 2.. against the "
            "history each call resent (the previous call's prompt and reply); round 1 is left "
            "out (only the shared system prompt could be cached there). cached / prompt: the "
            "replicas' kvchat:cached_tokens_total over kvchat:prompt_tokens_total, every round "
            "(new messages included, so below 1 even with perfect reuse). TTFT is the client's, "
            "through HAProxy, to the first streamed token. The restart variant restarts the "
            "replica most calls had gone to after half the rounds, while every user waits "
            "between two rounds, without a KV store: the first turns of its conversations "
            "after it recompute their history; restart+kvstore does the same with the store on "
            "(shared by the replicas), so they load it. Write-behind counts both the engine "
            "thread's block copies (on the turn's path) and the writer thread's serializing "
            "(beside it), over the summed wall time of every call.\n\n![TTFT and reuse by round]"
            "(fleet.png)\n"
        )
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    plot(outcomes, args.out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
