"""The CPU's paged prefill attention (kernels/cpu_prefill_attention.cpp) against torch's flash
kernel (the reference path, `StepPrefill(use_cpu_kernel=False)`), in the same run: one call
for a layer at SmolLM2-135M-Instruct's shapes (9 query heads over 3 KV heads of 64, blocks of
16 scattered over a pool), for a whole prompt's chunks and for a turn's new tokens over a
cached history; then the engine's whole prefill of the real model, both ways.

    python bench/prefill_attention.py [--model models/smollm2-135m-instruct] [--rounds 5]

Variants alternate call by call (and prompt by prompt); medians, and flash / kernel ratios.
Writes bench/results/prefill_attention.md."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.kernels.cpu_ops import load_cpu_ops
from kvchat.kernels.torch_ops import StepPrefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
POOL_BLOCKS = 1024
# (cached tokens before the chunk, new tokens): a 2,000-token prompt's 512-token chunks, and
# a multi-round chat turn (~100 new tokens over its history)
CALLS = [(0, 512), (512, 512), (1536, 464), (1488, 112), (0, 112)]
# (prompt tokens, of which cached): the engine's whole prefill of one request
PROMPTS = [(512, 0), (2000, 0), (1600, 1500)]


def time_calls(dtype: torch.dtype, past: int, new: int, rounds: int, gen: torch.Generator):
    kc = torch.randn(POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    vc = torch.randn(POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    length = past + new
    table = torch.randperm(POOL_BLOCKS, generator=gen)[: -(-length // BLOCK)]
    args = (
        torch.randn(new, HEADS, HEAD_DIM, generator=gen).to(dtype),
        kc,
        vc,
        table.to(torch.int32).view(1, -1).contiguous(),
        torch.tensor([length], dtype=torch.int32),
        torch.tensor([0, new], dtype=torch.int32),
        HEAD_DIM**-0.5,
    )
    variants = {"kernel": StepPrefill(), "flash": StepPrefill(use_cpu_kernel=False)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds * 5):
        for name, op in variants.items():
            begun = time.perf_counter()
            op(*args)
            times[name].append(time.perf_counter() - begun)
    return {name: statistics.median(t[rounds:]) for name, t in times.items()}  # warm-ups off


def time_prefills(model: Path, dtype: str, rounds: int, gen: torch.Generator, bar: tqdm):
    from kvchat.inference.engine.config import EngineConfig
    from kvchat.inference.engine.engine import Engine
    from kvchat.inference.model.sampling_params import SamplingParams
    from kvchat.memory.config import CacheConfig

    engine = Engine(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            device="cpu",
            cache=CacheConfig(kv_cache_bytes=512 * 2**20, enable_prefix_caching=True),
        )
    )
    vocab = engine.model_config.vocab_size

    def prefill(prompt: list[int]) -> float:
        engine.add_request(
            f"r{time.perf_counter_ns()}",
            prompt,
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )
        begun = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - begun

    times: dict[tuple[tuple[int, int], str], list[float]] = {
        (p, v): [] for p in PROMPTS for v in ("kernel", "flash")
    }
    step_prefill = engine.ops.prefill
    assert isinstance(step_prefill, StepPrefill), "the CPU's torch attention backend"
    for round_ in range(rounds + 1):  # the first round warms both up
        for tokens, cached in PROMPTS:
            for variant in ("kernel", "flash"):
                step_prefill.use_cpu_kernel = variant == "kernel"
                prompt = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
                if cached:
                    prefill(prompt[:cached])  # the history, now in the prefix cache
                took = prefill(prompt)
                if round_:
                    times[((tokens, cached), variant)].append(took)
                bar.update(1)
    return {key: statistics.median(t) for key, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "prefill_attention.md")
    args = ap.parse_args()
    if not load_cpu_ops() or not torch.ops.kvchat_cpu.prefill_attention_supported(HEAD_DIM):
        print("kvchat's CPU prefill attention cannot be built here: nothing to compare")
        return 0
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    model_dir = ensure_model(args.model, args.model.name)

    call_rows = []
    for past, new in tqdm(CALLS, desc="calls", unit="case"):
        t = time_calls(dtype, past, new, args.rounds, gen)
        call_rows.append(
            [
                past,
                new,
                f"{t['flash'] * 1e3:.2f}",
                f"{t['kernel'] * 1e3:.2f}",
                f"{t['flash'] / t['kernel']:.2f}x",
            ]
        )
    with tqdm(total=(args.rounds + 1) * len(PROMPTS) * 2, desc="prefills", unit="req") as bar:
        p = time_prefills(model_dir, args.dtype, args.rounds, gen, bar)
    prefill_rows = [
        [
            tokens,
            cached,
            f"{p[((tokens, cached), 'flash')] * 1e3:.0f}",
            f"{p[((tokens, cached), 'kernel')] * 1e3:.0f}",
            f"{p[((tokens, cached), 'flash')] / p[((tokens, cached), 'kernel')]:.2f}x",
        ]
        for tokens, cached in PROMPTS
    ]
    timings = ["torch flash ms", "kvchat kernel ms", "flash / kernel"]
    calls = markdown_table(["cached tokens", "new tokens", *timings], call_rows)
    prefills = markdown_table(["prompt tokens", "of which cached", *timings], prefill_rows)
    print(calls + "\n" + prefills)
    text = machine_header(
        "CPU paged prefill attention: kvchat's kernel against torch's flash kernel",
        {
            "shapes": f"{HEADS} query heads over {KV_HEADS} KV heads of {HEAD_DIM}, blocks of "
            f"{BLOCK} scattered over a pool of {POOL_BLOCKS}; {args.dtype}",
            "calls": f"one layer's call, {args.rounds * 4} per variant after {args.rounds} "
            "warm-ups, interleaved; medians",
            "prefills": f"{model_dir.name} in {args.dtype}, the engine's prefill of one request "
            f"(to its first token), {args.rounds} rounds after a warm-up round, variants "
            "alternating; medians",
            "command": " ".join(["python bench/prefill_attention.py", *sys.argv[1:]]),
        },
    )
    args.out.write_text(
        text
        + "\n## One layer's call\n\n"
        + calls
        + "\n## The engine's prefill of one request\n\n"
        + prefills
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
