"""Migrations and opening: up from empty, `alembic check` clean, unmigrated Postgres refused,
SQLite migrating itself, URLs and unreachable databases answered in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Connection, inspect
from sqlalchemy.engine import URL

from kvchat.app.store import (
    DatabaseUnreachable,
    InvalidDatabaseUrl,
    SchemaNotCurrent,
    Store,
    default_database_url,
    upgrade,
)
from kvchat.app.store.database import create_engine, database_url
from kvchat.app.store.schema import alembic_config, head_revision
from kvchat.app.store.tables import Base

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[3]


async def _alembic(url: URL, run: Callable[..., Any], *args: Any) -> Any:
    """Run an Alembic command on url's database through the store's own engine setup."""
    config = alembic_config()
    engine = create_engine(url)

    def call(connection: Connection) -> Any:
        config.attributes["connection"] = connection
        return run(config, *args)

    try:
        async with engine.begin() as connection:
            return await connection.run_sync(call)
    finally:
        await engine.dispose()


async def _tables(url: URL) -> set[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            return set(await connection.run_sync(lambda c: inspect(c).get_table_names()))
    finally:
        await engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> URL:
    if request.param == "sqlite":
        return database_url(f"sqlite:///{tmp_path / 'empty.db'}")
    url: URL = request.getfixturevalue("empty_postgres")
    return url


async def test_migrations_run_up_from_empty_and_match_the_models(empty_database: URL) -> None:
    assert await _tables(empty_database) == set()
    await upgrade(empty_database)
    assert await _tables(empty_database) == {*Base.metadata.tables, "alembic_version"}
    await _alembic(empty_database, command.check)  # raises on any pending autogenerate diff

    await _alembic(empty_database, command.downgrade, "base")
    assert await _tables(empty_database) == {"alembic_version"}
    await upgrade(empty_database)
    async with await Store.open(empty_database, migrate=False) as store:
        assert await store.schema_status() == (head_revision(), head_revision())


def test_the_alembic_command_line_finds_everything_from_another_directory(
    migrated_postgres: URL, tmp_path: Path
) -> None:
    env = {**os.environ, "KVCHAT_DATABASE_URL": migrated_postgres.render_as_string(False)}
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "alembic", "-c", str(REPO / "alembic.ini"), "check"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "No new upgrade operations detected" in proc.stdout + proc.stderr


async def test_store_refuses_an_unmigrated_postgres_in_one_line_then_opens_after_upgrade(
    empty_postgres: URL, run_sql: Callable[..., Any]
) -> None:
    url = empty_postgres.set(password="sekret")  # trust auth ignores it
    with pytest.raises(SchemaNotCurrent) as refused:
        await Store.open(url)
    message = str(refused.value)
    assert "\n" not in message and "sekret" not in message
    assert "`kvchat db upgrade`" in message and f"/{url.database}" in message
    assert await _tables(url) == set()  # nothing created behind the operator's back

    await run_sql(url, "CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)")
    await run_sql(url, "INSERT INTO alembic_version VALUES ('abc123')")
    with pytest.raises(SchemaNotCurrent, match=r"abc123.*newer kvchat"):
        await Store.open(url)
    await run_sql(url, "DROP TABLE alembic_version")

    await upgrade(url)
    async with await Store.open(url) as store:
        assert await store.schema_status() == (head_revision(), head_revision())
        assert await store.ping()


async def test_sqlite_creates_its_directory_and_migrates_itself(tmp_path: Path) -> None:
    path = tmp_path / "data" / "nested" / "kvchat.db"
    with pytest.raises(SchemaNotCurrent, match="kvchat db upgrade"):
        await Store.open(f"sqlite+aiosqlite:///{path}", migrate=False)
    async with await Store.open(f"sqlite+aiosqlite:///{path}") as store:
        assert await store.schema_status() == (head_revision(), head_revision())
        conversation = await store.create_conversation("alice")
    async with await Store.open(f"sqlite:///{path}") as store:  # reopened: nothing to do
        assert await store.get_conversation("alice", conversation.id) == conversation
    engine = create_engine(database_url(f"sqlite:///{path}"))
    async with engine.connect() as connection:
        mode = (await connection.exec_driver_sql("PRAGMA journal_mode")).scalar()
    await engine.dispose()
    assert mode == "wal"


def test_urls_get_async_drivers_and_bad_ones_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert database_url("postgresql://u:p@h/db").drivername == "postgresql+asyncpg"
    assert database_url("postgres://u@h/db").drivername == "postgresql+asyncpg"
    assert database_url("sqlite:///x.db").drivername == "sqlite+aiosqlite"
    for bad, why in (
        ("not a url", "does not parse"),
        ("mysql://u:secret@h/db", "unsupported database"),
        ("postgresql+psycopg2://u:secret@h/db", "not async"),
        ("sqlite://", "in-memory"),
        ("sqlite+aiosqlite:///:memory:", "in-memory"),
    ):
        with pytest.raises(InvalidDatabaseUrl, match=why) as refused:
            database_url(bad)
        assert "secret" not in str(refused.value) and "\n" not in str(refused.value)

    monkeypatch.delenv("KVCHAT_DATA_DIR", raising=False)
    assert default_database_url() == "sqlite+aiosqlite:///data/kvchat.db"
    monkeypatch.setenv("KVCHAT_DATA_DIR", "/srv/kvchat")
    assert default_database_url() == "sqlite+aiosqlite:////srv/kvchat/kvchat.db"
    assert default_database_url("rel/dir") == "sqlite+aiosqlite:///rel/dir/kvchat.db"


async def test_an_unreachable_database_is_one_line_and_ping_says_false() -> None:
    url = "postgresql://postgres:sekret@127.0.0.1:1/kvchat"
    with pytest.raises(DatabaseUnreachable) as refused:
        await Store.open(url)
    message = str(refused.value)
    assert "\n" not in message and "sekret" not in message and "127.0.0.1:1" in message
    with pytest.raises(DatabaseUnreachable):
        await upgrade(url)
    store = Store(create_engine(database_url(url)), database_url(url))
    assert await store.ping() is False
    await store.close()
