"""Conversations, each visible only to its owner: another owner's id reads as a missing one."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Any, Unpack, cast

from sqlalchemy import CursorResult, and_, delete, or_, select, update

from kvchat.app.store.column_types import utcnow
from kvchat.app.store.queries import bump_tree, first_scalar, has_message, owned_conversation
from kvchat.app.store.records import (
    OVERRIDE_FIELDS,
    ConversationOverrides,
    ConversationRecord,
    ConversationUpdate,
)
from kvchat.app.store.store_base import StoreBase, check_fields
from kvchat.app.store.tables import Conversation, Message, new_id

# What update_conversation() may set (None clears a field).
UPDATABLE_FIELDS = (
    "title",
    "system_prompt",
    "metadata",
    *OVERRIDE_FIELDS,
    "current_leaf_id",
    "trim_start_id",
)
# The names checked at run time are the TypedDict's, which mypy checks callers against.
assert frozenset(UPDATABLE_FIELDS) == ConversationUpdate.__optional_keys__
MAX_PAGE_SIZE = 1000


class ConversationStore(StoreBase):
    async def create_conversation(
        self,
        owner: str,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        metadata: dict[str, Any] | None = None,
        conversation_id: str | None = None,
        **overrides: Unpack[ConversationOverrides],
    ) -> ConversationRecord:
        """overrides: any of OVERRIDE_FIELDS (None: the server's default). conversation_id:
        the id to give it (a new random one by default)."""
        check_fields(overrides, OVERRIDE_FIELDS)
        now = utcnow()
        row = Conversation(
            id=conversation_id or new_id("conv_"),
            owner=owner,
            title=title,
            system_prompt=system_prompt,
            meta=_metadata(metadata),
            created_at=now,
            updated_at=now,
            **overrides,
        )
        async with self._write() as session:
            session.add(row)
            await session.flush()
            return ConversationRecord.of(row)

    async def get_conversation(self, owner: str, conversation_id: str) -> ConversationRecord | None:
        async with self._read() as session:
            row = await owned_conversation(session, owner, conversation_id)
            return None if row is None else ConversationRecord.of(row)

    async def find_conversation(self, conversation_id: str) -> ConversationRecord | None:
        """A conversation whoever owns it: for operators (admin routes), never for owners."""
        async with self._read() as session:
            row = await session.get(Conversation, conversation_id)
            return None if row is None else ConversationRecord.of(row)

    async def list_conversations(
        self, owner: str, *, limit: int = 20, after: str | None = None
    ) -> tuple[list[ConversationRecord], str | None]:
        """One page, newest first, and the cursor of the next page (None after the last).
        A cursor that does not parse raises ValueError."""
        if not 1 <= limit <= MAX_PAGE_SIZE:
            raise ValueError(f"limit must be in [1, {MAX_PAGE_SIZE}], got {limit}")
        query = select(Conversation).where(Conversation.owner == owner)
        if after is not None:
            created_at, last_id = _decode_cursor(after)
            query = query.where(
                or_(
                    Conversation.created_at < created_at,
                    and_(Conversation.created_at == created_at, Conversation.id < last_id),
                )
            )
        query = query.order_by(Conversation.created_at.desc(), Conversation.id.desc())
        async with self._read() as session:
            rows = list(await session.scalars(query.limit(limit + 1)))
        page = [ConversationRecord.of(row) for row in rows[:limit]]
        more = len(rows) > limit
        return page, _encode_cursor(page[-1].created_at, page[-1].id) if more else None

    async def update_conversation(
        self, owner: str, conversation_id: str, **fields: Unpack[ConversationUpdate]
    ) -> ConversationRecord | None:
        """Set any of UPDATABLE_FIELDS; bumps updated_at. current_leaf_id and trim_start_id
        must be messages of this conversation (ValueError). None if there is no such
        conversation for this owner."""
        check_fields(fields, UPDATABLE_FIELDS)
        async with self._write() as session:
            row = await owned_conversation(session, owner, conversation_id)
            if row is None:
                return None
            for name, message_id in (
                ("current_leaf_id", fields.get("current_leaf_id")),
                ("trim_start_id", fields.get("trim_start_id")),
            ):
                if message_id is not None and not await has_message(
                    session, conversation_id, message_id
                ):
                    raise ValueError(f"{name}: no message {message_id!r} in {conversation_id}")
            if {"current_leaf_id", "trim_start_id", "system_prompt"} & fields.keys():
                await bump_tree(session, conversation_id, row)
            for name, value in fields.items():
                if name == "metadata":
                    row.meta = _metadata(fields["metadata"])
                else:
                    setattr(row, name, value)
            row.updated_at = utcnow()
            await session.flush()
            return ConversationRecord.of(row)

    async def delete_conversation(self, owner: str, conversation_id: str) -> bool:
        """Delete it with its messages and summaries; False if there is no such conversation.

        The messages go by conversation id, not by walking the tree: their parent links are
        cut first, so no cascade recurses down a branch (SQLite stops recursive foreign-key
        actions at a depth of 1,000, which a long agent loop's branch passes)."""
        async with self._write() as session:
            owned = await first_scalar(
                session,
                select(Conversation.id).where(
                    Conversation.id == conversation_id, Conversation.owner == owner
                ),
            )
            if owned is None:
                return False
            await session.execute(
                update(Message)
                .where(Message.conversation_id == conversation_id, Message.parent_id.is_not(None))
                .values(parent_id=None)
            )
            await session.execute(delete(Message).where(Message.conversation_id == conversation_id))
            result = cast(
                CursorResult[Any],
                await session.execute(
                    delete(Conversation).where(
                        Conversation.id == conversation_id, Conversation.owner == owner
                    )
                ),
            )
            return result.rowcount == 1


def _metadata(value: dict[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"metadata must be a JSON object, got {type(value).__name__}")
    return dict(value)


def _encode_cursor(created_at: datetime, conversation_id: str) -> str:
    raw = f"{created_at.isoformat()}|{conversation_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        stamp, conversation_id = raw.split("|")
        created_at = datetime.fromisoformat(stamp)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ValueError(f"invalid cursor {cursor!r}") from None
    if created_at.tzinfo is None or not conversation_id:
        raise ValueError(f"invalid cursor {cursor!r}")
    return created_at, conversation_id
