"""kvchat against llama.cpp (through llama-cpp-python) on the same weights, in one run.

    pip install -e ".[peers]"    # compiles llama.cpp: ~10 min on 2 idle cores
    python bench/peers.py [--rounds 15] [--prompt-tokens 96] [--new-tokens 48]

The model's weights are converted to GGUF by llama.cpp's own converter (from the pinned
version's source distribution; see bench/gguf_export.py) and cached by their hash. Before
anything is timed, llama.cpp's and kvchat's float32 logits are checked against transformers.
Each round takes a fresh prompt and runs every variant on it, in a rotating order: a reset
cache and the prompt, then greedy decoding token by token (llama.cpp: `reset()`, `eval()` and
argmax, never `generate()`, which reuses the previous call's cache). kvchat runs in float32
and in the half-precision type this CPU runs natively (bfloat16 where it has AVX512-BF16 or
AMX, else float16), each against llama.cpp's f32, f16 and bf16. The header names the CPU,
its ISA and the linear paths kvchat's start-up probe chose; each engine's resident memory
after loading is measured against its weights' bytes.

Serving (batches of many requests) is compared with llama.cpp's own server, which batches:
bench/peers_serving.py.

Writes bench/results/peers.md and peers.png."""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
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

PEERS_PACKAGE = "llama-cpp-python"
PEERS_VERSION = "0.3.36"  # the pin of the [peers] extra in pyproject.toml
INSTALL_HINT = f"""bench/peers.py compares kvchat with llama.cpp through {PEERS_PACKAGE}, which is
not installed. It is an optional extra (it compiles llama.cpp: ~10 min on 2 idle cores):

    CMAKE_ARGS="-DLLAVA_BUILD=OFF" pip install -e ".[peers]"

then run python bench/peers.py again."""

# ggml type ids of the KV cache (llama.h's ggml_type).
GGML_TYPES = {"f32": 0, "f16": 1, "bf16": 30}
F32_LOGITS_ATOL = 1e-4


@dataclass
class Timings:
    """Per-round wall times of one variant."""

    prefill_s: list[float] = field(default_factory=list)
    decode_step_s: list[float] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)


class LlamaCppRunner:
    """One llama.cpp context; a request is reset(), eval(prompt) and eval of each greedy
    token, the argmax read from the last row of logits."""

    def __init__(
        self,
        gguf: Path,
        kv_type: str,
        n_ctx: int,
        threads: int,
        logits_all: bool = False,
        flash_attn: bool = False,
    ) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            type_k=GGML_TYPES[kv_type],
            type_v=GGML_TYPES[kv_type],
            logits_all=logits_all,
            flash_attn=flash_attn,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()

    def _last_logits(self) -> np.ndarray:
        ptr = self.llm._ctx.get_logits_ith(-1)
        return np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
        )

    def all_logits(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens), vocab] float32 (needs logits_all)."""
        self.llm.reset()
        self.llm.eval(tokens)
        return np.array(self.llm.scores[: len(tokens)])

    def run(self, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        """(prefill seconds, decode seconds of new_tokens - 1 steps, generated ids)."""
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = int(self._last_logits().argmax())
        prefilled = time.perf_counter()
        out = [token]
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = int(self._last_logits().argmax())
            out.append(token)
        return prefilled - start, time.perf_counter() - prefilled, out


class KVChatRunner:
    def __init__(self, model_dir: Path, dtype: str, max_num_seqs: int = 16) -> None:
        from kvchat.inference.engine.config import EngineConfig
        from kvchat.inference.engine.engine import Engine
        from kvchat.inference.engine.scheduler import SchedulerConfig
        from kvchat.memory.config import CacheConfig

        self.engine = Engine(
            EngineConfig(
                model=str(model_dir),
                dtype=dtype,
                device="cpu",
                cache=CacheConfig(kv_cache_bytes=512 * 1024**2),
                scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
            )
        )
        self._count = 0

    def _params(self, new_tokens: int) -> Any:
        from kvchat.inference.model.sampling_params import SamplingParams

        return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def run(self, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        engine = self.engine
        self._count += 1
        request_id = f"peers-{self._count}"
        engine.add_request(request_id, prompt, self._params(new_tokens))
        start = time.perf_counter()
        outs = engine.step()  # prefill and the first token
        prefilled = time.perf_counter()
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
        done = time.perf_counter()
        assert final is not None and outs[0].request_id == request_id
        # A fresh prompt: nothing may come from the prefix cache, or the prefill is not timed.
        assert final.num_cached_tokens == 0, f"{final.num_cached_tokens} prompt tokens cached"
        assert final.output_token_ids is not None
        return prefilled - start, done - prefilled, list(final.output_token_ids)

    def split_decode_step(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        """(seconds per decode step, of which inside the linear layers), one sequence: the
        weight-streaming part against everything else of the step."""
        from kvchat.inference.model.linear import Linear

        inside = 0.0
        call = Linear.__call__

        def timed(linear: Linear, x: torch.Tensor) -> torch.Tensor:
            nonlocal inside
            start = time.perf_counter()
            y = call(linear, x)
            inside += time.perf_counter() - start
            return y

        engine = self.engine
        self._count += 1
        engine.add_request(f"peers-{self._count}", prompt, self._params(new_tokens))
        engine.step()
        Linear.__call__ = timed  # type: ignore[method-assign,assignment]
        try:
            start = time.perf_counter()
            steps = 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            total = time.perf_counter() - start
        finally:
            Linear.__call__ = call  # type: ignore[method-assign]
        return total / steps, inside / steps

    def logits(self, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
        """The logits kvchat samples the token after prompt + forced[:k] from, for each k:
        teacher-forced on the given tokens, as llama.cpp's all-logits evaluation is, so a
        pick that differs at one position does not make every later row incomparable."""
        engine = self.engine
        sampler = engine.sampler
        rows: list[torch.Tensor] = []

        def recording(logits: torch.Tensor, params: Any, generators: Any, **kwargs: Any) -> Any:
            rows.append(logits[0].detach().clone())
            return sampler(logits, params, generators, **kwargs)

        engine.sampler = recording  # type: ignore[assignment]
        try:
            for k in range(len(forced)):
                engine.generate([prompt + forced[:k]], self._params(1))
        finally:
            engine.sampler = sampler
        assert len(rows) == len(forced)
        return rows

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """The tokens kvchat picks decoding freely, as a request runs."""
        out = self.engine.generate([prompt], self._params(new_tokens))[0]
        assert out.output_token_ids is not None
        return list(out.output_token_ids)


# Run in a fresh process: the resident set a model and an engine add, against the weights.
_RESIDENT_PROBE = """
import json, os, sys
import torch
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.host_memory import release_freed_memory
from kvchat.inference.model.model import LlamaModel
from kvchat.inference.model.config import ModelConfig
from kvchat.inference.model.weights import load_weights
from kvchat.kernels.cpu_ops import load_cpu_ops
from kvchat.memory.config import CacheConfig
model_dir, dtype_name = sys.argv[1], sys.argv[2]
dtype = getattr(torch, dtype_name)
load_cpu_ops()
config = ModelConfig.from_dir(model_dir)
base = rss()
weights = load_weights(model_dir, config, dtype, torch.device("cpu"))
model = LlamaModel(config, weights, 4096, dtype, torch.device("cpu"))
del weights
release_freed_memory()
model_bytes = rss() - base
del model
release_freed_memory()
base = rss()
kv_bytes = 16 * 2**20
engine = Engine(EngineConfig(model=model_dir, dtype=dtype_name, device="cpu",
                             cache=CacheConfig(kv_cache_bytes=kv_bytes)))
print(json.dumps({"model": model_bytes, "engine": rss() - base - kv_bytes,
                  "weights": config.num_parameters * dtype.itemsize}))
"""


def resident_memory(model_dir: Path, dtype: str) -> dict[str, int]:
    """{model, engine, weights} bytes: what building the model (weights as the layers hold
    them) and a whole engine (tokenizer, grammar tables, kernels; its KV pool left out) add
    to a fresh process's resident set, and the bytes of the weights (tied embedding once)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-P", "-c", _RESIDENT_PROBE, str(model_dir), dtype],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    ).stdout
    result: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    return result


def native_half() -> str:
    """The half-precision type this CPU computes natively (oneDNN's view of it)."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "bfloat16"
    return "float16"


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Ids of ordinary cl100k tokens (below the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100_000, (length,), generator=g).tolist() for _ in range(n)]


def check_logits(
    model_dir: Path,
    llama_f32: LlamaCppRunner,
    kvchat: dict[str, KVChatRunner],
    llama_half: dict[str, LlamaCppRunner],
) -> list[list[object]]:
    """Logits of every engine against transformers float32 on one prompt and the 8 tokens
    transformers picks after it, each engine's row at position k computed on transformers'
    tokens before k (teacher-forced). float32 must be within F32_LOGITS_ATOL and pick the
    same greedy tokens, decoding freely too; a half-precision pick that differs is shown
    with transformers' top-two margin there (rounding can only swap near-ties)."""
    from transformers import LlamaForCausalLM

    prompt = random_prompts(1, 40, seed=12345)[0]
    new = 8
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_ids = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        hf_logits = hf(torch.tensor([prompt + hf_ids])).logits[0].float().numpy()
    del hf
    positions = list(range(len(prompt) - 1, len(prompt) - 1 + new))
    ref = hf_logits[positions]
    top2 = np.sort(ref, axis=1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    rows: list[list[object]] = []

    def compare(name: str, logits: np.ndarray, exact: bool) -> None:
        err = float(np.abs(logits - ref).max())
        picks = [int(i) for i in logits.argmax(axis=1)]
        differ = [k for k in range(new) if picks[k] != hf_ids[k]]
        greedy = (
            "yes"
            if not differ
            else "no: "
            + ", ".join(
                f"token {k + 1} of {new} (transformers' top-two margin {margins[k]:.2e})"
                for k in differ
            )
        )
        rows.append([name, f"{err:.2e}", greedy])
        if exact and (err > F32_LOGITS_ATOL or differ):
            raise SystemExit(
                f"{name}: logits differ from transformers by {err:.2e} "
                f"(limit {F32_LOGITS_ATOL}) or greedy tokens differ; not timing"
            )

    for name, runner in [("llama.cpp f32", llama_f32), *llama_half.items()]:
        logits = runner.all_logits(prompt + hf_ids)
        compare(name, logits[len(prompt) - 1 : -1], exact=name.endswith("f32"))
    for dtype, kv_runner in kvchat.items():
        compare(
            f"kvchat {dtype}",
            torch.stack(kv_runner.logits(prompt, hf_ids)).float().numpy(),
            exact=dtype == "float32",
        )
    free = kvchat["float32"].greedy(prompt, new)
    if free != hf_ids:
        raise SystemExit(
            f"kvchat float32 decoding freely picked {free}, transformers {hf_ids}; not timing"
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    ap.add_argument(
        "--cache-dir",
        type=Path,
        default=REPO / "models" / ".peers",
        help="where the GGUF files and the converter are kept",
    )
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--half",
        default="auto",
        choices=["auto", "bfloat16", "float16"],
        help="kvchat's half-precision dtype (auto: the one this CPU runs natively)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "peers.md")
    ap.add_argument(
        "--served",
        action="store_true",
        help="measure only the served single stream (kvchat serve, vLLM, llama-server on the "
        "real model) and replace that section of --out",
    )
    ap.add_argument("--served-model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    ap.add_argument("--served-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--served-rounds", type=int, default=3)
    args = ap.parse_args()
    if args.served:
        return served_only(args)

    if importlib.util.find_spec("llama_cpp") is None:
        print(INSTALL_HINT)
        return 0
    import llama_cpp

    load_start, started = os.getloadavg(), time.gmtime()
    if args.half == "auto":
        args.half = native_half()
    from kvchat.bench.gguf_export import check_side_tokenizer, gguf_files, weights_key

    version = llama_cpp.__version__
    if version != PEERS_VERSION:
        print(
            f"note: {PEERS_PACKAGE} {version} is installed, the extra pins {PEERS_VERSION}; "
            f"converting with {version}'s converter"
        )
    torch.set_num_threads(args.threads)
    model_dir = ensure_model(args.model, "bench")
    print("converting the weights to GGUF (cached by their hash) ...")
    ggufs = gguf_files(model_dir, args.cache_dir, PEERS_PACKAGE, version, ("f32", "f16", "bf16"))
    side = args.cache_dir / weights_key(model_dir) / "hf"
    num_checked = check_side_tokenizer(side, model_dir)

    n_ctx = args.prompt_tokens + args.new_tokens + 64
    llama = {
        "llama.cpp f32": LlamaCppRunner(ggufs["f32"], "f32", n_ctx, args.threads),
        "llama.cpp f16": LlamaCppRunner(ggufs["f16"], "f16", n_ctx, args.threads),
        "llama.cpp bf16": LlamaCppRunner(ggufs["bf16"], "bf16", n_ctx, args.threads),
    }
    kvchat = {
        "float32": KVChatRunner(model_dir, "float32"),
        args.half: KVChatRunner(model_dir, args.half),
    }
    print("checking logits against transformers ...")
    check_ctx = 64
    checks = check_logits(
        model_dir,
        LlamaCppRunner(ggufs["f32"], "f32", check_ctx, args.threads, logits_all=True),
        kvchat,
        {
            name: LlamaCppRunner(
                ggufs[name.split()[-1]], name.split()[-1], check_ctx, args.threads, logits_all=True
            )
            for name in ("llama.cpp f16", "llama.cpp bf16")
        },
    )
    print(
        markdown_table(
            ["engine", "max |logit - transformers f32|", "greedy = transformers"], checks
        )
    )

    variants: dict[str, Callable[[list[int], int], tuple[float, float, list[int]]]] = {
        f"kvchat {dtype}": runner.run for dtype, runner in kvchat.items()
    }
    variants.update({name: runner.run for name, runner in llama.items()})
    # Warm-up: first calls allocate and fault in pages.
    for run in variants.values():
        run(random_prompts(1, args.prompt_tokens, seed=999)[0], 4)

    timings = {name: Timings() for name in variants}
    bandwidths = []
    names = list(variants)
    for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
        bandwidths.append(copy_bandwidth())
        prompt = random_prompts(1, args.prompt_tokens, seed=r)[0]
        for name in names[r % len(names) :] + names[: r % len(names)]:
            prefill, decode, ids = variants[name](prompt, args.new_tokens)
            t = timings[name]
            t.prefill_s.append(prefill)
            t.decode_step_s.append(decode / (args.new_tokens - 1))
            t.request_s.append(prefill + decode)
            t.tokens.append(ids)
    for r in range(args.rounds):
        a, b = timings["kvchat float32"].tokens[r], timings["llama.cpp f32"].tokens[r]
        assert a == b, f"round {r}: kvchat and llama.cpp float32 picked different tokens"

    # Where kvchat's single-sequence decode step goes: linear layers (the weight stream)
    # against the rest, medians of interleaved rounds.
    # Each beside its llama.cpp peer's step on the same prompt, in the same round.
    splits: dict[str, list[tuple[float, float, float]]] = {dtype: [] for dtype in kvchat}
    for r in tqdm(range(5), desc="step split", unit="round"):
        prompt = random_prompts(1, args.prompt_tokens, seed=500 + r)[0]
        for dtype, runner in kvchat.items():
            step, inside = runner.split_decode_step(prompt, args.new_tokens)
            peer = llama[
                "llama.cpp f32"
                if dtype == "float32"
                else "llama.cpp bf16"
                if dtype == "bfloat16"
                else "llama.cpp f16"
            ]
            _, peer_decode, _ = peer.run(prompt, args.new_tokens)
            splits[dtype].append((step, inside, peer_decode / (args.new_tokens - 1)))

    bandwidths.append(copy_bandwidth())
    load_end = os.getloadavg()

    report = build_report(
        args,
        model_dir,
        timings,
        kvchat,
        checks,
        num_checked,
        max(bandwidths),
        version,
        splits,
        (load_start, load_end, started),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    plot(timings, args, args.out.with_suffix(".png"))
    return 0


SERVED_BEGIN = "<!-- served single stream: python bench/peers.py --served -->"
SERVED_END = "<!-- end of the served single stream -->"
SERVED_LENGTHS = (128, 512, 2000)
SERVED_NEW_TOKENS = 128


def served_only(args: argparse.Namespace) -> int:
    """Measure the served single stream and put its section into --out (replacing the one
    there; the in-process sections are left as they were measured)."""
    section = served_section(args)
    old = args.out.read_text() if args.out.exists() else ""
    if SERVED_BEGIN in old and SERVED_END in old:
        head, rest = old.split(SERVED_BEGIN, 1)
        text = head + section + rest.split(SERVED_END, 1)[1]
    else:
        text = old.rstrip("\n") + "\n\n" + section + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(section)
    return 0


def served_section(args: argparse.Namespace) -> str:
    """kvchat serve, vLLM and llama-server on the real model, one request at a time through
    the same streaming Chat Completions client: TTFT at 128, 512 and 2,000-token prompts
    (fresh ones, nothing cached) and the decode rate of 128 greedy tokens."""
    import asyncio
    import tempfile

    from kvchat.bench import vllm_server
    from kvchat.bench.peers_serving import (
        SERVERS,
        OneStream,
        one_stream,
        peer_files,
        start_server,
    )

    load_start, started = os.getloadavg(), time.gmtime()
    model_dir = ensure_model(args.served_model, args.served_model.name)
    gguf, binary = peer_files(model_dir, args.served_dtype, list(SERVERS))
    # about one token a word; the chat template adds its own (the table gives the counts)
    lengths = list(SERVED_LENGTHS)
    words = {n: max(8, n - 40) for n in lengths}
    results: dict[str, OneStream] = {}
    total = len(SERVERS) * len(lengths) * args.served_rounds
    with (
        tqdm(total=total, desc="served single stream", unit="req") as bar,
        tempfile.TemporaryDirectory(prefix="kvchat-peers-") as tmp,
    ):
        for name in SERVERS:
            server = start_server(
                name, model_dir, args.served_dtype, args.threads, Path(tmp) / name, gguf, binary
            )
            result = results[name] = OneStream(name)
            try:
                asyncio.run(
                    one_stream(
                        server,
                        list(words.values()),
                        SERVED_NEW_TOKENS,
                        args.served_rounds,
                        result,
                        bar,
                    )
                )
            finally:
                server.stop()
    load_end = os.getloadavg()
    rows = []
    for name, r in results.items():
        rows.append(
            [name]
            + [
                f"{median(r.ttft_ms[w]):,.0f} ({int(statistics.median(r.prompt_tokens[w]))})"
                for w in (words[n] for n in lengths)
            ]
            + [f"{median(r.decode_tok_s):.1f}", f"{r.cached_tokens}"]
        )
    mine, vllm = results["kvchat"], results["vllm"]
    goals = []
    for n in (512, 2000):
        ratio = median(mine.ttft_ms[words[n]]) / median(vllm.ttft_ms[words[n]])
        goals.append(
            [
                f"TTFT at ~{n:,}-token prompts, kvchat / vLLM",
                f"{ratio:.2f}x",
                "<= 1.0x",
                "met" if ratio <= 1.0 else "missed",
            ]
        )
    ratio = median(mine.decode_tok_s) / median(vllm.decode_tok_s)
    met = "met" if ratio >= 1.5 else "missed"
    goals.append(["decode tok/s, kvchat / vLLM", f"{ratio:.2f}x", ">= 1.5x", met])
    header = machine_header(
        "Served, one stream: kvchat serve, vLLM and llama-server",
        {
            "model": f"{model_dir.name}, {args.served_dtype} weights in every server",
            "vllm": f"{vllm_server.PACKAGE} {vllm_server.VERSION}, OpenAI server, prefix caching",
            "requests": f"one at a time, streamed Chat Completions; fresh prompts of about "
            f"{', '.join(f'{n:,}' for n in lengths)} tokens, {SERVED_NEW_TOKENS} greedy tokens "
            f"(ignore_eos); medians of {args.served_rounds} requests each; a fresh server each",
            "command": "python bench/peers.py --served",
        },
        started=started,
        load_start=load_start,
        load_end=load_end,
    ).replace("# Served", "## Served", 1)
    table = markdown_table(
        ["server"]
        + [f"TTFT ~{n:,} tokens, ms (prompt tokens)" for n in lengths]
        + ["decode tok/s", "prompt tokens cached"],
        rows,
    )
    return (
        SERVED_BEGIN
        + "\n"
        + header
        + "\n"
        + table
        + "\n"
        + markdown_table(["measure", "measured", "goal", ""], goals)
        + SERVED_END
    )


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def build_report(
    args: argparse.Namespace,
    model_dir: Path,
    timings: dict[str, Timings],
    kvchat: dict[str, KVChatRunner],
    checks: list[list[object]],
    num_checked: int,
    bandwidth: float,
    version: str,
    splits: dict[str, list[tuple[float, float, float]]],
    when: tuple[tuple[float, float, float], tuple[float, float, float], time.struct_time],
) -> str:
    from kvchat.inference.model.config import ModelConfig
    from kvchat.kernels.cpu_ops import cpu_flags, cpu_model

    config = ModelConfig.from_dir(model_dir)
    params = config.num_parameters
    embed = config.vocab_size * config.hidden_size
    # Read per decode step: every weight once (the tied embedding as lm_head), one row of the
    # embedding, and the KV of the context (mean context of the decode steps).
    context = args.prompt_tokens + args.new_tokens // 2
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim

    def floor_s(elem_bytes: int) -> float:
        return (params * elem_bytes + kv_per_token * elem_bytes * context) / bandwidth

    elem = {"float32": 4, "f32": 4}
    rows = []
    for name, t in timings.items():
        e = elem.get(name.split()[-1], 2)
        step = median(t.decode_step_s)
        prefill = median(t.prefill_s)
        rows.append(
            [
                name,
                f"{step * 1e3:.1f}",
                f"{1 / step:.1f}",
                f"{floor_s(e) / step:.2f}",
                f"{args.prompt_tokens / prefill:.0f}",
                f"{floor_s(e) / prefill:.2f}",
                f"{args.new_tokens / median(t.request_s):.1f}",
            ]
        )

    def paired(name: str, peer: str, field: str) -> list[float]:
        """kvchat's speed over the peer's in each round: the peer's time over kvchat's, both
        run on the round's prompt one after the other."""
        mine, theirs = getattr(timings[name], field), getattr(timings[peer], field)
        return [p / k for k, p in zip(mine, theirs, strict=True)]

    def goal(measure: str, name: str, peer: str, field: str, target: float) -> list[str]:
        ratios = paired(name, peer, field)
        return [
            measure,
            f"{median(ratios):.2f}x",
            f"{min(ratios):.2f}-{max(ratios):.2f}x",
            f">= {target:.1f}x",
        ]

    half = f"kvchat {args.half}"
    same = "llama.cpp bf16" if args.half == "bfloat16" else "llama.cpp f16"
    goals = [
        goal(
            "f32 decode tok/s, kvchat / llama.cpp f32",
            "kvchat float32",
            "llama.cpp f32",
            "decode_step_s",
            0.9,
        ),
        goal(
            "f32 prompt tok/s, kvchat / llama.cpp f32",
            "kvchat float32",
            "llama.cpp f32",
            "prefill_s",
            1.0,
        ),
    ]
    for peer in ("llama.cpp f16", "llama.cpp bf16"):
        mark = " (same type)" if peer == same else ""
        goals += [
            goal(f"half decode tok/s, {half} / {peer}{mark}", half, peer, "decode_step_s", 0.9),
            goal(f"half prompt tok/s, {half} / {peer}{mark}", half, peer, "prefill_s", 1.0),
        ]

    load_start, load_end, started = when
    flags = set(cpu_flags().split())
    isa = " ".join(
        f
        for f in (
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512_bf16",
            "avx512_fp16",
            "avx512_vnni",
            "amx_tile",
            "amx_bf16",
        )
        if f in flags
    )
    settings: dict[str, object] = {
        "CPU": f"{cpu_vendor()} {cpu_model()}; ISA: {isa}",
        "model": f"bench preset, {params / 1e6:.1f}M parameters ({embed / 1e6:.1f}M of them the "
        f"tied embedding / lm_head), weights stored in bfloat16",
        "llama.cpp": f"{PEERS_PACKAGE} {version}, GGUF from its convert_hf_to_gguf.py, KV cache "
        f"in the weights' type, {args.threads} threads",
        "workload": f"{args.prompt_tokens}-token prompt + {args.new_tokens} greedy tokens, "
        f"{args.rounds} rounds, a fresh prompt each round, variants interleaved",
        "command": "python bench/peers.py",
    }
    for dtype, runner in kvchat.items():
        settings[f"kvchat {dtype} linear paths"] = runner.engine.model.linear_plan.summary()
    report = machine_header(
        "Peers: kvchat vs llama.cpp (same weights, same run)",
        settings,
        started=started,
        load_start=load_start,
        load_end=load_end,
    )
    report += (
        "\n## Checks before timing\n\n"
        f"Side tokenizer.json equals kvchat's tokenizer on {num_checked} tokens of test text; "
        "llama.cpp reads it as its `dbrx` (cl100k) pre-tokenizer. Logits on a 40-token prompt "
        "and the 8 tokens transformers picks after it, against transformers float32, each row "
        "computed on transformers' tokens before it (kvchat float32 also decodes the 8 "
        "freely and must pick them):\n\n"
        + markdown_table(
            ["engine", "max |logit - transformers f32|", "greedy = transformers"], checks
        )
    )
    report += (
        f"\n## One sequence\n\nMedians over {args.rounds} rounds. Floor: bytes read per decode "
        f"step (every weight once, plus the KV of a {context}-token context) / "
        f"{bandwidth / 1e9:.1f} GB/s (best measured copy bandwidth of the run); floor share "
        "= floor / measured time (1.0 = at the floor; prefill is compute-bound, its share is "
        "the same floor over the whole prompt's time).\n\n"
        + markdown_table(
            [
                "variant",
                "decode ms/token",
                "decode tok/s",
                "decode floor share",
                "prompt tok/s",
                "prompt floor share",
                "request tok/s (generated)",
            ],
            rows,
        )
    )
    report += (
        "\n## Goals\n\nEach ratio is the median of the rounds' own ratios: a round runs every "
        "variant on its prompt one after another, so each round's ratio compares them under "
        "one state of this shared machine; the range is the lowest and highest round.\n\n"
        + markdown_table(["measure", "measured (median)", "rounds' range", "goal"], goals)
    )
    memory_rows = []
    for dtype in kvchat:
        m = resident_memory(model_dir, dtype)
        memory_rows.append(
            [
                f"kvchat {dtype}",
                f"{m['weights'] / 2**20:.0f}",
                f"{m['model'] / 2**20:.0f}",
                f"{m['model'] / m['weights']:.2f}",
                f"{m['engine'] / 2**20:.0f}",
                f"{m['engine'] / m['weights']:.2f}",
            ]
        )
    report += (
        "\n## Resident memory\n\nWhat building the model (its weights as the layers hold them) "
        "and a whole engine (the model plus the tokenizer, grammar tables and kernels; its KV "
        "pool left out) add to a fresh process's resident set, against the bytes of the "
        "weights (the tied embedding counted once); one copy of the weights is a ratio of "
        "about 1:\n\n"
        + markdown_table(
            [
                "engine",
                "weights MiB",
                "model resident MiB",
                "model / weights",
                "engine resident MiB",
                "engine / weights",
            ],
            memory_rows,
        )
    )
    split_rows = []
    for dtype, triples in splits.items():
        step = median([s for s, _, _ in triples])
        linear = median([lin for _, lin, _ in triples])
        peer = "llama.cpp f32" if dtype == "float32" else same
        peer_step = median([p for _, _, p in triples])
        split_rows.append(
            [
                f"kvchat {dtype}",
                f"{step * 1e3:.1f}",
                f"{linear * 1e3:.1f}",
                f"{(step - linear) * 1e3:.1f}",
                f"{peer}: {peer_step * 1e3:.1f}",
            ]
        )
    report += (
        "\n## Where the decode step goes\n\n"
        "kvchat's single-sequence step split into the time inside its linear layers (the "
        "weight stream: every weight read once) and everything else (norms, RoPE, the paged "
        "attention's gather and SDPA, cache write, sampling, Python), beside llama.cpp's whole "
        "step on the same prompt; medians of 5 interleaved rounds:\n\n"
        + markdown_table(
            [
                "variant",
                "step ms",
                "in linear layers ms",
                "everything else ms",
                "llama.cpp step ms",
            ],
            split_rows,
        )
    )
    report += (
        "\nServing many requests at once, against llama.cpp's own server: "
        "bench/results/peers_serving.md (python bench/peers_serving.py). Where the time "
        "of a decode step goes: bench/results/decode_profile.md.\n"
    )
    return report


def cpu_vendor() -> str:
    from kvchat.kernels.cpu_ops import cpuinfo_field

    return cpuinfo_field("vendor_id") or "unknown vendor"


def plot(timings: dict[str, Timings], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(timings)
    colors = ["#2a7ab9" if n.startswith("kvchat") else "#999999" for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    decode = [1 / median(timings[n].decode_step_s) for n in names]
    prompt = [args.prompt_tokens / median(timings[n].prefill_s) for n in names]
    for ax, values, label in ((axes[0], decode, "decode tok/s"), (axes[1], prompt, "prompt tok/s")):
        bars = ax.barh(names, values, color=colors)
        ax.bar_label(bars, fmt="%.0f", padding=3)
        ax.set_xlabel(f"{label} (higher is better)")
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.25)
    axes[1].set_yticklabels([])
    fig.suptitle("bench model on CPU, one sequence: kvchat vs llama.cpp, same weights")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
