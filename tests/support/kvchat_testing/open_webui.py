"""Open WebUI as a real process in front of a started `kvchat serve`, for the tests that drive
its own page.

Open WebUI is installed from PyPI into a virtual environment of its own, once per machine, in
$KVCHAT_TEST_CACHE (default ~/.cache/kvchat/tests)/open-webui-<version>. It depends on torch
(sentence-transformers, accelerate), so the pinned torch the project builds with goes in first:
a bare `torch` requirement would pull a multi-GB CUDA build. The venv is built beside its final
place under a file lock and renamed into place when complete, so a killed install is never
half-used; everything in it is run as `<venv>/bin/python -m/-c ...`, never through its console
scripts, whose shebangs name the folder the venv was built in.

The process runs offline: no embedding model, no update check, no telemetry, no Ollama; its one
OpenAI connection is the kvchat server with its admin key."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from filelock import FileLock

from kvchat_testing.real_model import cache_dir
from kvchat_testing.service import free_port

VERSION = "0.12.4"
# What a `kvchat serve` of SmolLM2-135M-Instruct needs to hold Open WebUI's prompts: its
# built-in tools alone render to ~2,600 tokens, and float32 KV is 45 KiB a token (the test
# servers' 64 MiB hold 1,456).
KVCHAT_ENV = {
    "KVCHAT_KV_CACHE_BYTES": str(768 * 2**20),
    "KVCHAT_HOST_CACHE_BYTES": str(256 * 2**20),
}
# The torch the project itself pins (Makefile's TORCH_SPEC): pip takes its CPU build.
TORCH_SPEC = "torch==2.13.0"


def open_webui_python() -> Path:
    """The interpreter of a venv holding open-webui==VERSION, installed on first use
    (several minutes, ~3 GB)."""
    venv = cache_dir() / f"open-webui-{VERSION}"
    python = venv / "bin" / "python"
    with FileLock(str(cache_dir() / f"open-webui-{VERSION}.lock")):
        if not python.exists():
            _install(venv)
    return python


def _install(venv: Path) -> None:
    building = Path(tempfile.mkdtemp(prefix=f"{venv.name}.building-", dir=venv.parent))
    log = venv.parent / f"{venv.name}.install.log"
    try:
        # From the base interpreter: a venv whose `home` were the kvchat venv would break
        # when that venv is rebuilt.
        base = getattr(sys, "_base_executable", sys.executable)
        pip = [str(building / "bin" / "python"), "-m", "pip", "install", "--progress-bar=off"]
        with log.open("w") as out:
            for step in (
                [base, "-m", "venv", "--clear", str(building)],
                [*pip, "--upgrade", "pip"],
                [*pip, TORCH_SPEC],
                [*pip, f"open-webui=={VERSION}", TORCH_SPEC],
            ):
                out.write(f"$ {' '.join(step)}\n")
                out.flush()
                done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT)
                if done.returncode != 0:
                    tail = log.read_text().splitlines()[-40:]
                    raise RuntimeError(
                        f"installing open-webui=={VERSION} failed ({log}):\n" + "\n".join(tail)
                    )
        building.rename(venv)
    finally:
        shutil.rmtree(building, ignore_errors=True)


@dataclass
class OpenWebUI:
    """`open-webui serve` as a real process whose one OpenAI connection is `openai_url`
    (`http://host:port/v1`) with `api_key`. `env` adds to or overrides its settings."""

    openai_url: str
    api_key: str
    data_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[str] | None = None
    output: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.data_dir),
            "PYTHONUNBUFFERED": "1",
            "DATA_DIR": str(self.data_dir / "data"),
            # it empties and refills its static folder at start: one of its own, not the venv's
            "STATIC_DIR": str(self.data_dir / "static"),
            "WEBUI_SECRET_KEY": "kvchat-tests-open-webui-session-secret",
            "WEBUI_URL": self.url,
            "ENV": "prod",
            # offline: no hub downloads, no version check, no telemetry
            "OFFLINE_MODE": "true",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(self.data_dir / "hf"),
            "ENABLE_VERSION_UPDATE_CHECK": "false",
            "SCARF_NO_ANALYTICS": "true",
            "DO_NOT_TRACK": "true",
            "ANONYMIZED_TELEMETRY": "false",
            # no embedding model (none is loaded or fetched): documents go to the model whole
            "RAG_EMBEDDING_MODEL": "",
            "BYPASS_EMBEDDING_AND_RETRIEVAL": "true",
            "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false",
            "RAG_RERANKING_MODEL_AUTO_UPDATE": "false",
            "WHISPER_MODEL_AUTO_UPDATE": "false",
            # the one connection: no Ollama
            "ENABLE_OLLAMA_API": "false",
            "ENABLE_OPENAI_API": "true",
            "OPENAI_API_BASE_URLS": self.openai_url,
            "OPENAI_API_KEYS": self.api_key,
            **self.env,
        }

    def start(self, timeout: float = 300.0) -> OpenWebUI:
        python = open_webui_python()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            # `open-webui serve`, through the interpreter (see the module's docstring)
            [str(python), "-c", "import open_webui; open_webui.app()", "serve"]
            + ["--host", "127.0.0.1", "--port", str(self.port)],
            cwd=self.data_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.environment(),
            start_new_session=True,  # a process group of its own: stop() ends its children
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("open-webui exited:\n" + self.log_tail())
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("open-webui did not answer /health:\n" + self.log_tail())

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)

    def log_tail(self, lines: int = 80) -> str:
        return "".join(self.output[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to its process group, SIGKILL after `timeout`; also when the main process
        is gone already, so no child outlives it."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
