"""The CPU's paged decode attention (kernels/cpu_decode_attention.cpp): its vector path against
its plain loop, in the same run, at the bench model's shapes (12 query heads over 4 KV heads of
64, blocks of 16 scattered over a pool), for one sequence and for 16, at several contexts.

    python bench/cpu_attention.py [--contexts 128 512 2048] [--dtypes bfloat16 float32]

Each call is timed warm (the same call just before) and as a decode step meets it: after a
stream of one layer's weights (12 MiB of bf16) has pushed the context out of the caches.
Variants are interleaved call by call. Writes bench/results/cpu_attention.md."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvchat.bench.common import RESULTS, machine_header, markdown_table
from kvchat.kernels.cpu_ops import load_cpu_ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16
POOL_BLOCKS = 8192  # 256 MiB of bf16 K and V: the blocks of a sequence lie far apart
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def time_calls(
    dtype: torch.dtype, seqs: int, context: int, calls: int, gen: torch.Generator
) -> dict[tuple[bool, bool], float]:
    """Median microseconds per call for (vectorized, cold)."""
    kc = torch.randn(POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    vc = torch.randn(POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    per_seq = -(-context // BLOCK)
    tables = torch.randperm(POOL_BLOCKS, generator=gen)[: seqs * per_seq]
    tables = tables.view(seqs, per_seq).to(torch.int32).contiguous()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    query = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(query)
    layer = torch.empty(12 * 1024**2 // 2, dtype=torch.bfloat16).normal_(generator=gen)
    scale = HEAD_DIM**-0.5
    times: dict[tuple[bool, bool], list[float]] = {
        (v, c): [] for v in (True, False) for c in (False, True)
    }
    op = torch.ops.kvchat_cpu.decode_attention
    for _ in range(calls):
        for vectorized in (True, False):
            for cold in (False, True):
                if cold:
                    layer.sum()  # the weight stream a decode step runs between attentions
                else:
                    op(query, kc, vc, tables, lens, scale, out, vectorized)
                start = time.perf_counter()
                op(query, kc, vc, tables, lens, scale, out, vectorized)
                times[(vectorized, cold)].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=DTYPES)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu_attention.md")
    args = ap.parse_args()
    if not load_cpu_ops():
        raise SystemExit("kvchat's CPU ops could not be built on this machine")
    started, load_start = time.gmtime(), os.getloadavg()
    gen = torch.Generator().manual_seed(0)
    rows = []
    cases = [(d, s, c) for d in args.dtypes for s in args.seqs for c in args.contexts]
    for name, seqs, context in tqdm(cases, desc="cases", unit="case"):
        t = time_calls(DTYPES[name], seqs, context, args.calls, gen)
        rows.append(
            [
                name,
                seqs,
                context,
                f"{t[(False, False)]:.1f}",
                f"{t[(True, False)]:.1f}",
                f"{t[(False, False)] / t[(True, False)]:.2f}x",
                f"{t[(False, True)]:.1f}",
                f"{t[(True, True)]:.1f}",
                f"{t[(False, True)] / t[(True, True)]:.2f}x",
            ]
        )
    header = machine_header(
        "CPU paged decode attention: vector path against the plain loop",
        {
            "shapes": f"{HEADS} query heads over {KV_HEADS} KV heads of {HEAD_DIM}, blocks of "
            f"{BLOCK} scattered over a pool of {POOL_BLOCKS}",
            "calls": f"{args.calls} per variant and case, interleaved; medians",
            "command": "python bench/cpu_attention.py",
        },
        started=started,
        load_start=load_start,
    )
    table = markdown_table(
        [
            "cache",
            "sequences",
            "context",
            "plain warm us",
            "vector warm us",
            "speed-up warm",
            "plain after weights us",
            "vector after weights us",
            "speed-up after weights",
        ],
        rows,
    )
    report = (
        f"{header}\nOne call of the op for a layer: every sequence's query heads "
        f"against its context. 'After weights': just after a stream of 12 MiB (one "
        f"layer's bf16 weights), as a decode step calls it.\n\n{table}\n"
    )
    args.out.write_text(report)
    print(report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
