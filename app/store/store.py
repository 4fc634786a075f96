"""The Store: opening a database (migrating or checking its schema) and every repository."""

from __future__ import annotations

from types import TracebackType

from sqlalchemy import text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from kvchat.app.store.conversation_store import ConversationStore
from kvchat.app.store.database import create_engine, database_url, display_url
from kvchat.app.store.errors import CONNECT_ERRORS, unreachable
from kvchat.app.store.key_store import KeyStore
from kvchat.app.store.message_store import MessageStore
from kvchat.app.store.schema import (
    check_current,
    current_revision,
    head_revision,
    known_revisions,
    upgrade_engine,
)
from kvchat.app.store.summary_store import SummaryStore


class Store(KeyStore, ConversationStore, MessageStore, SummaryStore):
    """Everything the service keeps in its database. Methods return frozen records, never
    ORM objects. Open with `await Store.open(url)`; close with `await store.close()`."""

    def __init__(self, engine: AsyncEngine, url: URL) -> None:
        super().__init__(engine)
        self.url = url

    @classmethod
    async def open(cls, url: str | URL, *, migrate: bool | None = None) -> Store:
        """Connect and make sure the schema is at head. migrate (default: True for SQLite,
        False for Postgres) runs the migrations first; otherwise a schema not at head raises
        SchemaNotCurrent naming `kvchat db upgrade`. InvalidDatabaseUrl, DatabaseUnreachable:
        see app.store.errors."""
        parsed = database_url(url)
        if migrate is None:
            migrate = parsed.get_backend_name() == "sqlite"
        engine = create_engine(parsed)
        try:
            async with engine.connect() as connection:
                current = await current_revision(connection)
            if current != head_revision():
                if migrate and (current is None or current in known_revisions()):
                    await upgrade_engine(engine)
                else:
                    check_current(parsed, current)
        except CONNECT_ERRORS as e:
            await engine.dispose()
            raise unreachable(display_url(parsed), e) from None
        except BaseException:
            await engine.dispose()
            raise
        return cls(engine, parsed)

    async def close(self) -> None:
        await self._engine.dispose()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def ping(self) -> bool:
        """Whether the database answers (for /readyz)."""
        try:
            async with self._engine.connect() as connection:
                await connection.execute(text("SELECT 1"))
        except CONNECT_ERRORS:
            return False
        return True

    async def schema_status(self) -> tuple[str | None, str]:
        """(the database's revision, the migrations' head)."""
        async with self._engine.connect() as connection:
            return await current_revision(connection), head_revision()
