"""Serving throughput: transformers (one request after another, as a naive server does)
against kvchat's engine with 1, 4 and 16 requests in flight, on the same weights, in one run.

    python bench/throughput.py [--requests 16] [--prompt-tokens 96] [--new-tokens 48]

This compares engine speed, so nothing may come from a cache: kvchat's prefix cache is off
(and every request asserts it had no cached tokens), and each round draws fresh prompts.
The variants run interleaved, in rounds (a rotating order each round), and each reports its
median over the rounds, so a swing in the machine's load falls on all of them alike.

Writes bench/results/throughput.md and throughput.png."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
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


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_transformers(model, prompts: list[list[int]], new_tokens: int, bar: tqdm) -> float:
    """Sequential greedy generate; returns seconds."""
    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        bar.update(1)
    return time.perf_counter() - start


def transformers_decode_step(model, prompt: list[int], new_tokens: int) -> float:
    """Seconds per decode step of one sequence: (generate N) - (generate 1), over N - 1."""
    ids = torch.tensor([prompt])

    def gen(n: int) -> float:
        t = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - t

    gen(2)
    return (gen(new_tokens) - gen(1)) / (new_tokens - 1)


def run_kvchat(
    engine: Engine, prompts: list[list[int]], new_tokens: int, concurrency: int, bar: tqdm
) -> float:
    """Keep `concurrency` requests in flight until all are done; returns seconds."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    in_flight = 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"c{concurrency}-{i}", prompt, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                assert out.num_output_tokens == new_tokens
                assert out.num_cached_tokens == 0, "a prompt was served from a cache"
                in_flight -= 1
                bar.update(1)
    return time.perf_counter() - start


def kvchat_decode_step(engine: Engine, prompt: list[int], new_tokens: int) -> float:
    """Seconds per decode step of one sequence (prefill excluded)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("solo", prompt, params)
    engine.step()  # prefill + first token
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (throughput and decode step)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "throughput.md")
    args = ap.parse_args()

    from transformers import LlamaForCausalLM

    model_dir = ensure_model(args.model, "bench")
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            cache=CacheConfig(kv_cache_bytes=1024**3, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024),
        )
    )
    vocab = engine.model_config.vocab_size
    total_new = args.requests * args.new_tokens
    concurrencies = [1, 4, 16]
    names = ["transformers sequential", *(f"kvchat concurrency {c}" for c in concurrencies)]

    # Warm both up on a short request so first-call costs stay out of the timings.
    warm = make_prompts(1, 8, vocab, seed=999)[0]
    with torch.inference_mode():
        hf.generate(torch.tensor([warm]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    engine.generate([warm], SamplingParams(max_tokens=2, temperature=0.0))

    seconds: dict[str, list[float]] = {name: [] for name in names}
    with (
        torch.inference_mode(),
        tqdm(total=args.rounds * args.requests * len(names), desc="requests", unit="req") as bar,
    ):
        for r in range(args.rounds):
            for i, name in enumerate(names[r % len(names) :] + names[: r % len(names)]):
                # Fresh prompts for every variant of every round.
                prompts = make_prompts(
                    args.requests, args.prompt_tokens, vocab, seed=1000 * r + i + 1
                )
                if name == "transformers sequential":
                    seconds[name].append(run_transformers(hf, prompts, args.new_tokens, bar))
                else:
                    c = int(name.rsplit(" ", 1)[1])
                    seconds[name].append(run_kvchat(engine, prompts, args.new_tokens, c, bar))
    results = {name: statistics.median(v) for name, v in seconds.items()}
    # Decode step: interleaved rounds, median of each (the machine is shared and noisy).
    hf_steps, kv_steps = [], []
    for r in range(args.rounds):
        prompt = make_prompts(1, args.prompt_tokens, vocab, seed=77 + r)[0]
        with torch.inference_mode():
            hf_steps.append(transformers_decode_step(hf, prompt, args.new_tokens))
        kv_steps.append(kvchat_decode_step(engine, prompt, args.new_tokens))
    hf_step, kv_step = statistics.median(hf_steps), statistics.median(kv_steps)

    bandwidth = copy_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    floor = weight_bytes / bandwidth
    base = total_new / results["transformers sequential"]

    def spread_s(values: list[float]) -> str:
        return f"{min(values):.2f}-{max(values):.2f}"

    rows = [
        [
            name,
            f"{t:.2f}",
            spread_s(seconds[name]),
            f"{total_new / t:.1f}",
            f"{total_new / t / base:.2f}x",
        ]
        for name, t in results.items()
    ]

    def spread(steps: list[float]) -> str:
        return f"{min(steps) * 1e3:.1f}-{max(steps) * 1e3:.1f}"

    step_rows = [
        ["transformers", f"{hf_step * 1e3:.1f}", spread(hf_steps), f"{floor / hf_step:.2f}"],
        ["kvchat", f"{kv_step * 1e3:.1f}", spread(kv_steps), f"{floor / kv_step:.2f}"],
    ]
    report = machine_header(
        "Throughput: kvchat vs transformers (same weights, same run)",
        {
            "model": f"bench preset, {engine.model_config.num_parameters / 1e6:.1f}M parameters, "
            f"float32 ({weight_bytes / 1e6:.0f} MB of weights)",
            "workload": f"{args.requests} requests x {args.prompt_tokens} prompt tokens, "
            f"{args.new_tokens} new tokens each, greedy; fresh prompts per variant and "
            f"round, prefix cache off; {args.rounds} interleaved rounds, medians",
            "linear paths": engine.model.linear_plan.summary(),
            "command": "python bench/throughput.py",
        },
    )
    report += "\n## Tokens per second\n\n" + markdown_table(
        [
            "variant",
            "seconds (median)",
            "range over rounds",
            "generated tok/s",
            "vs transformers sequential",
        ],
        rows,
    )
    report += (
        f"\n## Single-sequence decode step\n\nMemory-bandwidth floor: {weight_bytes / 1e6:.0f} MB "
        f"of weights / {bandwidth / 1e9:.1f} GB/s measured copy bandwidth = "
        f"{floor * 1e3:.1f} ms per step.\n\n"
        + f"Median of {args.rounds} interleaved rounds of {args.new_tokens - 1} steps each.\n\n"
        + markdown_table(
            [
                "engine",
                "ms per step (median)",
                "range over rounds",
                "floor / step (1.0 = at the floor)",
            ],
            step_rows,
        )
    )
    ratio16 = results["kvchat concurrency 16"]
    report += (
        f"\nGoals: 16 concurrent >= 4x transformers sequential: "
        f"{results['transformers sequential'] / ratio16:.2f}x; single-sequence decode no slower "
        f"than transformers: {hf_step / kv_step:.2f}x (transformers step / kvchat step).\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    plot(results, total_new, args.out.with_suffix(".png"))


def plot(results: dict[str, float], total_new: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    rates = [total_new / results[n] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.barh(names, rates, color=["#999999"] + ["#2a7ab9"] * (len(names) - 1))
    ax.bar_label(bars, fmt="%.1f tok/s", padding=3)
    ax.set_xlabel("generated tokens per second (higher is better)")
    ax.set_title("bench model on CPU: transformers sequential vs kvchat")
    ax.invert_yaxis()
    ax.set_xlim(0, max(rates) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
