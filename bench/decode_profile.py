"""Where one CPU decode step of the bench model goes: a per-op table (torch profiler) for
float32 and bfloat16 weights, one sequence and 16, next to the step's wall time and its
weight-read floor.

    python bench/decode_profile.py [--batch 1 16] [--dtypes float32 bfloat16]

Writes bench/results/decode_profile.md."""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from kvchat.bench.common import (
    REPO,
    RESULTS,
    copy_bandwidth,
    ensure_model,
    machine_header,
    markdown_table,
)
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.scheduler import SchedulerConfig
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.memory.config import CacheConfig

# Profiler op names -> what they are in the step.
CATEGORIES = {
    "mkldnn::_linear_pointwise": "weights (linear)",
    "aten::mm": "weights (linear)",
    "aten::addmm": "weights (linear)",
    "kvchat_cpu::gemv": "weights (linear)",
    "kvchat_cpu::widen_gemm": "weights (linear)",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)",
    "kvchat_cpu::decode_attention": "attention (SDPA)",
    "aten::_index_put_impl_": "KV cache write",
    "kvchat_cpu::rotary_cache_write": "KV cache write",
    "aten::max": "sampling",
}


def category(key: str, shapes: list[list[int]]) -> str:
    """What a profiled op is in the step: an index_select is the paged KV gather, unless it
    reads the embedding table (the vocabulary's rows)."""
    if key == "aten::index_select":
        return (
            "other ops"
            if shapes and shapes[0] and shapes[0][0] > 65536
            else "attention (KV gather)"
        )
    return CATEGORIES.get(key, "other ops")


def step_profile(
    engine: Engine, batch: int, prompt_tokens: int, steps: int
) -> tuple[float, list[list[object]], dict[str, float]]:
    """(median step seconds, per-op rows, self ms per step by category) of decode steps."""
    g = torch.Generator().manual_seed(batch)
    num_profiled = 5
    # prefill's token, 3 warm-up steps, the timed steps, the profiled steps, one to finish
    params = SamplingParams(
        max_tokens=1 + 3 + steps + num_profiled + 1, temperature=0.0, ignore_eos=True
    )
    for i in range(batch):
        prompt = torch.randint(0, 100_000, (prompt_tokens,), generator=g).tolist()
        engine.add_request(f"profile-{batch}-{i}", prompt, params)
    engine.step()  # prefill
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(num_profiled):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()

    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events) / num_profiled / 1e3  # ms per step
    categories: dict[str, float] = defaultdict(float)
    rows: list[list[object]] = []
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total):
        ms = e.self_cpu_time_total / num_profiled / 1e3
        categories[category(e.key, [list(x) for x in e.input_shapes])] += ms
        if len(rows) < 14:
            shapes = ", ".join(str(list(s)) for s in e.input_shapes[:2] if s)
            rows.append(
                [
                    f"`{e.key}`",
                    shapes,
                    f"{e.count / num_profiled:g}",
                    f"{ms:.2f}",
                    f"{ms / total:.0%}",
                ]
            )
    categories["total (profiled)"] = total
    return statistics.median(times), rows, dict(categories)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_profile.md")
    args = ap.parse_args()

    model_dir = ensure_model(args.model, "bench")
    bandwidth = copy_bandwidth()
    report = (
        "\nSelf CPU time per step from torch.profiler (5 profiled steps; the profiler adds a "
        "few microseconds per op, so small ops read high) beside the unprofiled median step. "
        f"Floor: weight bytes / {bandwidth / 1e9:.1f} GB/s measured copy bandwidth.\n"
    )
    summary = []
    sections = []
    runs = [(d, b) for d in args.dtypes for b in args.batch]
    for dtype in tqdm(args.dtypes, desc="dtypes"):
        engine = Engine(
            EngineConfig(
                model=str(model_dir),
                dtype=dtype,
                device="cpu",
                cache=CacheConfig(kv_cache_bytes=512 * 1024**2, enable_prefix_caching=False),
                scheduler=SchedulerConfig(
                    max_num_seqs=max(args.batch), max_num_batched_tokens=4096
                ),
            )
        )
        weight_bytes = (
            engine.model_config.num_parameters * torch.empty((), dtype=engine.dtype).element_size()
        )
        for batch in args.batch:
            step, rows, cats = step_profile(engine, batch, args.prompt_tokens, args.steps)
            floor = weight_bytes / bandwidth
            summary.append(
                [
                    dtype,
                    batch,
                    f"{step * 1e3:.1f}",
                    f"{floor * 1e3:.1f}",
                    f"{floor / step:.2f}",
                    *(
                        f"{cats.get(c, 0.0):.1f}"
                        for c in (
                            "weights (linear)",
                            "attention (SDPA)",
                            "attention (KV gather)",
                            "KV cache write",
                            "sampling",
                            "other ops",
                        )
                    ),
                ]
            )
            sections.append(
                f"\n### {dtype}, batch {batch}: {step * 1e3:.1f} ms per step\n\n"
                + markdown_table(["op", "input shapes", "calls", "self ms", "share"], rows)
            )
        del engine
    assert len(summary) == len(runs)
    # The header last: the run's end (time, load) is now.
    report = (
        machine_header(
            "Decode step profile (bench model, CPU)",
            {
                "workload": f"{args.prompt_tokens}-token prompts, decode steps at contexts "
                f"{args.prompt_tokens + 3}-{args.prompt_tokens + 3 + args.steps + 5}",
                "command": "python bench/decode_profile.py",
            },
        )
        + report
    )
    report += "\n## Summary\n\n" + markdown_table(
        [
            "weights",
            "batch",
            "step ms",
            "floor ms",
            "floor share",
            "linear ms",
            "attention ms",
            "KV gather ms",
            "RoPE + KV write ms",
            "sampling ms",
            "other ops ms",
        ],
        summary,
    )
    report += "\n## Top ops of one step\n" + "".join(sections)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
