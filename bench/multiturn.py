"""Multi-turn chat: kvchat with sessions and prefix cache (a), prefix cache only (b), and no
cache (c, the whole history recomputed every turn), on the same workload in one process.

    python bench/multiturn.py [--conversations 6] [--model models/bench]

Prints per-turn TTFT p50/p99, decode tokens/s, prefill tokens computed against the minimum
possible, hit rate, and the TTFT ratio c/a at the last turns; writes
bench/results/multiturn.md and multiturn.png (TTFT by turn number)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from bench.workload import TurnRecord, WorkloadConfig, make_conversations, run_workload
from inference.engine import Engine
from inference.engine_config import EngineConfig
from inference.scheduler import SchedulerConfig
from memory.config import CacheConfig

VARIANTS = {
    "a: sessions + prefix cache": dict(enable_prefix_caching=True, sessions=True),
    "b: prefix cache only": dict(enable_prefix_caching=True, sessions=False),
    "c: no cache": dict(enable_prefix_caching=False, sessions=False),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--min-turns", type=int, default=12)
    ap.add_argument("--max-turns", type=int, default=18)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--dtype", default="bfloat16",
                    help="bfloat16 runs ~2.5x faster than float32 on AVX-512 CPUs")
    ap.add_argument("--out", type=Path, default=RESULTS / "multiturn.md")
    args = ap.parse_args()

    model_dir = ensure_model(args.model, "bench")
    workload = WorkloadConfig(conversations=args.conversations, min_turns=args.min_turns,
                              max_turns=args.max_turns)
    results: dict[str, tuple[list[TurnRecord], int, dict[str, float], float]] = {}
    total_turns = None
    for name, variant in VARIANTS.items():
        engine = Engine(EngineConfig(
            model=str(model_dir), dtype=args.dtype, device="cpu",
            cache=CacheConfig(block_size=args.block_size,
                              kv_cache_bytes=int(args.kv_cache_gib * 2**30),
                              enable_prefix_caching=variant["enable_prefix_caching"]),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
        ))
        if total_turns is None:
            _, convs = make_conversations(workload, engine.model_config.vocab_size)
            total_turns = sum(c.turns for c in convs)
        with tqdm(total=total_turns, desc=name, unit="turn") as bar:
            start = time.perf_counter()
            records, minimum = run_workload(engine, workload, bool(variant["sessions"]),
                                            on_turn=lambda: bar.update(1))
            wall = time.perf_counter() - start
        results[name] = (records, minimum, engine.stats.snapshot(), wall)

    rows = []
    for name, (records, minimum, stats, wall) in results.items():
        ttfts = [r.ttft for r in records]
        decode_rate = sum(r.decode_tokens for r in records) / sum(r.decode_seconds for r in records)
        computed = int(stats["computed"] + stats["recomputed"])
        rows.append([
            name, f"{percentile(ttfts, 50) * 1e3:.0f}", f"{percentile(ttfts, 99) * 1e3:.0f}",
            f"{decode_rate:.1f}", f"{computed:,}", f"{minimum:,}", f"{computed / minimum:.3f}",
            f"{stats['hit_rate']:.3f}", f"{wall:.0f}",
        ])

    max_turn = max(r.turn for recs, *_ in results.values() for r in recs)
    by_turn: dict[str, dict[int, list[float]]] = {}
    for name, (records, *_rest) in results.items():
        groups: dict[int, list[float]] = {}
        for r in records:
            groups.setdefault(r.turn, []).append(r.ttft)
        by_turn[name] = groups
    a, _, c = list(VARIANTS)
    turn_rows = []
    for turn in range(1, max_turn + 1):
        row: list[object] = [turn]
        for name in VARIANTS:
            values = by_turn[name].get(turn, [])
            row.append(f"{statistics.median(values) * 1e3:.0f}" if values else "-")
        va, vc = by_turn[a].get(turn), by_turn[c].get(turn)
        row.append(f"{statistics.median(vc) / statistics.median(va):.1f}x" if va and vc else "-")
        turn_rows.append(row)
    late = min(8, max_turn)
    late_a = [t for turn, v in by_turn[a].items() if turn >= late for t in v]
    late_c = [t for turn, v in by_turn[c].items() if turn >= late for t in v]
    late_ratio = statistics.median(late_c) / statistics.median(late_a)
    a_ratio = float(rows[0][6])

    report = machine_header("Multi-turn chat: sessions vs prefix cache vs no cache", {
        "model": f"{model_dir.name} preset, {args.dtype}, block size {args.block_size}",
        "workload": f"{workload.conversations} conversations x {workload.min_turns}-"
                    f"{workload.max_turns} turns, shared system prompt of "
                    f"{workload.system_tokens} tokens, user turns {workload.user_tokens[0]}-"
                    f"{workload.user_tokens[1]} tokens, assistant turns "
                    f"{workload.assistant_tokens[0]}-{workload.assistant_tokens[1]} tokens "
                    "(greedy), closed loop (next turn sent when the answer completes)",
        "command": "python bench/multiturn.py",
    })
    report += "\n## Summary\n\n" + markdown_table(
        ["variant", "TTFT p50 ms", "TTFT p99 ms", "decode tok/s", "prefill computed",
         "minimum possible", "computed / minimum", "hit rate", "wall s"], rows)
    report += "\n## Median TTFT by turn (ms)\n\n" + markdown_table(
        ["turn", *VARIANTS, "c / a"], turn_rows)
    report += (
        f"\nAt turns >= {late}, median TTFT of (c) / (a) = {late_ratio:.1f}x (goal >= 10x); "
        f"prefill computed by (a) = {a_ratio:.3f}x the minimum (goal <= 1.05x).\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    plot(by_turn, args.out.with_suffix(".png"))


def plot(by_turn: dict[str, dict[int, list[float]]], path: Path) -> None:
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
    ax.set_title("TTFT by turn: the history is recomputed only without a cache")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
