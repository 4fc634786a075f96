"""Lookups that several parts of the store run inside their own transactions."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.store.tables import Conversation, Message


async def owned_conversation(
    session: AsyncSession, owner: str, conversation_id: str
) -> Conversation | None:
    """The conversation if it exists and belongs to owner."""
    return await session.scalar(
        select(Conversation).where(Conversation.id == conversation_id, Conversation.owner == owner)
    )


async def has_message(session: AsyncSession, conversation_id: str, message_id: str) -> bool:
    """Whether message_id is a message of this conversation."""
    found = await session.scalar(
        select(Message.id).where(
            Message.id == message_id, Message.conversation_id == conversation_id
        )
    )
    return found is not None
