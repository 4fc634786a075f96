"""The app in process (TestClient) with two keys, and the settings the service tests use."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient


@dataclass
class Service:
    """The app in process (TestClient runs its lifespan: store, engine thread, coordination)
    with two keys of different owners."""

    client: TestClient
    state: Any
    key: str  # owner "alice"
    other_key: str  # owner "bob"
    database: str

    def headers(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.key}"}

    def post(self, path: str, body: Any = None, key: str | None = None, **kw: Any) -> Any:
        return self.client.post(
            path, json=body, headers={**self.headers(key), **kw.pop("headers", {})}, **kw
        )

    def get(self, path: str, key: str | None = None, **kw: Any) -> Any:
        return self.client.get(path, headers=self.headers(key), **kw)

    @property
    def model(self) -> str:
        return str(self.state.runtime.model_name)


def service_settings(model: Path, data_dir: Path, database_url: str | None) -> Any:
    from kvchat.app.settings import Settings

    return Settings(
        model=model,
        data_dir=data_dir,
        database_url=database_url,
        kv_cache_bytes=48 * 2**20,
        host_cache_bytes=16 * 2**20,
        max_num_batched_tokens=256,
        seed=0,
        drain_timeout=2.0,
    )
