"""`kvchat db` (the schema's migrations) and `kvchat keys` (API keys).

The database is --database-url, else KVCHAT_DATABASE_URL, else the embedded SQLite file
(app.store.default_database_url). A database that cannot be used is one `error:` line and
exit code 2.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

T = TypeVar("T")

db_app = typer.Typer(
    help="The service's database schema (Alembic migrations).", no_args_is_help=True
)
keys_app = typer.Typer(help="API keys: create (shown once), list, revoke.", no_args_is_help=True)

DatabaseUrlOption = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar="KVCHAT_DATABASE_URL",
        show_default=False,
        help="SQLAlchemy URL, e.g. postgresql://user@host:5432/kvchat "
        "[default: sqlite+aiosqlite:///$KVCHAT_DATA_DIR/kvchat.db, KVCHAT_DATA_DIR=./data]",
    ),
]


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def run(work: Coroutine[Any, Any, T]) -> T:
    """Run one command's coroutine; the store's errors (StoreError, and ValueError for a
    value it refuses) become one `error:` line."""
    from kvchat.app.store import StoreError

    try:
        return asyncio.run(work)
    except (StoreError, ValueError) as e:
        fail(str(e))


def parse(database_url: str | None) -> URL:
    """The option's URL (or the default), parsed, with kvchat's async driver."""
    from kvchat.app.store import StoreError, default_database_url
    from kvchat.app.store.database import database_url as parse_url

    try:
        return parse_url(database_url or default_database_url())
    except StoreError as e:
        fail(str(e))


def when(moment: datetime | None, absent: str = "") -> str:
    """A UTC time to the minute."""
    return absent if moment is None else moment.strftime("%Y-%m-%d %H:%M")


@db_app.command("upgrade")
def db_upgrade(database_url: DatabaseUrlOption = None) -> None:
    """Migrate the database to the newest schema (creates the tables in an empty one)."""
    from kvchat.app.store import display_url, upgrade
    from kvchat.app.store.schema import database_revision, head_revision

    url = parse(database_url)

    async def work() -> str | None:
        before = await database_revision(url)
        if before != head_revision():
            await upgrade(url)
        return before

    before = run(work())
    head = head_revision()
    if before == head:
        typer.echo(f"{display_url(url)} is already at the newest schema ({head})")
    else:
        typer.echo(f"upgraded {display_url(url)} from {before or 'an empty database'} to {head}")


@db_app.command("current")
def db_current(database_url: DatabaseUrlOption = None) -> None:
    """Print the database's schema revision and the newest one; exit code 1 when they differ."""
    from kvchat.app.store import display_url
    from kvchat.app.store.schema import UPGRADE_COMMAND, database_revision, head_revision

    url = parse(database_url)
    current = run(database_revision(url))
    head = head_revision()
    typer.echo(f"database: {display_url(url)}")
    typer.echo(f"revision: {current or 'none'} (newest: {head})")
    if current != head:
        typer.echo(f"not current: run `{UPGRADE_COMMAND}`", err=True)
        raise typer.Exit(1)


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Option(help="What the key is for, e.g. the agent's name.")],
    owner: Annotated[
        str | None,
        typer.Option(
            help="Whose conversations the key sees [default: the name].", show_default=False
        ),
    ] = None,
    admin: Annotated[bool, typer.Option(help="Allow the admin routes.")] = False,
    database_url: DatabaseUrlOption = None,
) -> None:
    """Create a key and print it once: the key alone on stdout, the rest on stderr."""
    from kvchat.app.store import KeyRecord, Store

    url = parse(database_url)

    async def work() -> tuple[KeyRecord, str]:
        async with await Store.open(url) as store:
            return await store.create_key(name, owner=owner, admin=admin)

    record, key = run(work())
    role = "admin" if record.is_admin else "not admin"
    typer.echo(
        f"created key {record.key_prefix} (name {record.name}, owner {record.owner}, {role})",
        err=True,
    )
    typer.echo(key)
    typer.echo("This key will not be shown again; store it now.", err=True)


@keys_app.command("list")
def keys_list(database_url: DatabaseUrlOption = None) -> None:
    """List the keys (never the keys themselves: their prefixes)."""
    from rich.console import Console
    from rich.table import Table

    from kvchat.app.store import KeyRecord, Store

    url = parse(database_url)

    async def work() -> list[KeyRecord]:
        async with await Store.open(url) as store:
            return await store.list_keys()

    records = run(work())
    if not records:
        typer.echo("no keys; create one with `kvchat keys create --name NAME`")
        return
    table = Table(
        "prefix",
        "name",
        "owner",
        "admin",
        "created",
        "last used",
        "revoked",
        caption="times in UTC",
    )
    for column in table.columns:
        column.no_wrap = column.header not in ("name", "owner")
    for r in records:
        table.add_row(
            r.key_prefix,
            r.name,
            r.owner,
            "yes" if r.is_admin else "",
            when(r.created_at),
            when(r.last_used_at, "never"),
            when(r.revoked_at),
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped: not cut to 80 columns, one key per line
    console.print(table)


@keys_app.command("revoke")
def keys_revoke(
    key: Annotated[str, typer.Argument(help="The key's id, name or prefix (or the key).")],
    database_url: DatabaseUrlOption = None,
) -> None:
    """Revoke a key: it stops authenticating at once."""
    from kvchat.app.store import KeyRecord, Store
    from kvchat.app.store.column_types import utcnow

    url = parse(database_url)

    async def work() -> KeyRecord | None:
        async with await Store.open(url) as store:
            return await store.revoke_key(key)  # ValueError: several active keys match

    started = utcnow()
    record = run(work())
    if record is None:
        fail(f"no key has the id, name or prefix {key!r}; see `kvchat keys list`")
    assert record.revoked_at is not None
    if record.revoked_at < started:
        typer.echo(
            f"key {record.key_prefix} ({record.name}) was already revoked on "
            f"{when(record.revoked_at)} UTC"
        )
    else:
        typer.echo(f"revoked key {record.key_prefix} ({record.name}, owner {record.owner})")


def main() -> None:
    """`python -m kvchat.app.cli.db db ...|keys ...`; `kvchat db|keys ...` is the same commands."""
    cli = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
    cli.add_typer(db_app, name="db")
    cli.add_typer(keys_app, name="keys")
    cli()


if __name__ == "__main__":
    main()
