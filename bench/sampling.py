"""What the sampling knobs cost a decode step: the engine decoding a batch of 16 sequences,
plain (temperature and a seed) against the same with every knob on every row (presence,
frequency and repetition penalties, 32 logit_bias entries, min_p) and on half the rows, the
variants alternating round by round in one process. The prompts are --prompt-tokens long.

    python bench/sampling.py [--model models/smollm2-135m-instruct] [--rounds 8]

Writes bench/results/sampling.md: per variant the median step time and its ratio to plain
(the goal: all knobs on every row within 1.05x).

    python bench/sampling.py --penalties [--vocab 49152] [--penalty-rounds 10] [--threads 1]

Times the penalty step alone (every knob on every row of a batch of 16, no model) at histories
of 512, 4,096 and 16,384 tokens: each row's PenaltyState, updated by one token a step (what
the engine runs, inference/model/penalty_state.py), against the whole-history computation it
replaced (apply_penalties_reference), in blocks of steps taking turns, round by round. Writes
bench/results/sampling_penalties.md (the goal: the state's step within 1.2x across the
histories)."""

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
from kvchat.inference.engine.host_memory import keep_freed_memory
from kvchat.inference.model.penalties import apply_penalties_reference, apply_penalty_states
from kvchat.inference.model.penalty_state import PenaltyState
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
    """Median ms of the sampler on [BATCH, V] logits with the rows' penalty states (as the
    engine keeps them, over histories of the prompt and 32 tokens), plain and with every knob
    on every row, the two alternating call by call."""
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
    states = {
        name: [
            PenaltyState.of(p, ids, prompt_tokens, vocab) if p.has_penalties else None
            for p, ids in zip(rows, token_ids)
        ]
        for name, rows in seen.items()
    }
    times: dict[str, list[float]] = {name: [] for name in seen}
    generators = [torch.Generator().manual_seed(row) for row in range(BATCH)]
    for _ in range(calls):
        for name, rows in seen.items():
            begun = time.perf_counter()
            engine.sampler(logits, rows, generators, penalties=states[name])
            times[name].append(time.perf_counter() - begun)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


HISTORIES = (512, 4096, 16384)
OUTPUT_TOKENS = 64  # of each history, the reply so far: what frequency and presence count
# Steps one variant runs before the other takes its turn: each runs in caches of its own making
# (step by step, the reference's megabytes of indices would evict the state's few).
BLOCK_STEPS = 10
TEXT_TOKENS = 512
HISTORY_KINDS = {
    # every id equally likely: a row's distinct ids grow with its history (nearly one a token)
    "random ids": "every id of the vocabulary equally likely",
    # text-like: ids drawn with Zipf's frequencies, p(rank k) ~ 1 / k^1.1
    "Zipf ids": "ids drawn with Zipf's frequencies (p ~ 1 / rank^1.1), as a text's tokens are",
    # a row's distinct ids stay TEXT_TOKENS whatever its length
    f"a {TEXT_TOKENS}-token text repeated": f"{TEXT_TOKENS} random ids, repeated to the length",
}


def penalty_params(row: int) -> SamplingParams:
    return params(True, row, max(HISTORIES))


class HistoryDraws:
    """Token ids of one history kind, drawn from one generator."""

    def __init__(self, kind: str, vocab: int, generator: torch.Generator) -> None:
        self.kind, self.vocab, self.generator = kind, vocab, generator
        self.text = torch.randint(0, vocab, (TEXT_TOKENS,), generator=generator).tolist()
        self.zipf = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-1.1)
        # Zipf's ranks fall on random ids (the frequent ones are not the smallest ids).
        self.ranked = torch.randperm(vocab, generator=generator)

    def draw(self, n: int) -> list[int]:
        """A history of n tokens."""
        if self.kind == "random ids":
            return torch.randint(0, self.vocab, (n,), generator=self.generator).tolist()
        if self.kind == "Zipf ids":
            ranks = torch.multinomial(self.zipf, n, replacement=True, generator=self.generator)
            return self.ranked[ranks].tolist()
        return [self.text[i % TEXT_TOKENS] for i in range(n)]


class PenaltyRun:
    """One history kind and length: a batch of BATCH rows with every knob on, histories of
    `length` tokens (the last OUTPUT_TOKENS of them generated), and the seconds of each
    variant's steps. Every block starts again from the `length` tokens (the states built anew,
    untimed but for their build), so the histories stay within BLOCK_STEPS of `length`."""

    def __init__(self, kind: str, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(length * 7 + list(HISTORY_KINDS).index(kind))
        draws = HistoryDraws(kind, vocab, generator)
        self.length, self.vocab = length, vocab
        self.rows = [penalty_params(row) for row in range(BATCH)]
        # Each row's tokens drawn up front: no drawing between timed steps.
        self.drawn = [draws.draw(length + BLOCK_STEPS) for _ in range(BATCH)]
        self.num_prompt = [length - OUTPUT_TOKENS] * BATCH
        self.logits = torch.randn(BATCH, vocab, generator=generator)
        self.times: dict[str, list[float]] = {"reference": [], "state": [], "build": []}
        self.distinct = 0.0  # a row's distinct ids at the end of a block

    def block(self, variant: str) -> None:
        """BLOCK_STEPS steps of `variant`, each adding a token to each row: the whole-history
        reference, or the states' one-token update and apply_penalty_states."""
        histories = [ids[: self.length] for ids in self.drawn]
        states = []
        if variant == "state":
            for p, ids, n in zip(self.rows, histories, self.num_prompt):
                begun = time.perf_counter()
                states.append(PenaltyState.of(p, ids, n, self.vocab))
                self.times["build"].append(time.perf_counter() - begun)
        for _ in range(BLOCK_STEPS):
            for ids, drawn in zip(histories, self.drawn):
                ids.append(drawn[len(ids)])
            begun = time.perf_counter()
            if variant == "reference":
                apply_penalties_reference(self.logits, self.rows, histories, self.num_prompt)
            else:
                for state, ids in zip(states, histories):
                    state.update(ids)
                apply_penalty_states(self.logits, states)
            self.times[variant].append(time.perf_counter() - begun)
        self.distinct = statistics.mean(len(set(ids)) for ids in histories)

    def median_ms(self, variant: str) -> float:
        return statistics.median(self.times[variant]) * 1000


def penalties_main(args: argparse.Namespace) -> None:
    """The penalty step alone, at each history length and kind (see the module docstring)."""
    keep_freed_memory()  # as the engine does: the step's tensors reuse freed heap
    runs = {
        (kind, length): PenaltyRun(kind, length, args.vocab)
        for kind in HISTORY_KINDS
        for length in HISTORIES
    }
    # Round by round every run takes a block of each variant, so that the machine's load, which
    # changes, weighs on all of them alike.
    for round_ in tqdm(range(args.penalty_rounds), desc="rounds"):
        for run in runs.values():
            for variant in ("reference", "state") if round_ % 2 == 0 else ("state", "reference"):
                run.block(variant)
    rows = []
    ratios = []
    for kind in HISTORY_KINDS:
        base = runs[kind, HISTORIES[0]].median_ms("state")
        for length in HISTORIES:
            run = runs[kind, length]
            reference, state = run.median_ms("reference"), run.median_ms("state")
            rows.append(
                [
                    kind,
                    length,
                    round(run.distinct),
                    round(reference, 3),
                    round(state, 3),
                    f"{reference / state:.1f}x",
                    f"{state / base:.2f}x",
                    round(run.median_ms("build"), 2),
                ]
            )
        steps = [runs[kind, length].median_ms("state") for length in HISTORIES]
        spread = max(steps) / min(steps)
        ratios.append(
            f"- {kind}: the state's step at "
            + " / ".join(f"{n:,}" for n in HISTORIES[1:])
            + " tokens is "
            + " / ".join(f"{t / base:.2f}x" for t in steps[1:])
            + f" its step at {HISTORIES[0]}; the slowest of the {len(HISTORIES)} is "
            f"{spread:.2f}x the fastest ({'within' if spread <= 1.2 else 'not within'} 1.2x)"
        )
    header = [
        "history",
        "tokens",
        "distinct ids a row",
        "whole history (ms a step, median)",
        "state (ms a step, median)",
        "whole history / state",
        "state vs 512 tokens",
        "state's build, once a sequence (ms a row, median)",
    ]
    table = markdown_table(header, rows) + "\n" + "\n".join(ratios) + "\n"
    print(table)
    text = machine_header(
        "What the penalties cost a step, by history length (bench/sampling.py --penalties)",
        {
            "batch": f"{BATCH} rows, vocabulary {args.vocab} (SmolLM2's by default), logits "
            "float32 on the CPU, no model",
            "knobs": KNOBS + ", on every row (min_p is not a penalty: not timed here)",
            "histories": f"{', '.join(f'{n:,}' for n in HISTORIES)} tokens, the last "
            f"{OUTPUT_TOKENS} generated, growing by one token a row each step of a block of "
            f"{BLOCK_STEPS} (each block starts again from the length); "
            + "; ".join(f"{k}: {v}" for k, v in HISTORY_KINDS.items()),
            "variants": "whole history: apply_penalties_reference, each row's prompt and "
            "output read every step (the code before PenaltyState); state: each row's "
            "PenaltyState (its repetition and offset vectors over the vocabulary) updated by "
            "the step's token, then apply_penalty_states; "
            f"{args.penalty_rounds} rounds, in each a block of {BLOCK_STEPS} steps of each "
            "variant for every history (the variants' order alternating round by round); the "
            f"median of each one's {args.penalty_rounds * BLOCK_STEPS} steps",
            "threads": f"{torch.get_num_threads()} torch threads",
        },
    )
    args.out.write_text(text + "\n" + table)
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per round")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--penalties", action="store_true", help="time the penalty step alone, no model"
    )
    parser.add_argument("--vocab", type=int, default=49152, help="with --penalties")
    parser.add_argument(
        "--penalty-rounds", type=int, default=10, help=f"rounds of {BLOCK_STEPS} steps, --penalties"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.penalties:
        args.out = args.out or RESULTS / "sampling_penalties.md"
        penalties_main(args)
        return
    args.out = args.out or RESULTS / "sampling.md"
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
