"""What every part of the store shares: the engine and its read and write transactions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from kvchat.app.store.database import SQLITE_BEGIN


class StoreBase:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._reads = async_sessionmaker(engine, expire_on_commit=False)
        self._writes = async_sessionmaker(
            engine.execution_options(**{SQLITE_BEGIN: "IMMEDIATE"}), expire_on_commit=False
        )

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncSession]:
        """A transaction that only reads."""
        async with self._reads() as session, session.begin():
            yield session

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncSession]:
        """A transaction that writes, committed on exit (on SQLite it holds the write lock)."""
        async with self._writes() as session, session.begin():
            yield session


def check_fields(given: Mapping[str, object], allowed: tuple[str, ...]) -> None:
    """TypeError naming keyword arguments a store method does not take."""
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise TypeError(f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
