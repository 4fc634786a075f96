"""What the sampling knobs cost a decode step: the engine decoding a batch of 16 sequences,
plain (temperature and a seed) against the same with every knob on every row (presence,
frequency and repetition penalties, 32 logit_bias entries, min_p) and on half the rows, the
variants alternating round by round in one process. The penalties count each row's prompt
and output tokens every step (inference/model/penalties.py), so longer prompts cost more: the
prompts are --prompt-tokens long.

    python bench/sampling.py [--model models/smollm2-135m-instruct] [--rounds 8]

Writes bench/results/sampling.md: per variant the median step time and its ratio to plain
(the goal: all knobs on every row within 1.05x)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, machine_header, markdown_table
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.model.sampling_params import SamplingParams

BATCH = 16
VARIANTS = ("plain", "all knobs, every row", "all knobs, half the rows")
BIAS = tuple((t, -2.0) for t in range(1000, 1032))
KNOBS = (
    "presence_penalty 0.5, frequency_penalty 0.5, repetition_penalty 1.1, min_p 0.05, "
    f"logit_bias on {len(BIAS)} tokens"
)


def params(knobs: bool, row: int, max_tokens: int) -> SamplingParams:
    if not knobs:
        return SamplingParams(temperature=0.8, seed=row, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(
        temperature=0.8,
        seed=row,
        max_tokens=max_tokens,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        min_p=0.05,
        logit_bias=BIAS,
    )


def decode_steps(
    engine: Engine, variant: str, round_: int, prompt_tokens: int, steps: int
) -> list[float]:
    """Seconds of each of `steps` decode steps of a batch of BATCH, once every row decodes."""
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(round_ * len(VARIANTS) + VARIANTS.index(variant))
    for row in range(BATCH):
        prompt = torch.randint(
            100, vocab - 100, (prompt_tokens,), generator=generator
        ).tolist()  # new prompts: no prefix reuse
        knobs = variant == "all knobs, every row" or (
            variant == "all knobs, half the rows" and row % 2 == 0
        )
        engine.add_request(f"{variant}-{round_}-{row}", prompt, params(knobs, row, steps + 8))
    engine.step()  # takes the requests in
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()  # prefill
    times = []
    for _ in range(steps):
        begun = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - begun)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def sampler_alone(engine: Engine, prompt_tokens: int, calls: int = 200) -> dict[str, float]:
    """Median ms of the sampler on [BATCH, V] logits with the rows' token histories, plain and
    with every knob on every row, the two alternating call by call."""
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, vocab, generator=generator)
    token_ids = [
        torch.randint(0, vocab, (prompt_tokens + 32,), generator=generator).tolist()
        for _ in range(BATCH)
    ]
    seen = {
        name: [params(knobs, row, 64) for row in range(BATCH)]
        for name, knobs in (("plain", False), ("all knobs, every row", True))
    }
    times: dict[str, list[float]] = {name: [] for name in seen}
    generators = [torch.Generator().manual_seed(row) for row in range(BATCH)]
    for _ in range(calls):
        for name, rows in seen.items():
            begun = time.perf_counter()
            engine.sampler(
                logits,
                rows,
                generators,
                token_ids=token_ids,
                num_prompt_tokens=[prompt_tokens] * BATCH,
            )
            times[name].append(time.perf_counter() - begun)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per round")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS / "sampling.md")
    args = parser.parse_args()
    engine = Engine(
        EngineConfig(model=str(args.model), dtype=args.dtype, adaptive_cpu_threads=False)
    )
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    runs = [(r, v) for r in range(args.rounds) for v in VARIANTS]
    for round_, variant in tqdm(runs, desc="rounds", unit="variant"):
        steps = decode_steps(engine, variant, round_, args.prompt_tokens, args.steps)
        times[variant].append(statistics.median(steps))
    plain = statistics.median(times["plain"])
    sampler_ms = sampler_alone(engine, args.prompt_tokens)
    rows = []
    for variant in VARIANTS:
        median = statistics.median(times[variant])
        ratios = [t / p for t, p in zip(times[variant], times["plain"], strict=True)]
        rows.append(
            [
                variant,
                round(median * 1000, 2),
                f"{median / plain:.3f}x",
                f"{min(ratios):.3f}x - {max(ratios):.3f}x",
            ]
        )
    header = ["variant", "decode step (ms, median)", "vs plain", "rounds' range"]
    table = markdown_table(header, rows)
    extra = (sampler_ms["all knobs, every row"] - sampler_ms["plain"]) / (plain * 1000)
    table += "\n\n" + markdown_table(
        ["the sampler alone, batch 16 (ms, median of 200 calls)", "plain", "all knobs, every row"],
        [["", round(sampler_ms["plain"], 3), round(sampler_ms["all knobs, every row"], 3)]],
    )
    table += (
        f"\n\nThe knobs' own cost, measured without the model's noise: "
        f"{sampler_ms['all knobs, every row'] - sampler_ms['plain']:.2f} ms a step, "
        f"{extra:.1%} of the plain decode step (goal: at most 5%).\n"
    )
    print(table)
    text = machine_header(
        "What the sampling knobs cost a decode step (bench/sampling.py)",
        {
            "model": f"{args.model.name} ({args.dtype}), vocabulary "
            f"{engine.model_config.vocab_size}",
            "batch": f"{BATCH} sequences decoding, prompts of {args.prompt_tokens} tokens, "
            "temperature 0.8, a seed per row",
            "knobs": KNOBS,
            "rounds": f"{args.rounds}, variants alternating; median of {args.steps} steps per "
            "round, median of the rounds",
            "threads": f"{torch.get_num_threads()} (adaptive CPU threads off: a fixed count)",
        },
    )
    args.out.write_text(text + "\n" + table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
