"""Database URLs and engines: the default SQLite file, the async drivers, SQLite's settings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from kvchat.app.store.errors import InvalidDatabaseUrl

# The async driver kvchat uses for each backend; a URL without one gets it.
ASYNC_DRIVERS = {"sqlite": "aiosqlite", "postgresql": "asyncpg"}
SQLITE_BUSY_TIMEOUT_S = 30.0
POSTGRES_CONNECT_TIMEOUT_S = 10.0
# Execution option read when a transaction begins on SQLite: "IMMEDIATE" takes the write lock
# up front, so a transaction that reads and then writes waits for other writers (busy
# timeout) instead of failing with "database is locked" when it tries to upgrade its lock.
SQLITE_BEGIN = "kvchat_sqlite_begin"


def default_database_url(data_dir: str | os.PathLike[str] | None = None) -> str:
    """The embedded default: a SQLite file `kvchat.db` in data_dir (default: the
    KVCHAT_DATA_DIR environment variable, else ./data)."""
    if data_dir is None:
        data_dir = os.environ.get("KVCHAT_DATA_DIR") or "./data"
    return f"sqlite+aiosqlite:///{Path(data_dir) / 'kvchat.db'}"


def database_url(url: str | URL) -> URL:
    """Parse url and give it kvchat's async driver (`postgresql://` -> `postgresql+asyncpg://`,
    `postgres://` too; `sqlite://` -> `sqlite+aiosqlite://`)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        # Not echoed back: an unparseable URL may still hold a password.
        raise InvalidDatabaseUrl(
            "the database URL does not parse; expected e.g. sqlite+aiosqlite:///./data/kvchat.db "
            "or postgresql+asyncpg://user@host:5432/kvchat"
        ) from None
    backend, _, driver = parsed.drivername.partition("+")
    backend = "postgresql" if backend == "postgres" else backend
    if backend not in ASYNC_DRIVERS:
        raise InvalidDatabaseUrl(
            f"unsupported database {backend!r} in {display_url(parsed)}; "
            "kvchat runs on sqlite or postgresql"
        )
    if driver and driver != ASYNC_DRIVERS[backend]:
        raise InvalidDatabaseUrl(
            f"driver {driver!r} in {display_url(parsed)} is not async; use "
            f"{backend}+{ASYNC_DRIVERS[backend]}://"
        )
    parsed = parsed.set(drivername=f"{backend}+{ASYNC_DRIVERS[backend]}")
    if backend == "sqlite" and parsed.database in (None, "", ":memory:"):
        raise InvalidDatabaseUrl(
            f"{display_url(parsed)} is an in-memory database, which each connection sees "
            "empty; give a file, e.g. sqlite+aiosqlite:///./data/kvchat.db"
        )
    return parsed


def display_url(url: URL) -> str:
    """The URL without its password, for messages and logs."""
    without = URL.create(
        url.drivername, url.username, None, url.host, url.port, url.database, url.query
    )
    return without.render_as_string(hide_password=False)


def create_engine(url: URL) -> AsyncEngine:
    """An async engine for a URL from database_url(). SQLite files get WAL, a busy timeout,
    foreign keys (for ON DELETE CASCADE) and kvchat's own BEGIN (see SQLITE_BEGIN)."""
    if url.get_backend_name() != "sqlite":
        return create_async_engine(
            url, pool_pre_ping=True, connect_args={"timeout": POSTGRES_CONNECT_TIMEOUT_S}
        )
    if url.database:
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})
    event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
    event.listen(engine.sync_engine, "begin", _sqlite_on_begin)
    return engine


def _sqlite_on_connect(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    # dbapi_connection: the aiosqlite adapter, whose isolation_level DBAPI's protocol lacks.
    # The driver's own implicit BEGIN is turned off; _sqlite_on_begin emits ours.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
    cursor.close()


def _sqlite_on_begin(connection: Connection) -> None:
    mode = connection.get_execution_options().get(SQLITE_BEGIN, "DEFERRED")
    assert mode in ("DEFERRED", "IMMEDIATE"), mode
    connection.exec_driver_sql(f"BEGIN {mode}")
