"""Structured output: what constrained decoding costs per decode step, and what compiling a
grammar costs cold and cached, on the bench model, in one run.

    python bench/structured.py [--batch 1 16] [--steps 32] [--repeats 4]

Decode: the same batch of prompts decoded unconstrained (seeded sampling) and with every row
constrained by a JSON schema that cannot close within the run (an array of at least 1000
items), so every step is constrained. Three item kinds, since the mask's cost depends on
where the grammar is: free strings (`{"type": "string"}`, the common case in tool arguments:
inside a string body llguidance reuses the last mask), numbers, and strings of at most 12
characters (the costliest case found: every character changes what may follow, and most of
the vocabulary is still allowed). At the larger batch also half the rows with the costliest
constraint. Each variant runs once untimed (warm-up), then variants alternate, each repeated;
a step is timed only when every row decodes (no prefill in it). Per step: the median wall
time, the overhead against unconstrained, how many constrained rows computed a mask (a row's
draws are checked against its grammar first; the mask is computed only when they are all
rejected, and taken first for a few steps after that), and how much of the step the masks
(llguidance and the logit offsets) and the sampler (checks, masks applied) took.

Compile: a fresh compiler per grammar (cold: compile; cached: the same grammar again; a
request's own matcher: a deep copy), for a JSON schema and tool-call grammars of 1 and 8
tools; and building the llguidance tokenizer from the model's vocabulary (once per engine).
Writes bench/results/structured.md."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.inference.structured.compiler import GrammarCompiler
from kvchat.inference.structured.grammar import (
    Grammar,
    ToolSpec,
    json_schema_grammar,
    tool_call_grammar,
)
from kvchat.inference.text.tool_calls import HERMES
from kvchat.memory.config import CacheConfig


def open_schema(items: dict[str, Any]) -> dict[str, Any]:
    """An object holding an array of >= 1000 `items`: never closes within the run."""
    return {
        "type": "object",
        "required": ["log"],
        "properties": {"log": {"type": "array", "minItems": 1000, "items": items}},
    }


# Constraint kinds, cheapest mask first; the last is the costliest.
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "free strings": open_schema({"type": "string"}),
    "numbers": open_schema({"type": "number"}),
    "strings <= 12 chars": open_schema({"type": "string", "maxLength": 12}),
}
COSTLIEST = "strings <= 12 chars"
GOAL = 0.10  # decode-step overhead with every row constrained at batch 16
ARGUMENTS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]},
        "place": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


class Timed:
    """Wraps a callable and adds up the seconds spent in it (less what `inner` timers spent
    inside it) and the rows it was given (a first argument that is a list: fill_bitmask's)."""

    def __init__(self, fn: Callable[..., Any], inner: tuple[Timed, ...] = ()) -> None:
        self.fn = fn
        self.inner = inner
        self.seconds = 0.0
        self.rows = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], list):
            self.rows += len(args[0])
        inner = sum(t.seconds for t in self.inner)
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += (
                time.perf_counter() - start - (sum(t.seconds for t in self.inner) - inner)
            )


def decode_steps(
    engine: Engine,
    prompts: list[list[int]],
    constrained: int,
    steps: int,
    seed: int,
    tag: str,
    schema: dict[str, Any] | None = None,
) -> list[tuple[float, float, float, int]]:
    """(step, mask computation, sampler seconds, rows masked) of each all-decode step, the
    first `constrained` rows with `schema`'s grammar (default: the costliest constraint).
    The sampler's seconds leave out the masks computed inside it."""
    grammar = json_schema_grammar(CONSTRAINTS[COSTLIEST] if schema is None else schema)
    budget = steps + 4
    # The mask bits (on the mask worker beside the forward when costly) and their logit
    # offsets (after the forward) together.
    mask = Timed(engine.grammars.fill_bitmask)
    offsets = Timed(engine.grammars.logit_offsets)
    sampler = Timed(engine.sampler, inner=(mask, offsets))
    engine.grammars.fill_bitmask = mask  # type: ignore[method-assign]
    engine.grammars.logit_offsets = offsets  # type: ignore[method-assign]
    engine.sampler = sampler  # type: ignore[assignment]
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(
                f"{tag}-{i}",
                ids,
                SamplingParams(
                    max_tokens=budget,
                    temperature=1.0,
                    seed=seed + i,
                    ignore_eos=True,
                    grammar=grammar if i < constrained else None,
                ),
            )
        timings = []
        while engine.has_unfinished_requests():
            decoding = (
                all(s.num_uncomputed_tokens == 1 for s in engine.scheduler.running)
                and len(engine.scheduler.running) == len(prompts)
                and not engine.scheduler.waiting
            )
            mask.seconds = offsets.seconds = sampler.seconds = 0.0
            mask.rows = 0
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - start
            if decoding and not any(o.finished for o in outputs):
                timings.append(
                    (elapsed, mask.seconds + offsets.seconds, sampler.seconds, mask.rows)
                )
        return timings[:steps]
    finally:
        engine.grammars.fill_bitmask = mask.fn  # type: ignore[method-assign]
        engine.grammars.logit_offsets = offsets.fn  # type: ignore[method-assign]
        engine.sampler = sampler.fn  # type: ignore[assignment]


def compile_times(
    compiler: GrammarCompiler, grammar: Grammar, repeats: int
) -> tuple[float, float, float]:
    """Median seconds: cold compile (emptied cache), cached compile, a request's matcher."""
    cold, cached, copy = [], [], []
    for _ in range(repeats):
        compiler.clear_cache()
        compiled = compiler.num_compiled
        start = time.perf_counter()
        compiler.compile(grammar)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile(grammar)
        cached.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.new_matcher(grammar)
        copy.append(time.perf_counter() - start)
        assert compiler.num_compiled == compiled + 1
    return statistics.median(cold), statistics.median(cached), statistics.median(copy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="the model's dtype (default: the engine's, float32 on the CPU)",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    ap.add_argument("--repeats", type=int, default=4, help="runs of each variant")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); 1 keeps a busy machine's other "
        "work from stalling the model's thread barrier",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "structured.md")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    model_dir = ensure_model(args.model, "bench")
    config = EngineConfig(
        model=str(model_dir),
        dtype=args.dtype,
        device="cpu",
        attention_backend="torch",
        cache=CacheConfig(kv_cache_bytes=512 * 2**20, enable_prefix_caching=False),
    )
    engine = Engine(config)
    # The same model masking every constrained row every step (no checks first), to compare.
    engines = {True: engine, False: Engine(replace(config, grammar_checks_first=False))}
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    start = time.perf_counter()
    engine.grammars  # noqa: B018 - builds the llguidance tokenizer
    tokenizer_seconds = time.perf_counter() - start

    # (batch, constrained rows, constraint kind, checks first); unconstrained runs: kind "".
    Variant = tuple[int, int, str, bool]
    variants: list[Variant] = []
    for batch in args.batch:
        variants.append((batch, 0, "", True))
        variants += [(batch, batch, kind, True) for kind in CONSTRAINTS]
        if batch >= 4:
            variants.append((batch, batch // 2, COSTLIEST, True))
        if batch >= 16:
            variants.append((batch, batch, COSTLIEST, False))
    # Per variant, per run: (step, mask, sampler seconds, rows masked) of each timed step.
    runs: dict[Variant, list[list[tuple[float, float, float, int]]]] = {v: [] for v in variants}
    text = "Write the log of the day as JSON. " * 8
    with tqdm(total=len(variants) * (args.repeats + 1), desc="decode runs", unit="run") as bar:
        # One untimed run of each variant first: llguidance builds its lexer's automaton
        # states as they are first reached (kept with the cached grammar afterwards), and a
        # server's grammars are warm after their first requests.
        for repeat in range(-1, args.repeats):
            for batch, constrained, kind, checks in variants:
                prompts = [
                    tokenizer.encode(f"{i}: {text}")[: args.prompt_tokens] for i in range(batch)
                ]
                timings = decode_steps(
                    engines[checks],
                    prompts,
                    constrained,
                    args.steps,
                    seed=10**6 if repeat < 0 else 1000 * repeat,
                    tag=f"{repeat}-{batch}-{constrained}-{kind}-{checks}",
                    schema=CONSTRAINTS[kind] if kind else None,
                )
                if repeat >= 0:
                    runs[(batch, constrained, kind, checks)].append(timings)
                bar.update(1)

    rows: list[list[object]] = []
    verdicts: list[str] = []
    medians: dict[Variant, float] = {}
    for batch, constrained, kind, checks in variants:
        timings = [t for run in runs[(batch, constrained, kind, checks)] for t in run]
        plain = [t for run in runs[(batch, 0, "", True)] for t in run]
        base = statistics.median(t[0] for t in plain)
        step = statistics.median(t[0] for t in timings)
        masks = statistics.median(t[1] for t in timings)
        sampler = statistics.median(t[2] for t in timings)
        base_sampler = statistics.median(t[2] for t in plain)
        overhead = step / base - 1
        # The same, repeat by repeat (each against the unconstrained run beside it): the spread.
        per_run = (
            [
                statistics.median(t[0] for t in run) / statistics.median(t[0] for t in base_run) - 1
                for run, base_run in zip(
                    runs[(batch, constrained, kind, checks)], runs[(batch, 0, "", True)]
                )
            ]
            if constrained
            else []
        )
        medians[(batch, constrained, kind, checks)] = step
        share = (masks + sampler - base_sampler) / base
        masked = sum(t[3] for t in timings) / (len(timings) * constrained) if constrained else 0
        if constrained == batch and batch >= 16 and checks:
            # Met when the pooled median is under the goal and so are 3 runs in 4: on a
            # shared machine one lucky (or unlucky) median decides nothing.
            under = sum(r < GOAL for r in per_run)
            met = overhead < GOAL and under >= 0.75 * len(per_run)
            verdicts.append(
                f"batch {batch}, {kind}: {overhead * 100:+.1f}%, {under} of "
                f"{len(per_run)} runs under ({'met' if met else 'NOT met'})"
            )
        rows.append(
            [
                batch,
                f"{constrained}/{batch}",
                (kind or "-") + ("" if checks else " (masked every step)"),
                len(timings),
                f"{step * 1e3:.1f}",
                f"{overhead * 100:+.1f}%" if constrained else "-",
                f"{min(per_run) * 100:+.1f}% .. {max(per_run) * 100:+.1f}%" if per_run else "-",
                f"{masked * 100:.0f}%" if constrained else "-",
                f"{masks * 1e3:.2f}",
                f"{(sampler - base_sampler) * 1e3:+.2f}" if constrained else "-",
                f"{share * 100:.1f}%" if constrained else "-",
            ]
        )

    for batch in args.batch:
        if batch >= 16:
            ratio = (
                medians[(batch, batch, COSTLIEST, True)] / medians[(batch, batch, COSTLIEST, False)]
            )
            verdicts.append(
                f"batch {batch}, {COSTLIEST}, checks first vs masked every step: "
                f"{ratio:.3f}x the step time"
            )

    compile_rows: list[list[object]] = []
    vocab = engine.model_config.vocab_size
    grammars = {
        "json_schema (5 properties, nested)": json_schema_grammar(ARGUMENTS),
        "tool calls, 1 tool": tool_call_grammar(
            [ToolSpec("get_weather", ARGUMENTS)], HERMES, parallel=True
        ),
        "tool calls, 8 tools": tool_call_grammar(
            [ToolSpec(f"tool_{i}", {**ARGUMENTS, "title": f"t{i}"}) for i in range(8)],
            HERMES,
            parallel=True,
        ),
    }
    for name, grammar in tqdm(grammars.items(), desc="compiles", unit="grammar"):
        cold, cached, copy = compile_times(engine.grammars, grammar, repeats=5)
        compile_rows.append(
            [
                name,
                f"{cold * 1e3:.2f}",
                f"{cached * 1e6:.1f}",
                f"{copy * 1e6:.1f}",
                f"{cold / cached:,.0f}x",
            ]
        )

    mc = engine.model_config
    report = machine_header(
        "Structured output: constrained decoding overhead and compile time",
        {
            "model": f"bench preset ({mc.num_parameters / 1e6:.0f}M parameters, random weights), "
            f"{str(config.torch_dtype).removeprefix('torch.')}"
            f"{' (the engine default)' if args.dtype == 'auto' else ''}, "
            f"vocab {mc.vocab_size}",
            "workload": f"{args.prompt_tokens}-token prompts, seeded sampling (temperature 1); "
            f"{args.steps} timed all-decode steps per run, {args.repeats} runs per "
            "variant, variants interleaved",
            "constraints": "JSON schema: an object with an array of >= 1000 items (never closes "
            "within the run), items " + ", ".join(CONSTRAINTS),
            "command": "python bench/structured.py"
            + "".join(
                f" --{k} {v}"
                for k, v in (
                    ("threads", args.threads),
                    ("steps", args.steps),
                    ("repeats", args.repeats),
                )
                if v is not None
            ),
        },
    )
    report += "\n## Decode step\n\n" + markdown_table(
        [
            "batch",
            "constrained rows",
            "items",
            "steps",
            "step ms (median)",
            "overhead vs unconstrained",
            "overhead, run by run",
            "row-steps masked",
            "mask ms (median)",
            "sampler ms vs unconstrained (checks, apply)",
            "masks + sampler, share of step",
        ],
        rows,
    )
    report += (
        "\nGoal: under 10% decode-step overhead with every row constrained at batch 16 (the "
        "pooled median, and 3 runs in 4) — "
        + ("; ".join(verdicts) or "not judged: no batch of 16 or more in this run")
        + ". The overhead compares medians of whole steps (the same "
        "batch, the same seeds, constrained or not, variants interleaved); the run-by-run "
        "column shows how much a shared machine moves them. A constrained row's draws are "
        "checked against its grammar first (a few microseconds a token); its mask is computed "
        "only when all 16 draws are rejected, and then taken first for the next 1, 2, 4 .. 16 "
        "steps (the row-steps masked column). Masks taken first are computed on the engine's "
        "mask worker while the forward runs when costly (llguidance drops the GIL; on a "
        "machine whose cores the forward already fills about half of that time still shows), "
        "right after it when cheap. Inside a free string most tokens are allowed, so the "
        "random-weight model's draws pass; among numbers it allows ~1% of the vocabulary and "
        "its draws mostly miss (a trained model's mostly pass); a length-bounded string is the "
        "costliest mask (0.4-1 ms a row: every character changes what may follow while most "
        "of the vocabulary stays allowed).\n"
    )
    report += "\n## Grammar compile\n\n" + markdown_table(
        ["grammar", "cold compile ms", "cached µs", "per-request matcher µs", "cold / cached"],
        compile_rows,
    )
    report += (
        f"\nBuilding the llguidance tokenizer from the model's {vocab:,} token byte strings: "
        f"{tokenizer_seconds * 1e3:.0f} ms, once per engine (the service does it at start-up). "
        "Cached compiles are a dictionary lookup keyed by the grammar text; each request gets "
        "a deep copy of the compiled matcher.\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
