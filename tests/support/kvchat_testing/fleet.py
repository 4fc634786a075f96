"""A fleet's configuration for tests, a client of its API, and its metrics."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvchat.app.fleet import FleetConfig

REDIS = "redis://127.0.0.1:6379/0"


# Small pools; one torch thread per replica (three replicas share this machine's cores).
REPLICA_ENV = {
    "KVCHAT_KV_CACHE_BYTES": str(64 * 2**20),
    "KVCHAT_HOST_CACHE_BYTES": str(32 * 2**20),
    "KVCHAT_SEED": "0",
    "KVCHAT_DRAIN_TIMEOUT": "60",
    "KVCHAT_LOG_LEVEL": "warning",
    "OMP_NUM_THREADS": "1",
}


CHECK_INTERVAL_MS = 200  # HAProxy's checks: a replica leaves and rejoins within a second


def fleet_config(model: Path, database_url: str, run_dir: Path, **fields: Any) -> FleetConfig:
    return FleetConfig(
        model=model,
        database_url=database_url,
        redis_url=REDIS,
        run_dir=run_dir,
        redis_prefix=f"kvchat-test-{uuid.uuid4().hex[:10]}:",
        check_interval_ms=CHECK_INTERVAL_MS,
        replica_env={**REPLICA_ENV, **fields.pop("replica_env", {})},
        **fields,
    )


@dataclass
class Api:
    """A REST client of the fleet (through HAProxy, or one replica directly)."""

    base_url: str
    key: str

    def __post_init__(self) -> None:
        self.http = httpx.Client(
            base_url=self.base_url, timeout=120, headers={"Authorization": f"Bearer {self.key}"}
        )

    def new_conversation(self, **fields: Any) -> str:
        r = self.http.post("/v1/conversations", json=fields)
        assert r.status_code == 200, r.text
        return str(r.json()["id"])

    def turn(self, conv: str, content: str, **fields: Any) -> Served:
        r = self.http.post(
            f"/v1/conversations/{conv}/messages",
            json={"content": content, "max_tokens": 6, "temperature": 0, **fields},
        )
        assert r.status_code == 200, r.text
        return Served(r.json(), r.headers["x-kvchat-replica"], r.headers.get("x-kvchat-route"))

    def messages(self, conv: str, **params: Any) -> list[dict[str, Any]]:
        r = self.http.get(f"/v1/conversations/{conv}/messages", params=params)
        assert r.status_code == 200, r.text
        return r.json()["data"]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Served:
    """A response's body and the replica (and HAProxy's routing rule) that served it."""

    body: dict[str, Any]
    replica: str
    route: str | None

    @property
    def usage(self) -> dict[str, Any]:
        return self.body["usage"]  # type: ignore[no-any-return]


def metric(text: str, name: str) -> float:
    """One sample's value from a Prometheus exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Until `predicate()` is truthy (what a turn does after its reply was sent: the session
    pinned, the lease taken); the deadline is a safety net, never a timing assertion."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)
