"""Multi-turn chat on the same workload in one process, in three scenarios:

- ample: a pool that holds every conversation; (a) sessions + prefix cache, (b) prefix cache
  only, (c) no cache (the whole history recomputed every turn).
- pressure: many more live conversations than the pool holds (about a third), interleaved with
  think time; (a) sessions + host offload + prefix cache, (b) prefix cache only with LRU
  eviction (what vLLM does), (c) sessions + prefix cache without a host tier (evicted sessions
  are dropped and recomputed).
- long: conversations several times longer than their context budget, history planned each
  turn under the policies drop (watermarks), drop_oldest and summarize (see
  bench/long_conversations.py).

    python bench/multiturn.py [--scenario all|ample|pressure|long] [--model models/bench]

Prints and writes, per scenario, TTFT p50/p99 (overall and by turn), prefill tokens computed
against the minimum possible, hit rate, offloads/restores/drops and KV bytes moved between the
pool and the host; bench/results/multiturn.md gets one section per scenario (a run of one
scenario rewrites only its own section) and a plot per scenario (multiturn.png,
multiturn_pressure.png: TTFT by turn)."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.bench.long_conversations import POLICIES as LONG_POLICIES
from kvchat.bench.long_conversations import LongConfig, run_policy
from kvchat.bench.long_conversations import report as report_long
from kvchat.bench.workload import TurnRecord, WorkloadConfig, make_conversations, run_workload
from kvchat.inference.engine.config import DTYPES, EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.scheduler import SchedulerConfig
from kvchat.inference.model.config import ModelConfig
from kvchat.memory.config import CacheConfig
from kvchat.memory.kv_spec import KVCacheSpec


@dataclass(frozen=True)
class Variant:
    prefix_cache: bool
    sessions: bool
    host_tier: bool = False


@dataclass
class Result:
    records: list[TurnRecord]
    minimum: int
    stats: dict[str, float]
    wall: float
    bytes_per_block: int

    @property
    def computed(self) -> int:
        return int(self.stats["computed"] + self.stats["recomputed"])

    @property
    def bytes_moved(self) -> int:
        blocks = self.stats["blocks_to_host"] + self.stats["blocks_from_host"]
        return int(blocks * self.bytes_per_block)

    def merged(self, other: Result) -> Result:
        """Two runs of the same variant as one: their turns together, their counters summed
        (the hit rate recomputed from the summed counts)."""
        stats = {k: self.stats[k] + other.stats.get(k, 0.0) for k in self.stats}
        stats["hit_rate"] = (
            stats["reused"] / stats["prompt_tokens"] if stats["prompt_tokens"] else 0.0
        )
        return Result(
            self.records + other.records,
            self.minimum + other.minimum,
            stats,
            self.wall + other.wall,
            self.bytes_per_block,
        )

    def ttft_by_turn(self) -> dict[int, list[float]]:
        groups: dict[int, list[float]] = {}
        for r in self.records:
            groups.setdefault(r.turn, []).append(r.ttft)
        return groups


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    workload: WorkloadConfig
    variants: dict[str, Variant]
    late_turn: int  # "late" turns, where the goal is judged
    describe: str
    # Pool size in blocks for a workload (None: --kv-cache-gib), host pool in blocks.
    pool_blocks: Callable[[WorkloadConfig, int], int | None] = lambda w, bs: None
    host_blocks: Callable[[WorkloadConfig, int], int] = lambda w, bs: 0
    extra: dict[str, str] = field(default_factory=dict)


def final_lengths(workload: WorkloadConfig) -> list[int]:
    """Tokens of each conversation's whole history at its end (prompt + answers + markup)."""
    _, convs = make_conversations(workload, 100_000)
    return [
        len(conv.history)
        + sum(len(u) + 6 for u in conv.user_messages)
        + sum(n + 2 for n in conv.answer_lengths)
        + 3 * conv.turns
        for conv in convs
    ]


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


AMPLE = Scenario(
    name="ample",
    title="Multi-turn chat, ample pool: sessions vs prefix cache vs no cache",
    workload=WorkloadConfig(conversations=6, min_turns=12, max_turns=18),
    variants={
        "a: sessions + prefix cache": Variant(prefix_cache=True, sessions=True),
        "b: prefix cache only": Variant(prefix_cache=True, sessions=False),
        "c: no cache": Variant(prefix_cache=False, sessions=False),
    },
    late_turn=8,
    describe="closed loop (next turn sent when the answer completes)",
)

PRESSURE_WORKLOAD = WorkloadConfig(
    conversations=24,
    min_turns=6,
    max_turns=8,
    system_tokens=300,
    user_tokens=(30, 80),
    assistant_tokens=(16, 32),
    think_time=(4.0, 10.0),
    stagger=0.4,
)
PRESSURE = Scenario(
    name="pressure",
    title="Multi-turn chat under memory pressure: sessions + host tier vs prefix-cache LRU",
    workload=PRESSURE_WORKLOAD,
    variants={
        "a: sessions + host offload + prefix cache": Variant(True, True, host_tier=True),
        "b: prefix cache only (LRU)": Variant(prefix_cache=True, sessions=False),
        "c: sessions + prefix cache, no host tier": Variant(True, True, host_tier=False),
    },
    late_turn=4,
    describe="think time 4-10 s between an answer and the next turn, conversations starting "
    "0.4 s apart, at most 6 running at once",
    # The device pool holds about a third of what all conversations hold at their end; the
    # host pool holds all of it.
    pool_blocks=lambda w, bs: blocks_for(sum(final_lengths(w)), bs) // 3,
    host_blocks=lambda w, bs: blocks_for(sum(final_lengths(w)), bs) + w.conversations,
    extra={"max running": "6"},
)

LONG = Scenario(
    name="long",
    title="Long conversations: history policies under a small context budget",
    workload=WorkloadConfig(),
    variants={},
    late_turn=0,
    describe="",
)

SCENARIOS = {s.name: s for s in (AMPLE, PRESSURE, LONG)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def bytes_per_block(model_dir: Path, args: argparse.Namespace) -> int:
    config = ModelConfig.from_dir(model_dir)
    spec = KVCacheSpec(
        config.num_layers, config.num_kv_heads, config.head_dim, args.block_size, DTYPES[args.dtype]
    )
    return spec.bytes_per_block


def run_scenario(
    scenario: Scenario, model_dir: Path, args: argparse.Namespace
) -> dict[str, Result]:
    workload = scenario.workload
    bs = args.block_size
    pool_blocks = scenario.pool_blocks(workload, bs)
    host_blocks = scenario.host_blocks(workload, bs)
    max_seqs = int(scenario.extra.get("max running", 64))
    results: dict[str, Result] = {}
    names = list(scenario.variants)
    # Variants interleaved: `repeats` rounds of all of them, in a rotating order, so a swing
    # in the machine's load falls on every variant alike.
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            run = run_variant(scenario, name, model_dir, args, pool_blocks, host_blocks, max_seqs)
            results[name] = results[name].merged(run) if name in results else run
    return {name: results[name] for name in names}


def run_variant(
    scenario: Scenario,
    name: str,
    model_dir: Path,
    args: argparse.Namespace,
    pool_blocks: int | None,
    host_blocks: int,
    max_seqs: int,
) -> Result:
    """One run of the whole workload under one variant, on a fresh engine."""
    workload = scenario.workload
    bs = args.block_size
    variant = scenario.variants[name]
    host_bytes = host_blocks * bytes_per_block(model_dir, args) if variant.host_tier else 0
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            dtype=args.dtype,
            device="cpu",
            cache=CacheConfig(
                block_size=bs,
                kv_cache_bytes=None if pool_blocks else int(args.kv_cache_gib * 2**30),
                num_blocks_override=pool_blocks,
                enable_prefix_caching=variant.prefix_cache,
                enable_sessions=variant.sessions,
                host_cache_bytes=host_bytes,
            ),
            scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048),
        )
    )
    _, convs = make_conversations(workload, engine.model_config.vocab_size)
    with tqdm(total=sum(c.turns for c in convs), desc=name, unit="turn") as bar:
        start = time.perf_counter()
        records, minimum = run_workload(
            engine, workload, variant.sessions, on_turn=lambda: bar.update(1)
        )
        wall = time.perf_counter() - start
    if scenario.name == "pressure":
        print(
            f"{name}: pool {engine.layout.num_blocks} blocks, host "
            f"{engine.layout.num_host_blocks} blocks"
        )
    return Result(records, minimum, engine.stats.snapshot(), wall, engine.layout.bytes_per_block)


def report_scenario(
    scenario: Scenario,
    results: dict[str, Result],
    model_dir: Path,
    args: argparse.Namespace,
    started: tuple[time.struct_time, tuple[float, float, float]],
) -> tuple[str, str]:
    """(markdown section, goal line)"""
    workload = scenario.workload
    names = list(scenario.variants)
    a, b, c = names
    summary = []
    for name, r in results.items():
        ttfts = [x.ttft for x in r.records]
        summary.append(
            [
                name,
                f"{percentile(ttfts, 50) * 1e3:.0f}",
                f"{percentile(ttfts, 99) * 1e3:.0f}",
                f"{r.computed:,}",
                f"{r.minimum:,}",
                f"{r.computed / r.minimum:.3f}",
                f"{r.stats['hit_rate']:.3f}",
                int(r.stats["session_offloads"]),
                int(r.stats["session_restores"]),
                int(r.stats["session_drops"]),
                int(r.stats["preemptions_swap"] + r.stats["preemptions_recompute"]),
                f"{r.bytes_moved / 2**20:.1f}",
                f"{r.wall:.0f}",
            ]
        )
    by_turn = {name: r.ttft_by_turn() for name, r in results.items()}
    max_turn = max(r.turn for res in results.values() for r in res.records)
    turn_rows = []
    for turn in range(1, max_turn + 1):
        row: list[object] = [turn]
        for name in names:
            values = by_turn[name].get(turn, [])
            row.append(
                f"{statistics.median(values) * 1e3:.0f} / {percentile(values, 99) * 1e3:.0f}"
                if values
                else "-"
            )
        va, vb = by_turn[a].get(turn), by_turn[b].get(turn)
        row.append(f"{statistics.median(vb) / statistics.median(va):.1f}x" if va and vb else "-")
        turn_rows.append(row)

    def late(name: str) -> float:
        return statistics.median(
            [t for turn, v in by_turn[name].items() if turn >= scenario.late_turn for t in v]
        )

    ratio_a = results[a].computed / results[a].minimum
    if scenario.name == "ample":
        # Sessions sit on the prefix cache: at no turn may they cost more than it alone.
        worst_turn, worst = max(
            (
                (turn, statistics.median(by_turn[a][turn]) / statistics.median(by_turn[b][turn]))
                for turn in by_turn[a]
                if turn in by_turn[b]
            ),
            key=lambda x: x[1],
        )
        goal = (
            f"At turns >= {scenario.late_turn}, median TTFT of (c) / (a) = "
            f"{late(c) / late(a):.1f}x (goal >= 10x) and of (b) / (a) = "
            f"{late(b) / late(a):.2f}x (goal >= 1, within noise); the worst turn for (a) "
            f"against (b) is turn {worst_turn}, p50 (a) / (b) = {worst:.2f}x; prefill "
            f"computed by (a) = {ratio_a:.3f}x the minimum (goal <= 1.05x)."
        )
    else:
        goal = (
            f"At turns >= {scenario.late_turn}, median TTFT of (b) / (a) = "
            f"{late(b) / late(a):.1f}x (goal >= 3x); prefill computed: (a) "
            f"{ratio_a:.3f}x the minimum (goal <= 1.1x), (b) "
            f"{results[b].computed / results[b].minimum:.2f}x, (c) "
            f"{results[c].computed / results[c].minimum:.2f}x."
        )
    settings: dict[str, object] = {
        "model": f"{model_dir.name} preset, {args.dtype}, block size {args.block_size}",
        "workload": f"{workload.conversations} conversations x {workload.min_turns}-"
        f"{workload.max_turns} turns, shared system prompt of "
        f"{workload.system_tokens} tokens, user turns {workload.user_tokens[0]}-"
        f"{workload.user_tokens[1]} tokens, assistant turns "
        f"{workload.assistant_tokens[0]}-{workload.assistant_tokens[1]} tokens "
        f"(greedy), {scenario.describe}; variants interleaved, {args.repeats} runs of "
        "each on a fresh engine",
        "command": f"python bench/multiturn.py --scenario {scenario.name}",
    }
    if scenario.name == "pressure":
        lengths = final_lengths(workload)
        bs = args.block_size
        settings["memory"] = (
            f"all conversations end holding {sum(lengths):,} tokens "
            f"({blocks_for(sum(lengths), bs)} blocks); device pool "
            f"{scenario.pool_blocks(workload, bs)} blocks (a third), host pool "
            f"{scenario.host_blocks(workload, bs)} blocks for (a)"
        )
    section = machine_header(
        scenario.title, settings, started=started[0], load_start=started[1]
    ).replace("# ", "## ", 1)
    section += "\n### Summary\n\n" + markdown_table(
        [
            "variant",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "prefill computed",
            "minimum possible",
            "computed / minimum",
            "hit rate",
            "offloads",
            "restores",
            "drops",
            "preemptions",
            "KV MiB moved",
            "wall s",
        ],
        summary,
    )
    section += "\n### TTFT by turn, p50 / p99 (ms)\n\n" + markdown_table(
        ["turn", *names, "b / a (p50)"], turn_rows
    )
    section += f"\n{goal}\n"
    suffix = "" if scenario.name == "ample" else f"_{scenario.name}"
    plot(by_turn, scenario, args.out.parent / f"{args.out.stem}{suffix}.png")
    section += f"\n![TTFT by turn]({args.out.stem}{suffix}.png)\n"
    return section, goal


def run_long(
    model_dir: Path,
    args: argparse.Namespace,
    started: tuple[time.struct_time, tuple[float, float, float]],
) -> str:
    config = LongConfig()
    runs = {p: run_policy(model_dir, args.dtype, config, p) for p in LONG_POLICIES}
    tables, goal = report_long(runs, config, args.out.parent / f"{args.out.stem}_long.png")
    section = machine_header(
        LONG.title,
        {
            "model": f"{model_dir.name} preset, {args.dtype}, block size 16",
            "workload": f"{config.conversations} conversations x {config.turns} turns at once "
            f"(closed loop), user turns {config.user_tokens[0]}-{config.user_tokens[1]} "
            f"words, replies {config.reply_tokens} tokens (sampled, seeded), context "
            f"budget {config.max_context_tokens} tokens per conversation, summaries up "
            f"to {config.max_summary_tokens} tokens at low priority",
            "command": "python bench/multiturn.py --scenario long",
        },
        started=started[0],
        load_start=started[1],
    ).replace("# ", "## ", 1)
    section += "\n" + tables + f"\n{goal}\n\n![long conversations]({args.out.stem}_long.png)\n"
    return section


def write_sections(path: Path, sections: dict[str, str]) -> None:
    """Rewrite the given scenarios' sections of the results file, keep the others."""
    existing = path.read_text() if path.exists() else ""
    found = dict(re.findall(r"<!-- scenario:(\w+) -->\n(.*?)<!-- /scenario -->\n", existing, re.S))
    found.update(sections)
    text = "# Multi-turn chat benchmarks (bench/multiturn.py)\n\n"
    for name in SCENARIOS:
        if name in found:
            text += f"<!-- scenario:{name} -->\n{found[name]}<!-- /scenario -->\n\n"
    path.write_text(text.rstrip() + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=["all", *SCENARIOS], default="all")
    ap.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--kv-cache-gib", type=float, default=1.0, help="pool size of the ample scenario"
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="bfloat16 runs ~2.5x faster than float32 on AVX-512 CPUs",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each variant, interleaved (ample and pressure)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "multiturn.md")
    args = ap.parse_args()

    model_dir = ensure_model(args.model, "bench")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    chosen = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    sections = {}
    for name in chosen:
        scenario = SCENARIOS[name]
        started = (time.gmtime(), os.getloadavg())
        if scenario is LONG:
            section = run_long(model_dir, args, started)
        else:
            results = run_scenario(scenario, model_dir, args)
            section, _ = report_scenario(scenario, results, model_dir, args, started)
        sections[name] = section
        print(section)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_sections(args.out, sections)
    print(f"wrote {args.out}")


def plot(by_turn: dict[str, dict[int, list[float]]], scenario: Scenario, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    for name, groups in by_turn.items():
        turns = sorted(groups)
        ax.plot(turns, [statistics.median(groups[t]) * 1e3 for t in turns], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("turn number")
    ax.set_ylabel("median time to first token (ms, log scale)")
    ax.set_title(scenario.title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
