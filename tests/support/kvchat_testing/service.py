"""Helpers of the service tests: a fresh Postgres database per run, the app in process, and
the real server as a process on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from sqlalchemy.engine import URL, make_url

KEY_LINE = re.compile(r"created an admin API key \(shown once, keep it\): (\S+)")

ADMIN_URL = os.environ.get(
    "KVCHAT_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)


def postgres_url(name: str) -> URL:
    """The URL of database `name` on the admin URL's server (asyncpg driver)."""
    return make_url(ADMIN_URL).set(drivername="postgresql+asyncpg", database=name)


async def _admin(*statements: str, args: tuple[Any, ...] = ()) -> None:
    dsn = make_url(ADMIN_URL).set(drivername="postgresql")
    connection = await asyncpg.connect(dsn.render_as_string(hide_password=False), timeout=10)
    try:
        for statement in statements:
            await connection.execute(statement, *args)
    finally:
        await connection.close()


def create_postgres_database() -> str:
    name = f"kvchat_test_{secrets.token_hex(6)}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    return name


def drop_postgres_database(name: str) -> None:
    async def drop() -> None:
        await _admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid()",
            args=(name,),
        )
        await _admin(f'DROP DATABASE IF EXISTS "{name}"')

    asyncio.run(drop())


@contextlib.contextmanager
def postgres_database(migrated: bool = True) -> Iterator[str]:
    """A database of its own (random name) on this machine's Postgres, dropped after."""
    from kvchat.app.store import upgrade

    name = create_postgres_database()
    try:
        url = postgres_url(name)
        if migrated:
            asyncio.run(upgrade(url))
        yield url.render_as_string(hide_password=False)
    finally:
        drop_postgres_database(name)


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
            **os.environ,
            "KVCHAT_DATA_DIR": str(self.data_dir),
            "PYTHONUNBUFFERED": "1",
            "KVCHAT_KV_CACHE_BYTES": str(64 * 2**20),
            "KVCHAT_HOST_CACHE_BYTES": str(32 * 2**20),
            **self.env,
        }
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "kvchat.app.cli",
                "serve",
                "--model",
                str(self.model),
                "--port",
                str(self.port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
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
