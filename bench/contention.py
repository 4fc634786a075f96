"""kvchat serve on a shared CPU: adaptive CPU threads (inference/engine/cpu_threads.py) against
always all of torch's threads, each with OpenMP's default (spinning) wait policy and with
OMP_WAIT_POLICY=PASSIVE, on a quiet machine and beside CPU-bound processes, in one run.

For each neighbourhood (quiet, then one or more `python -c "while True: pass"` beside the
server) and each variant, a fresh `kvchat serve` of the model answers, one request at a time:
a long prompt's time to first token (streamed; a new prompt each time, so nothing is cached)
and a reply's decode rate (`ignore_eos`, so every reply has the same length), after one short
warm-up request (a server that has served). The variants
alternate round by round, so all see the same machine; medians of the rounds, and each
variant's ratio to the first (the default: adaptive threads, OpenMP's own wait policy).

    python bench/contention.py [--model models/smollm2-135m-instruct] [--rounds 3]
        [--variants "adaptive,all threads"]

Writes bench/results/contention.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, machine_header, markdown_table, serve_command
from kvchat.bench.startup import free_port, wait_ready

# name -> (--adaptive-cpu-threads, environment added); names hold no commas (--variants)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "adaptive": ("true", {}),
    "adaptive + passive OpenMP": ("true", {"OMP_WAIT_POLICY": "PASSIVE"}),
    "all threads": ("false", {}),
    "all threads + passive OpenMP": ("false", {"OMP_WAIT_POLICY": "PASSIVE"}),
}
WARMUP_TOKENS = 32
PARAGRAPH = (
    "The history of the printing press begins in Mainz, where craftsmen worked with metal "
    "type, oil-based ink and a screw press adapted from those that pressed wine and olives. "
)


@dataclass
class Served:
    ttft_s: list[float]
    decode_tok_s: list[float]


@contextlib.contextmanager
def neighbours(count: int) -> Iterator[None]:
    """`count` CPU-bound processes beside the server while the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        if spinners:
            time.sleep(1.0)
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@contextlib.contextmanager
def server(
    model: Path, variant: tuple[str, dict[str, str]], dtype: str, work: Path
) -> Iterator[tuple[str, str]]:
    """A fresh `kvchat serve` (its own SQLite database); yields its URL and admin key."""
    adaptive, extra_env = variant
    data = Path(tempfile.mkdtemp(dir=work, prefix="data-"))
    port = free_port()
    command = serve_command(
        model,
        port,
        "--dtype",
        dtype,
        "--data-dir",
        str(data),
        "--adaptive-cpu-threads",
        adaptive,
        "--kv-cache-bytes",
        str(256 * 2**20),
        "--linear-plan-dir",
        str(work / "linear_plans"),
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", **extra_env}
    log_path = data / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(process, url, time.perf_counter(), log_path)
            yield url, admin_key(log_path.read_text())
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    shutil.rmtree(data, ignore_errors=True)


def admin_key(log: str) -> str:
    """The admin key a first start prints."""
    for word in log.split():
        if word.startswith("kvc-"):
            return word
    raise RuntimeError("no key in the server's output")


def measure(url: str, key: str, round_: int, prompt_words: int, decode_tokens: int) -> Served:
    headers = {"Authorization": f"Bearer {key}"}
    repeats = max(1, prompt_words // len(PARAGRAPH.split()))
    ttfts, rates = [], []
    with httpx.Client(base_url=url, headers=headers, timeout=900) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        warmup = client.post(  # a server that has served: its steps timed once
            "/v1/chat/completions",
            json={
                "model": model,
                "max_tokens": WARMUP_TOKENS,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Warm-up {round_}."}],
            },
        )
        warmup.raise_for_status()
        for i in range(2):
            prompt = f"Document {round_}-{i}. " + PARAGRAPH * repeats + " Summarize it."
            begun = time.perf_counter()
            with client.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": model,
                    "stream": True,
                    "max_tokens": 2,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": prompt}],
                },
            ) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: {") and any(
                        c["delta"].get("content") for c in json.loads(line[6:])["choices"]
                    ):
                        ttfts.append(time.perf_counter() - begun)
                        break
                for _ in lines:  # the rest of the stream
                    pass
            begun = time.perf_counter()
            reply = client.post(
                "/v1/chat/completions",
                json={
                    "model": model,
                    "max_tokens": decode_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Story {round_}-{i} about a cat."}],
                },
            )
            reply.raise_for_status()
            usage = reply.json()["usage"]
            rates.append(usage["completion_tokens"] / (time.perf_counter() - begun))
    return Served(ttfts, rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--neighbours", default="0,1", help="CPU-bound processes, per row")
    parser.add_argument("--prompt-words", type=int, default=700)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, the first the base of the ratios; of: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "contention.md")
    args = parser.parse_args()
    counts = [int(c) for c in args.neighbours.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")

    results: dict[tuple[int, str], Served] = {}
    runs = [(n, r, v) for n in counts for r in range(args.rounds) for v in variants]
    with tempfile.TemporaryDirectory(prefix="kvchat-contention-") as tmp:
        work = Path(tmp)
        for count, round_, variant in tqdm(runs, desc="servers", unit="server"):
            with (
                neighbours(count),
                server(args.model, VARIANTS[variant], args.dtype, work) as (url, key),
            ):
                served = measure(url, key, round_, args.prompt_words, args.decode_tokens)
            tqdm.write(
                f"{count} beside, round {round_}, {variant}: TTFT "
                f"{[round(t * 1000) for t in served.ttft_s]} ms, decode "
                f"{[round(r, 1) for r in served.decode_tok_s]} tok/s"
            )
            total = results.setdefault((count, variant), Served([], []))
            total.ttft_s += served.ttft_s
            total.decode_tok_s += served.decode_tok_s

    rows = []
    for count in counts:
        medians = {
            v: (
                statistics.median(results[(count, v)].ttft_s),
                statistics.median(results[(count, v)].decode_tok_s),
            )
            for v in variants
        }
        base_ttft, base_rate = medians[variants[0]]
        for v in variants:
            ttft, rate = medians[v]
            rows.append(
                [
                    "quiet" if count == 0 else f"{count} CPU-bound beside",
                    v,
                    round(ttft * 1000),
                    f"{ttft / base_ttft:.2f}x",
                    round(rate, 1),
                    f"{rate / base_rate:.2f}x",
                ]
            )
    header = [
        "machine",
        "variant",
        "TTFT (ms)",
        f"TTFT / {variants[0]}",
        "decode (tok/s)",
        f"decode / {variants[0]}",
    ]
    table = markdown_table(header, rows)
    print(table)
    text = machine_header(
        "kvchat serve on a shared CPU: CPU threads and OpenMP's wait policy (bench/contention.py)",
        {
            "model": f"{args.model.name} ({args.dtype})",
            "requests": f"one at a time; TTFT of a ~{args.prompt_words}-word prompt (new each "
            f"time), streamed; decode of {args.decode_tokens} tokens (ignore_eos)",
            "rounds": f"{args.rounds}, variants alternating, a fresh server each, which first "
            f"answers one {WARMUP_TOKENS}-token warm-up request; medians of 2 requests per round",
            "variants": "; ".join(
                f"{v}: --adaptive-cpu-threads {VARIANTS[v][0]}"
                + "".join(f", {k}={val}" for k, val in VARIANTS[v][1].items())
                for v in variants
            ),
            "neighbours": "`python -c 'while True: pass'`, started 1 s before the server",
            "command": "python bench/contention.py " + " ".join(sys.argv[1:]),
        },
    )
    args.out.write_text(text + "\n" + table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
