"""Quantized KV cache quality and size: int8, fp8 and int4 against the model-dtype cache (`auto`) on
the bench model and a fixed set of prompts, in one run.

    python bench/kv_dtype.py [--new-tokens 128]

For each cache dtype: KV bytes per token (scales included) and its ratio to `auto`; the mean
KL divergence KL(p_auto || p_quant) of next-token distributions, teacher-forced on the auto
run's tokens; the share of positions whose greedy token matches under teacher forcing; and,
free-running, how many of the 128 greedy tokens match before the first divergence.
Writes bench/results/kv_dtype.md."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.bench.kv_quality import run
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.memory.config import CacheConfig

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Dear team,\n\nThank you for the detailed report on last quarter's results. Before the "
    "meeting on Thursday I would like to go through three points:",
    "Q: A train leaves the station at 9:40 and travels 180 km at 72 km/h. When does it arrive?\nA:",
    "Paged attention stores the key and value cache in fixed-size blocks so that",
    "Once upon a time, in a village at the edge of a great forest, there lived",
]
QUANTIZED = ("int8", "fp8", "int4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_dtype.md")
    args = ap.parse_args()

    model_dir = ensure_model(args.model, "bench")
    engines = {
        kv: Engine(
            EngineConfig(
                model=str(model_dir),
                dtype=args.dtype,
                device="cpu",
                attention_backend="torch",
                cache=CacheConfig(kv_cache_dtype=kv, kv_cache_bytes=256 * 2**20),
            )
        )
        for kv in ("auto", *QUANTIZED)
    }
    tokenizer = engines["auto"].tokenizer
    assert tokenizer is not None
    prompts = [tokenizer.encode(p) for p in PROMPTS]

    reference: list[tuple[list[int], list[torch.Tensor]]] = []
    kl: dict[str, list[float]] = {kv: [] for kv in QUANTIZED}
    forced_agree: dict[str, list[float]] = {kv: [] for kv in QUANTIZED}
    free_prefix: dict[str, list[int]] = {kv: [] for kv in QUANTIZED}
    with tqdm(total=len(prompts) * (1 + 2 * len(QUANTIZED)), desc="runs", unit="run") as bar:
        for prompt in prompts:
            ref = run(engines["auto"], prompt, args.new_tokens, None)
            tokens, logits = ref.tokens, ref.logits
            reference.append((tokens, logits))
            bar.update(1)
            for kv in QUANTIZED:
                q_logits = run(engines[kv], prompt, args.new_tokens, tokens).logits
                for p_logits, q in zip(logits, q_logits):
                    logp, logq = p_logits.log_softmax(-1), q.log_softmax(-1)
                    kl[kv].append(float((logp.exp() * (logp - logq)).sum()))
                agree = [int(q.argmax()) == t for q, t in zip(q_logits, tokens)]
                forced_agree[kv].append(sum(agree) / len(agree))
                bar.update(1)
                free = run(engines[kv], prompt, args.new_tokens, None).tokens
                same = next(
                    (i for i, (a, b) in enumerate(zip(tokens, free)) if a != b), len(tokens)
                )
                free_prefix[kv].append(same)
                bar.update(1)

    auto_bytes = engines["auto"].kv_spec.bytes_per_token
    rows: list[list[object]] = [
        [
            "auto",
            str(engines["auto"].kv_spec.storage_dtype).removeprefix("torch."),
            f"{auto_bytes:,}",
            "1.000",
            "0",
            "1.000",
            f"{args.new_tokens}/{args.new_tokens}",
        ]
    ]
    for kv in QUANTIZED:
        spec = engines[kv].kv_spec
        rows.append(
            [
                kv,
                f"{str(spec.storage_dtype).removeprefix('torch.')}"
                + (" (two codes a byte)" if kv == "int4" else "")
                + f" + fp16 scale per {spec.head_dim // spec.scale_groups} channels"
                + (", keys turned" if spec.keys_rotated else ""),
                f"{spec.bytes_per_token:,}",
                f"{spec.bytes_per_token / auto_bytes:.3f}",
                f"{sum(kl[kv]) / len(kl[kv]):.2e}",
                f"{sum(forced_agree[kv]) / len(forced_agree[kv]):.3f}",
                f"{min(free_prefix[kv])}-{max(free_prefix[kv])}/{args.new_tokens} "
                f"(mean {sum(free_prefix[kv]) / len(free_prefix[kv]):.0f})",
            ]
        )
    mc = engines["auto"].model_config
    report = machine_header(
        "Quantized KV cache: size and quality against the model dtype",
        {
            "model": f"bench preset ({mc.num_parameters / 1e6:.0f}M parameters, random weights), "
            f"{args.dtype}, {mc.num_layers} layers x {mc.num_kv_heads} KV heads x head_dim "
            f"{mc.head_dim}",
            "prompts": f"{len(prompts)} fixed prompts ({min(map(len, prompts))}-"
            f"{max(map(len, prompts))} tokens), {args.new_tokens} greedy tokens each",
            "command": "python bench/kv_dtype.py",
        },
    )
    report += "\n" + markdown_table(
        [
            "kv_cache_dtype",
            "storage",
            "KV bytes / token",
            "vs auto",
            "mean KL(auto ‖ quant)",
            "greedy agreement (teacher-forced)",
            "free-running tokens equal before divergence",
        ],
        rows,
    )
    report += (
        "\nKL and teacher-forced agreement are measured position by position on the auto run's "
        "tokens, so one early divergence does not spoil the rest. Random weights understate "
        "the loss: a trained model's keys carry outlier channels these lack, and its KL is "
        "larger; bench/kv_quality.py measures the real model.\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
