"""Real databases for the store's tests: a SQLite file per test and a Postgres database per run.

Postgres is the server at 127.0.0.1:5432 (user postgres), or KVCHAT_TEST_POSTGRES_URL for
the admin connection. Nothing is skipped: if it does not answer, these tests fail.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import bindparam, text
from sqlalchemy.engine import URL

from kvchat.app.store import Store, upgrade
from kvchat.app.store.column_types import UTCDateTime
from kvchat.app.store.database import create_engine, database_url

TABLES = ("summaries", "messages", "conversations", "api_keys")


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file that tests copy (cheaper than migrating each one)."""
    path = tmp_path_factory.mktemp("sqlite_template") / "kvchat.db"
    asyncio.run(upgrade(f"sqlite+aiosqlite:///{path}"))
    assert not Path(f"{path}-wal").exists(), "the template's WAL was not checkpointed"
    return path


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> URL:
    """An empty, migrated database: a copied SQLite file, or the run's Postgres database
    with its tables emptied."""
    if request.param == "sqlite":
        path = tmp_path / "kvchat.db"
        shutil.copy(request.getfixturevalue("migrated_sqlite"), path)
        return database_url(f"sqlite:///{path}")
    url: URL = request.getfixturevalue("migrated_postgres")
    asyncio.run(execute(url, f"TRUNCATE {', '.join(TABLES)}"))
    return url


@pytest.fixture
async def store(database: URL) -> AsyncIterator[Store]:
    store = await Store.open(database)
    try:
        yield store
    finally:
        await store.close()


async def execute(url: URL, sql: str, **params: Any) -> list[dict[str, Any]]:
    """Run raw SQL on the database at url through its own engine; rows as dicts. Datetime
    parameters are bound as the store binds them."""
    statement = text(sql).bindparams(
        *(
            bindparam(name, value, type_=UTCDateTime())
            for name, value in params.items()
            if isinstance(value, datetime)
        )
    )
    plain = {name: value for name, value in params.items() if not isinstance(value, datetime)}
    engine = create_engine(url)
    try:
        async with engine.begin() as connection:
            result = await connection.execute(statement, plain)
            return [dict(row._mapping) for row in result] if result.returns_rows else []
    finally:
        await engine.dispose()


@pytest.fixture
def run_sql() -> Callable[..., Any]:
    """execute(url, sql, **params): raw SQL beside the store, to check what it wrote."""
    return execute
