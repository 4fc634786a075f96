"""Helpers of the service tests: a fresh Postgres database per run, the app in process, and
the real server as a process on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ADMIN_POSTGRES = os.environ.get(
    "KVCHAT_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
KEY_LINE = re.compile(r"created an admin API key \(shown once, keep it\): (\S+)")


async def _admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(ADMIN_POSTGRES)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A database of its own (random name) on this machine's Postgres, dropped after."""
    name = f"kvchat_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    base = ADMIN_POSTGRES.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    try:
        yield f"{base}/{name}"
    finally:
        asyncio.run(_admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{name}' AND pid <> pg_backend_pid()"
        ))
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}"'))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """`kvchat serve` as a real process."""

    model: Path
    data_dir: Path
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[str] | None = None
    key: str | None = None
    output: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> Server:
        env = {
            **os.environ, "KVCHAT_DATA_DIR": str(self.data_dir), "PYTHONUNBUFFERED": "1",
            "KVCHAT_KV_CACHE_BYTES": str(64 * 2**20), "KVCHAT_HOST_CACHE_BYTES": str(32 * 2**20),
            **self.env,
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--model", str(self.model),
             "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        deadline = time.monotonic() + timeout
        import threading

        def read() -> None:
            assert self.process is not None and self.process.stdout is not None
            for line in self.process.stdout:
                self.output.append(line)
                match = KEY_LINE.search(line)
                if match:
                    self.key = match.group(1)

        threading.Thread(target=read, daemon=True).start()
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(self.output))
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become ready:\n" + "".join(self.output))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def headers(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.key}"}
