"""Started servers for the attack suite: `kvchat serve` as a real process on SQLite, or on a
Postgres database of its own with a real Redis under a key prefix of its own; and the waits
the attacks share (on conditions, with generous safety deadlines, never on the clock)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from kvchat_testing.service import Server, postgres_database

REDIS_URL = "redis://127.0.0.1:6379/0"
BACKENDS = ("sqlite", "postgres+redis")
# The user property the schema fuzzing records (backend, requests sent) per operation.
REQUESTS_PROPERTY = "schemathesis_requests"

T = TypeVar("T")


def redis_prefix() -> str:
    """A Redis key prefix no other run shares (the shared Redis is never flushed)."""
    return f"kvchat-attack-{uuid.uuid4().hex[:12]}:"


def drop_redis_prefix(prefix: str) -> None:
    """Delete this run's keys (and only them) from the shared Redis."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        names = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if names:
            client.delete(*names)
    finally:
        client.close()


def database_of(server: Server) -> str:
    """The database URL the server runs on."""
    from kvchat.app.store import default_database_url

    return server.env.get("KVCHAT_DATABASE_URL") or default_database_url(server.data_dir)


def create_key(database_url: str, name: str, admin: bool = False, owner: str | None = None) -> str:
    """A new API key in the database (as `kvchat keys create` makes one)."""
    from kvchat.app.store import Store

    async def create() -> str:
        store = await Store.open(database_url)
        try:
            _, plaintext = await store.create_key(name, admin=admin, owner=owner)
            return plaintext
        finally:
            await store.close()

    return asyncio.run(create())


def revoke_key(database_url: str, name: str) -> None:
    """Revoke the key named `name` (as `kvchat keys revoke` does)."""
    from kvchat.app.store import Store

    async def revoke() -> None:
        store = await Store.open(database_url)
        try:
            assert await store.revoke_key(name) is not None, name
        finally:
            await store.close()

    asyncio.run(revoke())


@contextlib.contextmanager
def started_server(
    model: Path, data_dir: Path, backend: str, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """`kvchat serve` on `backend` (one of BACKENDS), with an admin key in `server.key`;
    stopped (SIGTERM) and its database and Redis keys dropped after."""
    assert backend in BACKENDS, backend
    env = dict(env or {})
    if backend == "sqlite":
        server = Server(model, data_dir, env=env).start()
        assert server.key is not None, "no key printed on first start:\n" + "".join(server.output)
        try:
            yield server
        finally:
            server.stop()
        return
    prefix = redis_prefix()
    with postgres_database() as url:
        key = create_key(url, "attack", admin=True)  # Postgres prints none on first start
        env.update(KVCHAT_DATABASE_URL=url, KVCHAT_REDIS_URL=REDIS_URL, KVCHAT_REDIS_PREFIX=prefix)
        server = Server(model, data_dir, env=env, key=key).start()
        try:
            yield server
        finally:
            server.stop()
            drop_redis_prefix(prefix)


def restarted(server: Server) -> Server:
    """The same server started again: same data directory, database, Redis prefix and key,
    a new port."""
    return Server(server.model, server.data_dir, env=server.env, key=server.key).start()


def wait_until(
    predicate: Callable[[], T | None], what: str, timeout: float = 60.0, interval: float = 0.05
) -> T:
    """Poll `predicate` until it returns something truthy; `timeout` is only a safety net
    against a hang, never the thing tested."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)


def memory(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/v1/admin/memory", headers=server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def idle_memory(server: Server, timeout: float = 120.0) -> dict[str, Any]:
    """`GET /v1/admin/memory` once no request runs, waits or is swapped out."""

    def idle() -> dict[str, Any] | None:
        report = memory(server)
        requests = report["requests"]
        busy = requests["running"] or requests["waiting"] or requests["swapped"]
        return None if busy else report

    return wait_until(idle, "the engine went idle", timeout)


def assert_openai_error(body: Any, context: str = "") -> dict[str, Any]:
    """`body` is OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    assert isinstance(body, dict) and set(body) == {"error"}, f"{context}: {body!r}"
    error = body["error"]
    assert isinstance(error, dict), f"{context}: {body!r}"
    assert set(error) == {"message", "type", "param", "code"}, f"{context}: {body!r}"
    assert isinstance(error["message"], str) and error["message"], f"{context}: {body!r}"
    assert isinstance(error["type"], str) and error["type"], f"{context}: {body!r}"
    assert error["param"] is None or isinstance(error["param"], str), f"{context}: {body!r}"
    assert error["code"] is None or isinstance(error["code"], str), f"{context}: {body!r}"
    return error


def open_fds(pid: int) -> int:
    """File descriptors the process holds (Linux /proc)."""
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def metric(server: Server, name: str) -> float:
    """One unlabelled sample of `/metrics`."""
    text = httpx.get(f"{server.url}/metrics", headers=server.headers(), timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
