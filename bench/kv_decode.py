"""Decode step and prefill time of each KV cache dtype, against a git revision, in the same run.

    python bench/kv_decode.py --against REV [--rounds 3] [--weights bfloat16,float32]

What a change to the quantized caches costs the engine: for this checkout and for REV (its
code exported from git into a temporary folder), each KV cache dtype both have decodes the
same prompt (a kv_quality prompt, about 1,000 tokens) for --new-tokens greedy tokens, then
prefills three other prompts (1,400-1,900 tokens, nothing of them cached) to their first
token, in a fresh process, the real model on the CPU, the variants alternating round by
round so a noisy machine slows both alike. Reports the median decode step and prefill time
per 1,000 prompt tokens per dtype and the ratios (below 1: this checkout is faster), with the
load average in the header. Writes bench/results/kv_decode.md."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.bench.turn_overhead import export, git_revision

KV_DTYPES = ("auto", "int8", "fp8", "int4")
PROMPT_INDEX = 0  # bench/data/kv_quality_prompts.json's first prompt
PREFILL_PROMPTS = (1, 2, 5)  # and the ones prefilled (no prefix in common but the template's)


def worker(args: argparse.Namespace) -> None:
    """One engine, one dtype: prints the decode steps' seconds as JSON (the last line)."""
    import torch

    from kvchat.inference.engine.config import EngineConfig
    from kvchat.inference.engine.engine import Engine
    from kvchat.inference.model.sampling_params import SamplingParams
    from kvchat.inference.text.chat_template import ChatMessage, load_chat_template
    from kvchat.memory.config import CacheConfig

    torch.manual_seed(0)
    cache = CacheConfig(kv_cache_dtype=args.dtype, kv_cache_bytes=256 * 2**20)
    engine = Engine(
        EngineConfig(model=str(args.model), dtype=args.weights, device="cpu", cache=cache)
    )
    assert engine.tokenizer is not None
    prompts = json.loads((REPO / "bench" / "data" / "kv_quality_prompts.json").read_text())
    messages = [ChatMessage(m["role"], m["content"]) for m in prompts[PROMPT_INDEX]["messages"]]
    ids = load_chat_template(args.model, engine.tokenizer).render_ids(
        messages, add_generation_prompt=True
    )
    times: list[float] = []
    sampler = engine.sampler

    def timed(*a: Any, **k: Any) -> Any:
        times.append(time.perf_counter())
        return sampler(*a, **k)

    engine.sampler = timed  # type: ignore[assignment]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([ids], params)  # warm-up: the kernels' first calls
    times.clear()
    engine.generate([ids], params)
    steps = [b - a for a, b in itertools.pairwise(times[1:])]  # after the prefill's sample
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefills = []  # seconds per prompt token
    for index in PREFILL_PROMPTS:
        messages = [ChatMessage(m["role"], m["content"]) for m in prompts[index]["messages"]]
        other = load_chat_template(args.model, engine.tokenizer).render_ids(
            messages, add_generation_prompt=True
        )
        start = time.perf_counter()
        engine.generate([other], first)
        prefills.append((time.perf_counter() - start) / len(other))
    print(json.dumps({"prompt_tokens": len(ids), "steps": steps, "prefills": prefills}))


def measure(code: Path | None, dtype: str, weights: str, args: argparse.Namespace) -> dict:
    """A worker process on this checkout's code, or on the tree at `code`."""
    env = {**os.environ, **({"PYTHONPATH": str(code)} if code is not None else {})}
    command = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", "--dtype", dtype,
               "--weights", weights, "--model", str(args.model),
               "--new-tokens", str(args.new_tokens)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=code or REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{dtype} on {code or 'this checkout'} failed:\n{proc.stderr[-3000:]}")
    result: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def supported(code: Path) -> set[str]:
    """The KV cache dtypes the tree at `code` knows."""
    spec = (code / "memory" / "kv_spec.py").read_text()
    return {kv for kv in KV_DTYPES if f'"{kv}"' in spec}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="a git revision measured in the same run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--weights", default="bfloat16,float32")
    ap.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_decode.md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.weights = args.weights.split(",")[0]
        worker(args)
        return
    ensure_model(args.model, "smollm2-135m-instruct")
    weights = args.weights.split(",")
    dtypes = args.kv_dtypes.split(",")
    with contextlib.ExitStack() as stack:
        variants: dict[str, Path | None] = {"this checkout": None}
        if args.against:
            variants[args.against] = export(args.against, stack)
        known = {
            name: set(dtypes) if code is None else supported(code) & set(dtypes)
            for name, code in variants.items()
        }
        steps: dict[tuple[str, str, str], list[float]] = {}
        prefills: dict[tuple[str, str, str], list[float]] = {}
        prompt_tokens = 0
        runs = [
            (name, w, kv)
            for w in weights
            for kv in dtypes
            for name in variants
            if kv in known[name]
        ]
        with tqdm(total=args.rounds * len(runs), desc="decodes", unit="run") as bar:
            for r in range(args.rounds):
                # Alternate which variant goes first, round by round.
                order = runs if r % 2 == 0 else list(reversed(runs))
                for name, w, kv in order:
                    result = measure(variants[name], kv, w, args)
                    steps.setdefault((name, w, kv), []).extend(result["steps"])
                    prefills.setdefault((name, w, kv), []).extend(result["prefills"])
                    prompt_tokens = result["prompt_tokens"]
                    bar.update()
    rows = []
    for w in weights:
        for kv in dtypes:
            if ("this checkout", w, kv) not in steps:
                continue
            row: list[object] = [w, kv]
            for times, scale, unit in ((steps, 1e3, "ms"), (prefills, 1e6, "ms / 1k tokens")):
                mine = statistics.median(times[("this checkout", w, kv)])
                base = statistics.median(times[("this checkout", w, "auto")])
                row += [f"{scale * mine:.2f} {unit}", f"{mine / base:.3f}"]
                if args.against:
                    theirs = times.get((args.against, w, kv))
                    if theirs:
                        other = statistics.median(theirs)
                        row += [f"{scale * other:.2f} {unit}", f"{mine / other:.3f}"]
                    else:
                        row += [f"(no {kv} at {args.against})", "-"]
            rows.append(row)
    header_cols = ["weights", "kv_cache_dtype"]
    for what in ("decode step", "prefill"):
        header_cols += [f"{what}, this checkout (median)", "vs auto"]
        if args.against:
            header_cols += [f"{what}, {args.against}", "this checkout / it"]
    header = machine_header(
        "Decode step and prefill time of each KV cache dtype",
        {
            "model": f"{args.model.name}, CPU",
            "prompt": f"kv_quality prompt {PROMPT_INDEX} ({prompt_tokens} tokens), "
            f"{args.new_tokens} greedy tokens; prefill: prompts "
            f"{', '.join(map(str, PREFILL_PROMPTS))} to their first token; {args.rounds} rounds, "
            "a fresh process per run",
            "compared": f"this checkout ({git_revision()})"
            + (f" and {args.against}, alternating" if args.against else ""),
            "command": "python bench/kv_decode.py"
            + (f" --against {args.against}" if args.against else "")
            + f" --rounds {args.rounds} --weights {','.join(weights)}"
            + (f" --kv-dtypes {','.join(dtypes)}" if tuple(dtypes) != KV_DTYPES else ""),
        },
    )
    text = header + "\n" + markdown_table(header_cols, rows) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
