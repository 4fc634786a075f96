"""Quantized KV caches on real weights: what each kv_cache_dtype keeps of the answers, against
the unquantized cache, on the real model in bfloat16 and float32 weights, in one run.

    python bench/kv_quality.py [--model models/smollm2-135m-instruct] [--new-tokens 64]

The prompts are bench/data/kv_quality_prompts.json (bench/kv_quality_prompts.py wrote them):
README sections with a number to fill in, project modules with a constant to name, and chats
whose last turn asks for a fact the user stated, 300-2,000 tokens each. For each weight dtype
and KV cache dtype, per prompt, the dtypes taking turns:

- teacher-forced on the unquantized cache's greedy tokens (logits taken at the sampler): the
  share of positions whose greedy token is the same, and the mean KL(unquantized || quantized);
- free-running greedy: ROUGE-L F1 of the answer against the unquantized cache's, and the
  fact-copy score: the share of prompts whose answer states the expected number or name (a
  whole word, exactly as written);
- perplexity over a 1,000-token text (a README section, teacher-forced after its first 16
  tokens), and the median decode step time of the free-running answers.

Writes bench/results/kv_quality.md and kv_quality.png."""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.inference.text.chat_template import ChatMessage, load_chat_template
from kvchat.memory.config import CacheConfig

PROMPTS = Path(__file__).resolve().parent / "data" / "kv_quality_prompts.json"
# The variants: a kv_cache_dtype, or one with "/plain" (`--kv-dtypes auto,int8,int8/plain`)
# for a cache that stores keys unturned (CacheConfig's rotate_keys off: what
# kernels.quant.key_rotation buys).
KV_DTYPES = ("auto", "int8", "fp8", "int4")
WEIGHTS = ("float32", "bfloat16")  # float32 first: bfloat16's rows are compared with it too
PERPLEXITY_TEXT = "How a turn reuses memory"  # a README section, about 1,000 tokens
PERPLEXITY_CONTEXT = 16


class ForcingSampler:
    """Records the logits the engine samples from, and when each step's sampling ran; answers
    with the given tokens (teacher forcing), or with the real sampler's when none are given."""

    def __init__(self, sampler: Any, forced: list[int] | None = None) -> None:
        self.sampler = sampler
        self.forced = forced
        self.logits: list[torch.Tensor] = []
        self.times: list[float] = []

    def __call__(self, logits: torch.Tensor, params: Any, generators: Any, **kwargs: Any) -> Any:
        self.times.append(time.perf_counter())
        self.logits.append(logits[0].detach().float().clone())
        out = self.sampler(logits, params, generators, **kwargs)
        if self.forced is not None:
            out.token_ids[0] = self.forced[len(self.logits) - 1]
        return out


@dataclass
class Run:
    tokens: list[int]
    logits: list[torch.Tensor]
    step_seconds: list[float]  # between consecutive decode steps


def run(engine: Engine, prompt: list[int], new_tokens: int, forced: list[int] | None) -> Run:
    sampler = ForcingSampler(engine.sampler, forced)
    engine.sampler = sampler  # type: ignore[assignment]
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        out = engine.generate([prompt], params)[0]
    finally:
        engine.sampler = sampler.sampler
    steps = [b - a for a, b in zip(sampler.times[1:], sampler.times[2:])]
    return Run(list(out.output_token_ids or []), sampler.logits, steps)


@dataclass
class Scores:
    agree: list[float] = field(default_factory=list)  # per prompt, teacher-forced
    kl: list[float] = field(default_factory=list)  # per position
    # The same against the float32 weights' unquantized cache (bfloat16's rows)
    f32_agree: list[float] = field(default_factory=list)
    f32_kl: list[float] = field(default_factory=list)
    rouge: list[float] = field(default_factory=list)
    facts: list[bool] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    perplexity: float = float("nan")
    bytes_per_token: int = 0


def answer(engine: Engine, tokens: list[int]) -> str:
    """The greedy answer: the tokens up to the first end-of-sequence token, as text."""
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    end = next((i for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids), len(tokens))
    return tokenizer.decode(tokens[:end])


def states(text: str, fact: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(fact)}(?![\w]|\.\d)", text) is not None


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over whitespace-separated words."""
    a, b = candidate.split(), reference.split()
    if not a or not b:
        return float(a == b)
    lcs = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, 1):
            prev, lcs[j] = lcs[j], prev + 1 if x == y else max(lcs[j], lcs[j - 1])
    common = lcs[-1]
    if common == 0:
        return 0.0
    p, r = common / len(a), common / len(b)
    return 2 * p * r / (p + r)


def compare(reference: Run, forced: Run, agree: list[float], kl: list[float]) -> None:
    """Teacher-forced agreement (one entry) and KL (one per position) of `forced`, run on
    the reference's tokens, against the reference."""
    same = [int(q.argmax()) == t for q, t in zip(forced.logits, reference.tokens)]
    agree.append(sum(same) / len(same))
    for p_logits, q_logits in zip(reference.logits, forced.logits):
        logp, logq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
        kl.append(float((logp.exp() * (logp - logq)).sum()))


def perplexity(engine: Engine, text_ids: list[int]) -> float:
    forced = run(engine, text_ids[:PERPLEXITY_CONTEXT], len(text_ids) - PERPLEXITY_CONTEXT,
                 text_ids[PERPLEXITY_CONTEXT:])  # fmt: skip
    nll = [
        -float(logits.log_softmax(-1)[t])
        for logits, t in zip(forced.logits, text_ids[PERPLEXITY_CONTEXT:])
    ]
    return math.exp(sum(nll) / len(nll))


def measure_weights(
    weights: str,
    args: argparse.Namespace,
    prompts: list[dict[str, Any]],
    bar: tqdm,
    f32_references: list[Run] | None = None,
) -> tuple[dict[str, Scores], list[Run]]:
    """Every variant on these weights against their unquantized cache (and, given the float32
    weights' reference runs, against those too); returns the scores and the reference runs."""
    engines = {
        kv: Engine(
            EngineConfig(
                model=str(args.model),
                dtype=weights,
                device="cpu",
                cache=CacheConfig(
                    kv_cache_dtype=kv.split("/")[0],
                    rotate_keys=not kv.endswith("/plain"),
                    kv_cache_bytes=256 * 2**20,
                ),
            )
        )
        for kv in args.kv_dtypes
    }
    auto = engines["auto"]
    assert auto.tokenizer is not None
    template = load_chat_template(args.model, auto.tokenizer)
    scores = {kv: Scores(bytes_per_token=engines[kv].kv_spec.bytes_per_token) for kv in engines}
    quantized = [kv for kv in args.kv_dtypes if kv != "auto"]
    references = []
    for i, prompt in enumerate(prompts):
        messages = [ChatMessage(m["role"], m["content"]) for m in prompt["messages"]]
        ids = template.render_ids(messages, add_generation_prompt=True)
        args.prompt_tokens.append(len(ids))
        reference = run(auto, ids, args.new_tokens, None)
        references.append(reference)
        ref_answer = answer(auto, reference.tokens)
        ref = scores["auto"]
        ref.facts.append(states(ref_answer, prompt["answer"]))
        ref.step_seconds += reference.step_seconds
        if f32_references is not None:
            f32 = f32_references[i]
            compare(f32, run(auto, ids, args.new_tokens, f32.tokens), ref.f32_agree, ref.f32_kl)
        bar.update()
        order = quantized[i % len(quantized) :] + quantized[: i % len(quantized)]
        for kv in order:  # the dtypes take turns going first
            engine, s = engines[kv], scores[kv]
            compare(reference, run(engine, ids, args.new_tokens, reference.tokens), s.agree, s.kl)
            if f32_references is not None:
                f32 = f32_references[i]
                forced = run(engine, ids, args.new_tokens, f32.tokens)
                compare(f32, forced, s.f32_agree, s.f32_kl)
            free = run(engine, ids, args.new_tokens, None)
            text = answer(engine, free.tokens)
            s.rouge.append(rouge_l(text, ref_answer))
            s.facts.append(states(text, prompt["answer"]))
            s.identical.append(text == ref_answer)
            s.step_seconds += free.step_seconds
            bar.update()
    text_ids = auto.tokenizer.encode(readme_section(PERPLEXITY_TEXT))[: args.perplexity_tokens]
    for kv, engine in engines.items():
        scores[kv].perplexity = perplexity(engine, text_ids)
        bar.update()
    return scores, references


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def report(results: dict[str, dict[str, Scores]], args: argparse.Namespace, sizes: str) -> str:
    rows = []
    for weights, scores in results.items():
        auto = scores["auto"]
        auto_step = statistics.median(auto.step_seconds)
        for kv, s in scores.items():
            step = statistics.median(s.step_seconds)
            quantized = kv != "auto"
            rows.append(
                [
                    weights,
                    kv,
                    f"{s.bytes_per_token:,}",
                    f"{s.bytes_per_token / auto.bytes_per_token:.3f}",
                    f"{100 * statistics.mean(s.agree):.2f}%" if quantized else "100%",
                    f"{statistics.mean(s.kl):.2e}" if quantized else "0",
                    f"{statistics.mean(s.rouge):.3f}" if quantized else "1",
                    f"{sum(s.identical)}/{len(s.identical)}" if quantized else "-",
                    f"{sum(s.facts)}/{len(s.facts)}",
                    f"{s.perplexity:.3f}",
                    vs_float32(weights, kv, s),
                    f"{1e3 * step:.2f} ms ({step / auto_step:.3f}x)",
                ]
            )
    header = machine_header(
        "Quantized KV caches on real weights: what each keeps of the answers",
        {
            "model": f"{args.model.name} in bfloat16 and float32 weights",
            "prompts": f"bench/data/kv_quality_prompts.json: {sizes}; {args.new_tokens} "
            "greedy tokens each",
            "perplexity": f"README section '{PERPLEXITY_TEXT}', {args.perplexity_tokens} tokens, "
            f"teacher-forced after the first {PERPLEXITY_CONTEXT}",
            "command": "python bench/kv_quality.py",
        },
    )
    table = markdown_table(
        [
            "weights",
            "kv_cache_dtype",
            "KV bytes / token",
            "vs auto",
            "top-1 agreement (teacher-forced)",
            "mean KL(auto ‖ kv)",
            "ROUGE-L F1 vs auto",
            "answers identical",
            "fact-copy score",
            "perplexity",
            "vs float32 weights, unquantized: top-1 / KL",
            "decode step (median)",
        ],
        rows,
    )
    notes = (
        "\nThe reference is the same engine with the unquantized cache (`auto`: the weights' "
        "dtype). Teacher-forced agreement and KL are measured position by position on the "
        "reference's greedy tokens, so one early divergence does not spoil the rest; ROUGE-L "
        "and answers identical compare the free-running greedy answers. The fact-copy score "
        "counts the answers that state the expected number or name exactly. The last-but-one "
        "column holds bfloat16's rows against the float32 weights' unquantized cache: the "
        "bfloat16 model's own loss, and what a quantized cache adds to it.\n"
    )
    return header + "\n" + table + notes


def vs_float32(weights: str, kv: str, s: Scores) -> str:
    """Top-1 agreement and KL against the float32 weights' unquantized cache: bfloat16's own
    loss, and what a quantized cache adds to it."""
    if weights == "float32":
        agree, kl = (s.agree, s.kl) if kv != "auto" else ([1.0], [0.0])
    else:
        agree, kl = s.f32_agree, s.f32_kl
    if not agree:
        return "-"
    return f"{100 * statistics.mean(agree):.2f}% / {statistics.mean(kl):.2e}"


def plot(results: dict[str, dict[str, Scores]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kvs = [kv for kv in next(iter(results.values())) if kv != "auto"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(results)
    lowest = 100.0
    for i, (weights, scores) in enumerate(results.items()):
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(kvs))]
        agree = [100 * statistics.mean(scores[kv].agree) for kv in kvs]
        kls = [statistics.mean(scores[kv].kl) for kv in kvs]
        lowest = min(lowest, *agree)
        axes[0].bar(xs, agree, width, label=f"{weights} weights")
        axes[1].bar(xs, kls, width, label=f"{weights} weights")
    for ax in axes:
        ax.set_xticks(range(len(kvs)), kvs, rotation=30, ha="right")
        ax.legend(fontsize="small")
    axes[0].set_ylim(max(lowest - 2, 0), 100)
    axes[0].set_ylabel("teacher-forced top-1 agreement (%)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("mean KL(auto ‖ kv)")
    fig.suptitle("Quantized KV caches against the unquantized one, SmolLM2-135M-Instruct")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--perplexity-tokens", type=int, default=1000)
    ap.add_argument("--weights", default=",".join(WEIGHTS))
    ap.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_quality.md")
    args = ap.parse_args()
    args.kv_dtypes = args.kv_dtypes.split(",")
    args.prompt_tokens = []
    if args.kv_dtypes[0] != "auto":
        ap.error("--kv-dtypes must start with auto (the reference)")
    ensure_model(args.model, "smollm2-135m-instruct")
    prompts = json.loads(PROMPTS.read_text())[: args.limit]
    weights = args.weights.split(",")
    total = len(weights) * (len(prompts) * len(args.kv_dtypes) + len(args.kv_dtypes))
    results = {}
    with tqdm(total=total, desc="runs", unit="run") as bar:
        f32_references = None
        for w in weights:
            results[w], references = measure_weights(w, args, prompts, bar, f32_references)
            if w == "float32":
                f32_references = references
    sizes = prompt_sizes(prompts, args.prompt_tokens)
    text = report(results, args, sizes)
    args.out.write_text(text)
    plot(results, args.out.with_suffix(".png"))
    print(text)


def prompt_sizes(prompts: list[dict[str, Any]], counts: list[int]) -> str:
    kinds = {k: sum(p["kind"] == k for p in prompts) for k in ("document", "code", "conversation")}
    return (
        f"{len(prompts)} prompts ({kinds['document']} documents, {kinds['code']} code, "
        f"{kinds['conversation']} conversations) of {min(counts)}-{max(counts)} tokens"
    )


if __name__ == "__main__":
    main()
