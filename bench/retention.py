"""Retention under memory pressure: `kvchat serve --retention lru | pinned | predictive` of the
default model (SmolLM2-135M-Instruct), one server per policy, the same seeded workload replayed
against each: agents running tool loops and people chatting over the WebSocket, at once.

    python bench/retention.py [--quick] [--seed 0] [--compression 5]

The workload (bench/retention_plan.py, replayed by bench/retention_replay.py):

- agents: tasks of 3-10 tool calls each, through the conversations API (a user task, then each
  tool's result as a tool message; tool_choice required for the calls, auto for the last step,
  which answers), the tool taking 0.2-5 s between a reply and its result;
- people: conversations over `/v1/conversations/{id}/ws`, a pasted text in the first message,
  turns separated by think times drawn from a log-normal with a production chat trace's figures
  (median 126 s, log sigma 0.97: p25 69 s, p95 621 s), divided by `--compression`; a `typing`
  frame `--typing-lead` seconds before each later message (when the server takes the frame);
- both classes at once, each class's sessions opening with its shared system prompt (~300
  tokens) under its own key (owner), histories growing turn by turn.

Every policy's server gets the same pools, sized from the plan so that the live sessions' KV
needs `--pressure` times what the device and host pools hold (the device pool holding at least
two of the longest sessions, so the running requests fit). `lru` runs without the KV store
(vLLM has no disk tier), `pinned` and `predictive` with it (kvchat's default). The predictive
policy runs the workload a second time without typing frames (the other two ignore them).

Per class and policy: prompt tokens computed (prompt - cached, from each reply's usage)
against the ideal (the tokens no earlier turn of the session had), the server's TTFT p50 and
p90, decode tokens/s per request; per run, from /metrics deltas: bytes moved between tiers,
session hits by tier, prefetches used and wasted, holds broken (and requests that waited on
one); for agents, the share of returns within 5 s whose session was on the device just before
(GET /v1/admin/sessions/{id}). Two probes on a fresh predictive server: a typing person
whose session was pushed to disk (TTFT against a session left on the device), and a keyless
client (`prompt_cache_key`, `prompt_cache_retention: "24h"`) whose server restarts between its
two turns (the share of the second prompt served from cache). The goals are printed with pass
or fail.

Each run stops at `--time-limit`; all traffic is to loopback. Writes bench/results/retention.md
(or the `--out` path) and the plot beside it (retention.png)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
    stop_servers_on_sigterm,
)
from kvchat.bench.retention_plan import (
    AGENT,
    CLASSES,
    PERSON,
    PLURAL,
    RETURN_WINDOW_S,
    THINK_MEDIAN_S,
    THINK_SIGMA,
    Goal,
    Plan,
    PolicyRun,
    PoolSizes,
    WorkloadConfig,
    kv_bytes_per_token,
    live_tokens,
    make_plan,
    mixed_goals,
    nominal_spans,
    quantile,
    ratio,
    running_tokens,
    size_pools,
    summarize,
)
from kvchat.bench.retention_replay import (
    Endpoint,
    Replay,
    Replayer,
    RestartProbe,
    TypingProbe,
    restart_probe,
    typing_probe,
)

PRESET = "smollm2-135m-instruct"
POLICIES = ("lru", "pinned", "predictive")
MIXED, SILENT = "mixed", "mixed, no typing"
POLICY_COLORS = {"lru": "#d95f02", "pinned": "#999999", "predictive": "#2a7ab9"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BLOCK_SIZE = 16  # kvchat serve's default

WHY_OWN_REPLAY = (
    "Why the bench replays its own workload: inference-perf's and aiperf's multi-turn modes "
    "send a conversation's next turn after a fixed or sampled delay from one distribution (or "
    "at once), from a dataset of user turns. They cannot express a tool loop whose next "
    "request carries the tool call's id from the reply before it and waits on that tool's "
    "latency, per-class think times (agents back in seconds, people in minutes) in one run, "
    "the last step of a loop changing tool_choice, or a WebSocket client sending a typing "
    "frame seconds before its message; and they read TTFT at the first streamed text, which "
    "a tool call (sent whole when parsed) does not give."
)


# -- servers -------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def create_key(data: Path, name: str, owner: str, *, admin: bool = False) -> str:
    """A key in the bench's database (`kvchat keys create`), before any server runs."""
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "kvchat.app.cli", "keys", "create", "--name", name]
        + ["--owner", owner]
        + (["--admin"] if admin else []),
        env={**os.environ, "KVCHAT_DATA_DIR": str(data)},
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return proc.stdout.strip()


@dataclass(frozen=True)
class Keys:
    admin: str
    agent: str
    person: str

    @classmethod
    def create(cls, data: Path) -> Keys:
        return cls(
            create_key(data, "bench-admin", "bench-admin", admin=True),
            create_key(data, "bench-agents", "agents"),
            create_key(data, "bench-chat-page", "people"),
        )


class Server:
    """`kvchat serve` of `model` with `flags`, on the bench's database (`data`), its log in
    `log`; ready when /readyz answers."""

    def __init__(self, model: Path, data: Path, keys: Keys, flags: list[str], log: Path) -> None:
        self.model, self.data, self.keys, self.flags, self.log = model, data, keys, flags, log
        port = free_port()
        env = {
            **os.environ,
            "KVCHAT_DATA_DIR": str(data),
            "KVCHAT_SEED": "0",
            "KVCHAT_LOG_LEVEL": "warning",
            "PYTHONUNBUFFERED": "1",
        }
        with log.open("a") as out:
            self.proc = subprocess.Popen(
                serve_command(model, port, *flags), stdout=out, stderr=subprocess.STDOUT, env=env
            )
        self.endpoint = Endpoint(
            f"http://127.0.0.1:{port}", model.name, keys.admin, keys.agent, keys.person
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvchat serve exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(f"{self.endpoint.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"kvchat serve not ready after 300 s; see {log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> Server:
        self.stop()
        return Server(self.model, self.data, self.keys, self.flags, self.log)

    def memory(self) -> dict[str, object]:
        r = httpx.get(
            f"{self.endpoint.url}/v1/admin/memory",
            headers={"Authorization": f"Bearer {self.keys.admin}"},
            timeout=60,
        )
        return dict(r.raise_for_status().json())


def policy_flags(
    policy: str, pools: PoolSizes, store_dir: Path, store_bytes: int, dtype: str
) -> list[str]:
    flags = [
        "--retention",
        policy,
        "--dtype",
        dtype,
        "--kv-cache-bytes",
        str(pools.device_bytes),
        "--host-cache-bytes",
        str(pools.host_bytes),
        "--kv-store-dir",
        str(store_dir),
        "--kv-store-bytes",
        "0" if policy == "lru" else str(store_bytes),  # vLLM has no disk tier
        "--ws-max-connections-per-key",
        "256",
    ]
    return flags


async def warm_up(endpoint: Endpoint, plan: Plan) -> None:
    """One agent step (compiles the tool-call grammar) and one person turn per class, not
    recorded: every run then finds its class's system prompt in the prefix cache."""
    from kvchat.bench.retention_replay import TOOLS, ws_turn

    async with endpoint.client(endpoint.agent_key) as c:
        conv = (await c.post("/v1/conversations", json={"system": plan.agent_system})).json()["id"]
        body = {
            "role": "user",
            "content": "Warm up: find the cache.",
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": plan.config.call_tokens,
            "temperature": 0,
        }
        (await c.post(f"/v1/conversations/{conv}/messages", json=body)).raise_for_status()
    async with endpoint.client(endpoint.person_key) as c:
        conv = (await c.post("/v1/conversations", json={"system": plan.person_system})).json()["id"]
    await ws_turn(endpoint, conv, "Warm up: hello.", 4)


# -- one run -------------------------------------------------------------------------------------


@dataclass
class Run:
    scenario: str
    policy: str
    replay: Replay
    load_start: float
    load_end: float

    def summary(self) -> PolicyRun:
        records = self.replay.records
        return PolicyRun(summarize(records, None), {k: summarize(records, k) for k in CLASSES})

    def metric(self, name: str, **labels: str) -> float:
        key = name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
        return self.replay.metrics.get(key, float("nan"))


def run_policy(
    scenario: str,
    policy: str,
    plan: Plan,
    args: argparse.Namespace,
    pools: PoolSizes,
    data: Path,
    keys: Keys,
    bar: tqdm,
) -> tuple[Run, int]:
    """A fresh server of `policy`, warmed up, the plan replayed against it; and its KV bytes
    per token as the server reports them."""
    store = Path(tempfile.mkdtemp(prefix=f"kv-{policy}-", dir=data))
    flags = policy_flags(policy, pools, store, args.kv_store_bytes, args.dtype)
    server = Server(args.model, data, keys, flags, data / f"serve-{policy}.log")
    try:
        asyncio.run(warm_up(server.endpoint, plan))
        bytes_per_token = int(str(server.memory()["bytes_per_token"]))
        load_start = os.getloadavg()[0]
        replayer = Replayer(server.endpoint, plan, typing=scenario == MIXED, bar=bar)
        replay = asyncio.run(replayer.run(args.time_limit))
        load_end = os.getloadavg()[0]
    finally:
        server.stop()
    return Run(scenario, policy, replay, load_start, load_end), bytes_per_token


def run_probes(
    plan: Plan, args: argparse.Namespace, data: Path, keys: Keys, bar: tqdm
) -> tuple[TypingProbe | None, RestartProbe | None, str]:
    """The typing and restart probes, on one fresh predictive server with the default pools."""
    store = Path(tempfile.mkdtemp(prefix="kv-probes-", dir=data))
    flags = ["--retention", "predictive", "--dtype", args.dtype, "--kv-store-dir", str(store)]
    server = Server(args.model, data, keys, flags, data / "serve-probes.log")
    notes = []
    typing: TypingProbe | None = None
    restart: RestartProbe | None = None
    try:
        asyncio.run(warm_up(server.endpoint, plan))
        try:
            typing = asyncio.run(
                typing_probe(
                    server.endpoint,
                    plan,
                    repeats=args.probe_repeats,
                    lead_s=args.probe_typing_lead,
                    document_words=args.probe_words,
                    bar=bar,
                )
            )
        except (RuntimeError, httpx.HTTPError) as e:
            notes.append(f"typing probe failed: {type(e).__name__}: {e}")
        holder = [server]

        async def restarted() -> Endpoint:
            holder[0] = holder[0].restart()
            return holder[0].endpoint

        try:
            restart = asyncio.run(
                restart_probe(server.endpoint, plan, restarted, document_words=args.probe_words)
            )
        except (RuntimeError, httpx.HTTPError) as e:
            notes.append(f"restart probe failed: {type(e).__name__}: {e}")
        server = holder[0]
        bar.update(2)
    finally:
        server.stop()
    return typing, restart, "; ".join(notes)


# -- the report ----------------------------------------------------------------------------------


def seconds(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def class_rows(runs: Sequence[Run]) -> list[list[object]]:
    lru = {r.scenario: r.summary() for r in runs if r.policy == "lru"}
    rows: list[list[object]] = []
    for run in runs:
        summary = run.summary()
        for klass in (*CLASSES, None):
            s = summary.by_class[klass] if klass else summary.all
            base = lru.get(run.scenario) or lru.get(MIXED)
            theirs = (base.by_class[klass] if klass else base.all) if base else None
            rows.append(
                [
                    run.scenario,
                    run.policy,
                    klass or "all",
                    f"{s.turns - s.failed}/{s.turns}",
                    f"{s.computed:,} / {s.ideal:,}",
                    f"{s.computed_over_ideal:.2f}",
                    f"{ratio(s.computed, theirs.computed):.2f}" if theirs else "-",
                    seconds(s.ttft_p50_s),
                    seconds(s.ttft_p90_s),
                    seconds(s.later_ttft_p90_s),
                    "-" if math.isnan(s.decode_tok_s) else f"{s.decode_tok_s:.1f}",
                    f"{s.quick_on_device}/{s.quick_returns} ({s.device_share:.0%})"
                    if s.quick_returns
                    else "",
                ]
            )
    return rows


CLASS_HEADER = [
    "workload",
    "policy",
    "class",
    "turns ok",
    "prompt tokens computed / ideal",
    "computed / ideal",
    "computed / lru's",
    "TTFT p50 s",
    "TTFT p90 s",
    "TTFT p90 s, later turns",
    "decode tok/s p50",
    f"agent returns <= {RETURN_WINDOW_S:g} s found on device",
]


def mib(x: float) -> str:
    return "-" if math.isnan(x) else f"{x / 2**20:,.1f}"


def tier_rows(runs: Sequence[Run]) -> list[list[object]]:
    rows: list[list[object]] = []
    for run in runs:
        moved = "kvchat:kv_bytes_moved_total"
        hits = "kvchat:session_hits_total"
        pre = "kvchat:session_prefetches_total"
        live = run.replay.live_tokens
        rows.append(
            [
                run.scenario,
                run.policy,
                f"{run.replay.wall_s:.0f}",
                f"{run.load_start:.2f} / {run.load_end:.2f}",
                " / ".join(
                    mib(run.metric(moved, **{"from": a, "to": b}))
                    for a, b in (
                        ("device", "host"),
                        ("host", "device"),
                        ("device", "disk"),
                        ("disk", "device"),
                    )
                ),
                " / ".join(f"{run.metric(hits, tier=t):.0f}" for t in ("device", "host", "disk")),
                " / ".join(
                    f"{run.metric(pre, outcome=o):.0f}" for o in ("issued", "used", "wasted")
                ),
                f"{run.metric('kvchat:session_holds_broken_total'):.0f} / "
                f"{run.metric('kvchat:admissions_held_back_total'):.0f}",
                f"{run.metric('kvchat:num_preemptions_total'):.0f}",
                " / ".join(
                    f"{run.metric('kvchat:cached_tokens_total', source=s):,.0f}"
                    for s in ("session", "prefix_cache", "host", "kv_store")
                ),
                f"{run.metric('kvchat:computed_prompt_tokens_total'):,.0f}",
                f"{statistics.mean(live):,.0f} / {max(live):,}" if live else "-",
            ]
        )
    return rows


TIER_HEADER = [
    "workload",
    "policy",
    "wall s",
    "load avg 1 min, start / end",
    "MiB moved device>host / host>device / device>disk / disk>device",
    "session hits device / host / disk",
    "prefetches issued / used / wasted",
    "holds broken / requests that waited on one",
    "preemptions",
    "cached tokens: session / prefix cache / host / KV store",
    "prompt tokens computed (engine, incl. recomputed)",
    "live sessions' KV tokens, mean / peak (usage)",
]


TIERS = ("device", "host", "disk", "none", "unknown")


def return_rows(runs: Sequence[Run]) -> list[list[object]]:
    """Per run and class, the later turns by where their session's KV was just before: how
    many, and their TTFT p50."""
    rows: list[list[object]] = []
    for run in runs:
        for klass in CLASSES:
            later = [
                r
                for r in run.replay.records
                if r.klass == klass and r.tier_before is not None and r.error is None
            ]
            cells = []
            for tier in TIERS:
                ttft = [r.ttft_s for r in later if r.tier_before == tier and r.ttft_s is not None]
                cells.append(f"{len(ttft)} ({seconds(quantile(ttft, 0.5))})" if ttft else "0")
            rows.append([run.scenario, run.policy, PLURAL[klass], *cells])
    return rows


def probe_goals(typing: TypingProbe | None, restart: RestartProbe | None) -> list[Goal]:
    nan = float("nan")
    return [
        Goal(
            "typing >= 1 s ahead, session pushed to disk: TTFT / a session left on the device",
            typing.ratio if typing else nan,
            1.2,
        ),
        Goal(
            "keyless client, prompt_cache_key + 24h, server restarted: second prompt from cache",
            restart.share if restart else nan,
            0.95,
            at_most=False,
        ),
    ]


def probe_text(typing: TypingProbe | None, restart: RestartProbe | None, notes: str) -> str:
    out = []
    if typing is not None:
        med = statistics.median
        out.append(
            f"Typing from disk: three conversations of the same {typing.context_tokens:,}-token "
            "opening on a fresh predictive server (default pools, no pressure); each later "
            "turn in rotating order: (a) the session pushed to disk (POST "
            "/v1/admin/sessions/{id}/evict?offload=false; its tier after: "
            f"{', '.join(sorted(set(typing.tiers_after_push)))}) and its user typing "
            f"{typing.lead_s:g} s before the message, (b) the session left on the device, (c) "
            "pushed to disk, no typing; (b) and (c) silent as long before their message (the "
            "server idle as long before each). Server TTFT, median of "
            f"{len(typing.device)}: (a) {med(typing.disk_typing):.3f} s, (b) "
            f"{med(typing.device):.3f} s, (c) {med(typing.disk_silent):.3f} s; (a) / (b) "
            f"{typing.ratio:.2f}x, (c) / (b) {med(typing.disk_silent) / med(typing.device):.2f}x.\n"
        )
    if restart is not None:
        served = {
            s: restart.metrics.get(f"kvchat:cached_tokens_total{{source={s}}}", float("nan"))
            for s in ("session", "prefix_cache", "host", "kv_store")
        }
        out.append(
            "Restart: a keyless Chat Completions client (no X-Session-Id; `prompt_cache_key`, "
            '`prompt_cache_retention: "24h"`), turn one with a '
            f"{restart.first_prompt:,}-token prompt and a {restart.first_completion}-token reply; "
            "the KV store settled; the server restarted (same database and KV store); turn two "
            f"({restart.second_prompt:,} tokens: the history, the reply, a short question): "
            f"{restart.second_cached:,} served from cache ({restart.share:.1%}; a cache holding "
            f"all of turn one would serve {restart.best_share:.1%}); the restarted server's cached "
            "tokens by source: " + ", ".join(f"{k} {v:,.0f}" for k, v in served.items()) + ".\n"
        )
    if notes:
        out.append(f"Probe errors: {notes}.\n")
    return "\n".join(out)


def report(
    args: argparse.Namespace,
    plan: Plan,
    pools: PoolSizes,
    bytes_per_token: tuple[int, int | None],
    runs: Sequence[Run],
    probes: tuple[TypingProbe | None, RestartProbe | None, str],
    started: time.struct_time,
    load_start: tuple[float, float, float],
) -> str:
    config = plan.config
    computed_bpt, served_bpt = bytes_per_token
    thinks = [t.think_s for p in plan.people for t in p.turns[1:]]
    typing_states = sorted({r.replay.typing for r in runs if r.scenario == MIXED})
    device_tokens, host_tokens = (
        pools.device_bytes // computed_bpt,
        pools.host_bytes // computed_bpt,
    )
    settings: dict[str, object] = {
        "command": " ".join(["python bench/retention.py", *sys.argv[1:]]),
        "model": f"{args.model.name}, {args.dtype}; KV per token from its config: 2 x "
        f"{plan_layers(args.model, args.dtype)} = {computed_bpt:,} B (the server reports "
        f"{served_bpt if served_bpt is not None else '?'} B)",
        "pools (every policy)": f"device {pools.device_bytes / 2**20:.1f} MiB ({device_tokens:,} "
        f"tokens), host {pools.host_bytes / 2**20:.1f} MiB ({host_tokens:,} tokens), blocks of "
        f"{BLOCK_SIZE}; the live sessions' KV on the plan's nominal timeline "
        f"({config.nominal_turn_s:g} s a request): mean {pools.live_mean_tokens:,.0f} tokens, "
        f"peak {pools.live_peak_tokens:,}: {pools.pressure:.1f}x device + host (asked "
        f"{args.pressure:g}x; the device holds at least two requests of the longest sessions)",
        "KV store": f"pinned and predictive: on ({args.kv_store_bytes / 2**30:g} GiB cap, a "
        "fresh directory per server); lru: off (--kv-store-bytes 0)",
        "agents": f"{len(plan.agents)} tasks arriving uniformly over the first "
        f"{config.agents_arrival_s:g} s, {config.calls[0]}-{config.calls[1]} tool calls each "
        f"({sum(len(a.steps) for a in plan.agents)} in all) and a last step that answers; tool "
        f"latency uniform {config.tool_latency_s[0]:g}-{config.tool_latency_s[1]:g} s; results "
        f"of {config.result_words[0]}-{config.result_words[1]} words; calls up to "
        f"{config.call_tokens} tokens, the answer up to {config.answer_tokens}; greedy",
        "people": f"{len(plan.people)} conversations arriving over the first "
        f"{config.people_arrival_s:g} s, taking turns for {config.duration_s:g} s (nominally; "
        f"{sum(len(p.turns) for p in plan.people)} turns in all, 1-{config.max_person_turns} "
        f"each), a {config.document_words}-word text in the first message, "
        f"{config.message_words[0]}-{config.message_words[1]}-word messages, "
        f"{config.reply_tokens}-token replies (ignore_eos); think times log-normal (median "
        f"{THINK_MEDIAN_S:g} s, log sigma {THINK_SIGMA}) / {config.compression:g} (time "
        f"compressed {config.compression:g}x): median {statistics.median(thinks):.1f} s, p90 "
        f"{quantile(thinks, 0.9):.1f} s, longest {max(thinks):.1f} s in this plan; the "
        f"WebSocket open through the conversation; a typing frame {config.typing_lead_s:g} s "
        f"before each later message ({', '.join(typing_states) or 'not run'})",
        "shared prefixes": ", ".join(
            f"{PLURAL[k]} {v} tokens"
            for k, v in (runs[0].replay.shared_prefix.items() if runs else [])
        ),
        "seed": str(config.seed),
        "time limit": f"{args.time_limit:g} s a run",
    }
    header = machine_header(
        "Retention under memory pressure: lru vs pinned vs predictive (bench/retention.py)",
        settings,
        started=started,
        load_start=load_start,
    )
    summaries = {r.policy: r.summary() for r in runs if r.scenario == MIXED}
    goals = mixed_goals(summaries) + probe_goals(probes[0], probes[1])
    silent = next((r for r in runs if r.scenario == SILENT), None)
    typed = next((r for r in runs if r.scenario == MIXED and r.policy == "predictive"), None)
    parts = [
        header,
        "\n## By class\n\n",
        markdown_table(CLASS_HEADER, class_rows(runs)),
        "\n## Where returning sessions were\n\nLater turns by the tier their session's KV was in "
        "just before the request (GET /v1/admin/sessions/{id}; for people after their typing "
        "frame): how many, and their TTFT p50 in seconds.\n\n",
        markdown_table(["workload", "policy", "class", *TIERS], return_rows(runs)),
        "\n## Tiers, from /metrics over each run\n\n",
        markdown_table(TIER_HEADER, tier_rows(runs)),
        "\n## Probes\n\n",
        probe_text(*probes),
        "\n## Goals\n\n",
        markdown_table(
            ["goal", "measured", "target", ""],
            [
                [
                    g.name,
                    "-" if math.isnan(g.measured) else f"{g.measured:.2f}",
                    g.target_text,
                    g.verdict,
                ]
                for g in goals
            ],
        ),
    ]
    if silent is not None and typed is not None:
        people_typed = typed.summary().by_class[PERSON]
        people_silent = silent.summary().by_class[PERSON]
        parts.append(
            f"\nTyping frames, predictive: people's TTFT p50 {seconds(people_typed.ttft_p50_s)} s "
            f"with them, {seconds(people_silent.ttft_p50_s)} s without (p90 "
            f"{seconds(people_typed.ttft_p90_s)} s, {seconds(people_silent.ttft_p90_s)} s).\n"
        )
    answered = ", ".join(f"{r.policy} {r.replay.answers_in_text}/{len(plan.agents)}" for r in runs)
    errors = [f"{r.scenario}, {r.policy}: {e}" for r in runs for e in r.replay.errors]
    parts.append(
        "\n## Notes\n\n"
        "- TTFT is the server's (each reply's `timings.ttft_ms`: from the turn's start, queueing "
        "included, to its first generated token), for both classes alike: a tool call is sent "
        "whole once parsed, so a client sees no earlier token of it. TTFT p90 (the goal's) "
        "counts every turn, the first ones included, which no policy has anything cached for; "
        "later turns' p90 is where retention acts.\n"
        "- Ideal = the prompt tokens no earlier turn of the session had: a later turn's prompt "
        "less the previous turn's prompt and reply tokens (its end-of-turn tokens, the new "
        "message or tool result and the generation prompt are new); a first turn's prompt less "
        "its class's shared prefix (system prompt, tools, the user turn's header), which a "
        "warm-up request computed before each run.\n"
        "- Computed = prompt - cached tokens of each reply's usage; the engine's count "
        "(/metrics) adds what preemptions recomputed and the warm-up's and probes' requests "
        "are not in it.\n"
        f"- An agent's return is found on the device when GET /v1/admin/sessions/{{id}} said "
        "its KV was on the device just before the tool result was posted "
        f"(returns within {RETURN_WINDOW_S:g} s: every tool latency of the plan is under it).\n"
        f"- Agents' last steps that answered in text (tool_choice auto; the others called a "
        f"tool again and the task ended there): {answered}.\n"
        f"- The predictive policy's person prior expects gaps of {THINK_MEDIAN_S:g} s; this "
        f"run's are {config.compression:g}x shorter, which it learns online (per owner and class, "
        "then per session). Nothing tells the server the time is compressed.\n"
        f"- {WHY_OWN_REPLAY}\n"
    )
    if errors:
        parts.append("- Errors: " + "; ".join(errors[:20]) + "\n")
    parts.append("\n![TTFT and prompt tokens computed, by policy and class](retention.png)\n")
    return "".join(parts)


def plan_layers(model: Path, dtype: str) -> str:
    """The factors of the KV bytes per token, as words (for the header)."""
    config = json.loads((model / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (
        f"{config['num_hidden_layers']} layers x {heads} KV heads x {head_dim} x "
        f"{DTYPE_BYTES[dtype]} B"
    )


def plot(runs: Sequence[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = [r.policy + ("\nno typing" if r.scenario == SILENT else "") for r in runs]
    colors = [POLICY_COLORS[r.policy] for r in runs]
    hatches = {AGENT: "", PERSON: "//"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.38
    for k, klass in enumerate(CLASSES):
        xs = [i + (k - 0.5) * width for i in range(len(runs))]
        s = [r.summary().by_class[klass] for r in runs]
        a.bar(xs, [x.ttft_p90_s for x in s], width, color=colors, alpha=0.4, hatch=hatches[klass])
        a.bar(xs, [x.ttft_p50_s for x in s], width, color=colors, hatch=hatches[klass])
        b.bar(xs, [x.computed_over_ideal for x in s], width, color=colors, hatch=hatches[klass])
    handles = [Patch(facecolor="white", edgecolor="black", hatch=hatches[c]) for c in CLASSES]
    for ax in (a, b):
        ax.set_xticks(range(len(runs)), labels)
        ax.legend(handles, [PLURAL[c] for c in CLASSES])
    a.set_ylabel("server TTFT (s): p50 solid, p90 light")
    a.set_yscale("log")
    b.set_ylabel("prompt tokens computed / ideal")
    b.axhline(1.0, ls=":", color="#888888")
    fig.suptitle("Retention under memory pressure, agents and people at once (SmolLM2-135M, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    config = WorkloadConfig(
        seed=args.seed, compression=args.compression, typing_lead_s=args.typing_lead
    )
    if args.quick:
        config = replace(
            config,
            duration_s=45.0,
            num_agents=2,
            agents_arrival_s=20.0,
            calls=(3, 4),
            num_people=4,
            people_arrival_s=10.0,
            max_person_turns=3,
            document_words=120,
        )
    return config


def main() -> int:
    stop_servers_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / PRESET)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--quick", action="store_true", help="a short smoke run (a few minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compression", type=float, default=4.0, help="people's think times / this")
    ap.add_argument(
        "--typing-lead", type=float, default=2.0, help="typing frame, s before a message"
    )
    ap.add_argument(
        "--pressure", type=float, default=3.5, help="live sessions' KV / (device + host)"
    )
    ap.add_argument("--kv-store-bytes", type=int, default=2 * 2**30)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--no-silent", action="store_true", help="skip predictive without typing")
    ap.add_argument("--probe-repeats", type=int, default=5)
    ap.add_argument("--probe-typing-lead", type=float, default=1.5)
    ap.add_argument("--probe-words", type=int, default=900, help="the probes' opening text")
    ap.add_argument("--time-limit", type=float, default=None, help="s a run may take")
    ap.add_argument("--out", type=Path, default=RESULTS / "retention.md")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    if unknown := set(policies) - set(POLICIES):
        ap.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    if args.time_limit is None:
        args.time_limit = 300.0 if args.quick else 1200.0
    if args.quick:
        args.probe_repeats, args.probe_words = (
            min(args.probe_repeats, 2),
            min(args.probe_words, 400),
        )
    started, load_start = time.gmtime(), os.getloadavg()
    ensure_model(args.model, PRESET)

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    plan = make_plan(workload_config(args))
    spans = nominal_spans(plan, count, plan.config.nominal_turn_s)
    model_config = json.loads((args.model / "config.json").read_text())
    bytes_per_token = kv_bytes_per_token(model_config, DTYPE_BYTES[args.dtype])
    print(f"KV per token: 2 x {plan_layers(args.model, args.dtype)} = {bytes_per_token:,} B")
    pools = size_pools(
        live_tokens(spans),
        running_tokens(spans),
        bytes_per_token=bytes_per_token,
        block_size=BLOCK_SIZE,
        pressure=args.pressure,
        host_share=1 / 3,
    )
    print(
        f"pools: device {pools.device_bytes / 2**20:.1f} MiB, host "
        f"{pools.host_bytes / 2**20:.1f} MiB; the live sessions' KV (nominal): mean "
        f"{pools.live_mean_tokens:,.0f} tokens, peak {pools.live_peak_tokens:,} = "
        f"{pools.pressure:.1f}x device + host"
    )
    scenarios = [(MIXED, p) for p in policies]
    if "predictive" in policies and not args.no_silent:
        scenarios.append((SILENT, "predictive"))
    total = len(scenarios) * plan.num_requests + 3 + 3 * args.probe_repeats + 2
    runs: list[Run] = []
    served_bpt: int | None = None
    with tempfile.TemporaryDirectory(prefix="kvchat-retention-") as tmp:
        data = Path(tmp)
        keys = Keys.create(data)
        with tqdm(total=total, desc="requests", unit="req") as bar:
            for scenario, policy in scenarios:
                if scenario == SILENT and any(r.replay.typing == "unsupported" for r in runs):
                    bar.update(plan.num_requests)  # no typing frames: nothing to compare
                    continue
                bar.set_postfix_str(f"{scenario}: {policy}")
                run, served_bpt = run_policy(scenario, policy, plan, args, pools, data, keys, bar)
                runs.append(run)
            bar.set_postfix_str("probes")
            probes = run_probes(plan, args, data, keys, bar)
    text = report(
        args, plan, pools, (bytes_per_token, served_bpt), runs, probes, started, load_start
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    plot(runs, args.out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
