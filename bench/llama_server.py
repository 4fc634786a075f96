"""llama.cpp's own `llama-server`, built with CMake from the llama.cpp sources in the pinned
llama-cpp-python source distribution (the one bench/gguf_export.py takes its converter from),
cached by version and CPU flags, and started on a free loopback port.

    python bench/llama_server.py    # build it (about 10 minutes on 2 idle cores)
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx

from kvchat.bench.gguf_export import converter_dir
from kvchat.kernels.cpu_ops import cpu_flags

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"  # the pin of the [peers] extra in pyproject.toml
CACHE = Path(__file__).resolve().parent.parent / "models" / ".peers"


def source_dir(cache_dir: Path = CACHE, version: str = VERSION) -> Path:
    """vendor/llama.cpp of the source distribution, unpacked once."""
    root = cache_dir / f"llama.cpp-{version}"
    if (root / "CMakeLists.txt").is_file():
        return root
    converter_dir(cache_dir, PACKAGE, version)  # fetches the source distribution
    name = PACKAGE.replace("-", "_")
    sdist = next((cache_dir / "sdist").glob(f"{name}-{version}.tar.gz"))
    prefix = f"{name}-{version}/vendor/llama.cpp/"
    tmp = root.with_suffix(".partial")
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix) and (member.isfile() or member.isdir()):
                member.name = member.name[len(prefix) :]
                if member.name:
                    members.append(member)
        tar.extractall(tmp, members=members, filter="data")
    tmp.rename(root)
    return root


def server_binary(cache_dir: Path = CACHE, version: str = VERSION, jobs: int | None = None) -> Path:
    """The llama-server binary, built for this CPU (GGML_NATIVE) the first time."""
    key = hashlib.sha256(cpu_flags().encode()).hexdigest()[:12]
    build = cache_dir / f"llama-server-{version}-{key}"
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    src = source_dir(cache_dir, version)
    print(
        f"building llama-server {version} from {src} (once; ~10 min on 2 cores) ...",
        file=sys.stderr,
    )
    subprocess.run(
        [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        [
            "cmake",
            "--build",
            str(build),
            "--target",
            "llama-server",
            "-j",
            str(jobs or os.cpu_count() or 2),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    if not binary.is_file():
        raise FileNotFoundError(f"the build left no {binary}")
    return binary


def cpu_args() -> list[str]:
    """llama-server arguments this CPU needs. With AMX, ggml's AMX matmul (its weights in an
    AMX buffer, a repacked layout) crashes at the first decode on some kernels (SIGSEGV in
    ggml_backend_amx_mul_mat, seen on a 2-core Xeon VM that lists amx_tile): --no-repack keeps
    the weights in their plain layout, on the AVX512 kernels."""
    return ["--no-repack"] if "amx_tile" in cpu_flags().split() else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    """Until GET url answers 200 (llama-server: /health once the model is loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Build (once) and print the llama-server binary.")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs")
    print(server_binary(jobs=ap.parse_args().jobs))
