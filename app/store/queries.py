"""Lookups that several parts of the store run inside their own transactions."""

from __future__ import annotations

from typing import TypeVar

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.sql.selectable import TypedReturnsRows

from kvchat.app.store.tables import Conversation, Message

_T = TypeVar("_T")


async def first_scalar(session: AsyncSession, statement: TypedReturnsRows[_T]) -> _T | None:
    """The first column of the first row (None: no row) as `session.scalar(statement)`
    gives it, typed: mypy matches every statement to AsyncSession.scalar's first overload
    (`TypedReturnsRows[Never]`, SQLAlchemy 2.1), which returns Any; scalars() keeps the
    statement's type."""
    return (await session.scalars(statement)).first()


async def owned_conversation(
    session: AsyncSession, owner: str, conversation_id: str
) -> Conversation | None:
    """The conversation if it exists and belongs to owner."""
    return await first_scalar(
        session,
        select(Conversation).where(Conversation.id == conversation_id, Conversation.owner == owner),
    )


async def has_message(session: AsyncSession, conversation_id: str, message_id: str) -> bool:
    """Whether message_id is a message of this conversation."""
    found = await first_scalar(
        session,
        select(Message.id).where(
            Message.id == message_id, Message.conversation_id == conversation_id
        ),
    )
    return found is not None


async def bump_tree(
    session: AsyncSession, conversation_id: str, row: Conversation | None = None
) -> int:
    """Count a change to the conversation's message tree or running summary (tree_version
    + 1, in SQL: concurrent writers never lose one); returns the new version and, given the
    conversation's loaded `row`, sets it there as read (no second write at flush)."""
    version = await first_scalar(
        session,
        update(Conversation)
        .where(Conversation.id == conversation_id)
        .values(tree_version=Conversation.tree_version + 1)
        .returning(Conversation.tree_version)
        .execution_options(synchronize_session=False),
    )
    if row is not None and version is not None:
        set_committed_value(row, "tree_version", version)
    return int(version or 0)
