"""Fixtures of the service's tests: the dev model, a Postgres database per run, the app."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import URL

from kvchat.app.store import upgrade
from kvchat_testing.app_service import Service, service_settings
from kvchat_testing.service import create_postgres_database, drop_postgres_database, postgres_url


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


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def service(
    request: pytest.FixtureRequest, dev_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    from kvchat.app.main import create_app

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
