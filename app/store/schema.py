"""The schema's version: Alembic's migrations run programmatically, and where a database is."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kvchat.app.store.database import SQLITE_BEGIN, create_engine, database_url, display_url
from kvchat.app.store.errors import CONNECT_ERRORS, SchemaNotCurrent, unreachable

UPGRADE_COMMAND = "kvchat db upgrade"


def migrations_dir() -> Path:
    """The `migrations` package's directory, a sibling of `app` in a checkout (editable
    install) and in site-packages alike. Located by path rather than imported, so a venv
    whose editable install predates the package still finds it, from any working directory."""
    return Path(__file__).resolve().parents[2] / "migrations"


def alembic_config() -> Config:
    """An Alembic config without alembic.ini: the script location from the package. The
    caller passes env.py a connection in `attributes["connection"]`."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    return config


@cache
def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the migrations have no head revision"
    return head


def known_revisions() -> set[str]:
    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


async def current_revision(connection: AsyncConnection) -> str | None:
    def read(sync: Connection) -> str | None:
        return MigrationContext.configure(sync).get_current_revision()

    return await connection.run_sync(read)


async def upgrade_engine(engine: AsyncEngine) -> None:
    """Migrate the database behind engine to head, in one transaction."""
    config = alembic_config()

    def run(sync: Connection) -> None:
        config.attributes["connection"] = sync
        command.upgrade(config, "head")

    options = {SQLITE_BEGIN: "IMMEDIATE"}
    async with engine.execution_options(**options).begin() as connection:
        try:
            await connection.run_sync(run)
        except CommandError as e:
            # e.g. a database at a revision newer than this kvchat knows.
            raise SchemaNotCurrent(
                f"cannot migrate the database at {display_url(engine.url)}: {e}"
            ) from None


async def upgrade(url: str | URL) -> None:
    """Run the migrations to head (`kvchat db upgrade`)."""
    parsed = database_url(url)
    engine = create_engine(parsed)
    try:
        await upgrade_engine(engine)
    except CONNECT_ERRORS as e:
        raise unreachable(display_url(parsed), e) from None
    finally:
        await engine.dispose()


async def database_revision(url: str | URL) -> str | None:
    """The revision the database at url is at (None: no schema), without changing it."""
    parsed = database_url(url)
    engine = create_engine(parsed)
    try:
        async with engine.connect() as connection:
            return await current_revision(connection)
    except CONNECT_ERRORS as e:
        raise unreachable(display_url(parsed), e) from None
    finally:
        await engine.dispose()


def check_current(url: URL, current: str | None) -> None:
    """Raise SchemaNotCurrent unless current is the head revision."""
    head = head_revision()
    if current == head:
        return
    where = f"the database at {display_url(url)}"
    if current is None:
        message = f"{where} has no kvchat schema (head is {head}); run `{UPGRADE_COMMAND}`"
    elif current not in known_revisions():
        message = (
            f"{where} is at revision {current}, which this kvchat does not know (head is "
            f"{head}); it was migrated by a newer kvchat"
        )
    else:
        message = (
            f"{where} is not migrated (at revision {current}, head is {head}); "
            f"run `{UPGRADE_COMMAND}`"
        )
    raise SchemaNotCurrent(message)
