"""Block size: throughput and wasted KV memory (slots allocated but holding no token) for block
sizes 8, 16, 32 and 64 on the multi-turn workload, kvchat with sessions, in one run.

    python bench/block_size.py [--conversations 4]

Writes bench/results/block_size.md and block_size.png."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.bench.workload import WorkloadConfig, make_conversations, run_workload
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.scheduler import SchedulerConfig
from kvchat.memory.config import CacheConfig

BLOCK_SIZES = (8, 16, 32, 64)


class SlotSampler:
    """Wraps the engine's own step to read its KV slot usage after every step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.step = engine.step
        engine.step = self  # type: ignore[method-assign]
        self.allocated = self.filled = 0

    def __call__(self) -> list:
        outputs = self.step()
        slots = self.engine.kv_slot_usage()
        self.allocated += slots.num_allocated
        self.filled += slots.num_filled
        return outputs

    @property
    def waste(self) -> float:
        return 1 - self.filled / self.allocated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--min-turns", type=int, default=12)
    ap.add_argument("--max-turns", type=int, default=18)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=RESULTS / "block_size.md")
    args = ap.parse_args()

    model_dir = ensure_model(args.model, "bench")
    workload = WorkloadConfig(
        conversations=args.conversations, min_turns=args.min_turns, max_turns=args.max_turns
    )
    rows = []
    series: dict[int, tuple[float, float]] = {}
    for block_size in BLOCK_SIZES:
        engine = Engine(
            EngineConfig(
                model=str(model_dir),
                dtype=args.dtype,
                device="cpu",
                cache=CacheConfig(block_size=block_size, kv_cache_bytes=2**30),
                scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
            )
        )
        _, convs = make_conversations(workload, engine.model_config.vocab_size)
        sampler = SlotSampler(engine)
        turns = sum(c.turns for c in convs)
        with tqdm(total=turns, desc=f"block {block_size}", unit="turn") as bar:
            start = time.perf_counter()
            records, _ = run_workload(engine, workload, True, on_turn=lambda: bar.update(1))
            wall = time.perf_counter() - start
        generated = sum(r.decode_tokens + 1 for r in records)
        waste = sampler.waste
        series[block_size] = (generated / wall, waste)
        rows.append(
            [
                block_size,
                f"{generated / wall:.1f}",
                f"{wall:.0f}",
                f"{100 * waste:.2f}%",
                f"{engine.stats.hit_rate:.3f}",
            ]
        )

    report = machine_header(
        "Block size: throughput and KV waste on the multi-turn workload",
        {
            "model": f"{model_dir.name} preset, {args.dtype}, sessions + prefix cache",
            "workload": f"{workload.conversations} conversations x {workload.min_turns}-"
            f"{workload.max_turns} turns (see bench/workload.py)",
            "waste": "slots of blocks in use that hold no token's KV, averaged over every engine "
            "step (each physical block counted once)",
            "command": "python bench/block_size.py",
        },
    )
    report += "\n" + markdown_table(
        ["block size", "generated tok/s", "wall s", "wasted KV slots", "prefix hit rate"], rows
    )
    report += (
        f"\nGoal: waste at block size 16 under 4% (the PagedAttention paper's figure): "
        f"{100 * series[16][1]:.2f}%.\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    plot(series, args.out.with_suffix(".png"))


def plot(series: dict[int, tuple[float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(series)
    fig, ax1 = plt.subplots(figsize=(6.5, 3.8))
    ax1.bar([str(s) for s in sizes], [100 * series[s][1] for s in sizes], color="#d98c2b")
    ax1.set_xlabel("block size (tokens)")
    ax1.set_ylabel("wasted KV slots (%)")
    ax2 = ax1.twinx()
    ax2.plot([str(s) for s in sizes], [series[s][0] for s in sizes], color="#2a7ab9", marker="o")
    ax2.set_ylabel("generated tokens / s")
    ax2.set_ylim(0, max(series[s][0] for s in sizes) * 1.2)  # from zero: noise stays small
    ax1.set_title("KV waste and throughput by block size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
