"""Fixtures of the service's tests: the dev model, a Postgres database per run, the app."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import URL

from app.store import upgrade
from tests.service import create_postgres_database, drop_postgres_database, postgres_url


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def migrated_postgres() -> Iterator[URL]:
    """One migrated Postgres database for this test run (per xdist worker)."""
    name = create_postgres_database()
    try:
        asyncio.run(upgrade(postgres_url(name)))
        yield postgres_url(name)
    finally:
        drop_postgres_database(name)


@pytest.fixture
def empty_postgres() -> Iterator[URL]:
    """A new, empty Postgres database, dropped after the test."""
    name = create_postgres_database()
    try:
        yield postgres_url(name)
    finally:
        drop_postgres_database(name)


@pytest.fixture(scope="session")
def dev_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dev preset (cl100k tokenizer, ChatML), as `make serve` creates it."""
    from inference.dev_model import init_model

    path = tmp_path_factory.mktemp("models") / "dev"
    init_model(path, "dev", seed=0)
    return path


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
        return self.client.post(path, json=body, headers={**self.headers(key),
                                                           **kw.pop("headers", {})}, **kw)

    def get(self, path: str, key: str | None = None, **kw: Any) -> Any:
        return self.client.get(path, headers=self.headers(key), **kw)

    @property
    def model(self) -> str:
        return str(self.state.runtime.model_name)


def service_settings(model: Path, data_dir: Path, database_url: str | None) -> Any:
    from app.settings import Settings

    return Settings(
        model=model, data_dir=data_dir, database_url=database_url,
        kv_cache_bytes=48 * 2**20, host_cache_bytes=16 * 2**20, max_num_batched_tokens=256,
        seed=0, drain_timeout=2.0,
    )


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def service(
    request: pytest.FixtureRequest, dev_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    from app.main import create_app

    data_dir = tmp_path_factory.mktemp("data")
    url = None
    if request.param == "postgres":
        url = request.getfixturevalue("migrated_postgres").render_as_string(hide_password=False)
    app = create_app(service_settings(dev_model, data_dir, url))
    with TestClient(app) as client:
        state = app.state.kvchat
        _, alice = client.portal.call(lambda: state.store.create_key("alice"))
        _, bob = client.portal.call(lambda: state.store.create_key("bob"))
        yield Service(client, state, alice, bob, request.param)
