"""The tables: API keys, conversations, messages (a tree) and summaries.

Ids are generated here (a type prefix and a uuid4 hex), timestamps are Python-side UTC
defaults, so SQLite and Postgres rows look the same. Deleting a conversation deletes its
messages and summaries in the database (ON DELETE CASCADE; SQLite runs with foreign keys on).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, validates

from kvchat.app.store.column_types import UTCDateTime, utcnow

# Named constraints, so migrations (and SQLite's batch mode) can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID = String(64)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def without_nul(value: str | None) -> str | None:
    """NUL as U+FFFD (what the text columns store; see nul_free)."""
    return None if value is None else value.replace("\x00", "\ufffd")


# The Message columns nul_free guards (a statement that writes them applies without_nul).
MESSAGE_TEXT = ("content", "name", "tool_call_id", "error")


def nul_free(*names: str) -> Callable[[object, str, str | None], str | None]:
    """A validator for text attributes: NUL becomes U+FFFD. Postgres rejects NUL in text while
    SQLite keeps it; replaced on both (a byte-level tokenizer can decode a NUL), no reply is
    lost to it and both read back the same. A reply's exact output stays in its token_ids."""

    def replace_nul(_row: object, _name: str, value: str | None) -> str | None:
        return None if value is None else value.replace("\x00", "\ufffd")

    return validates(*names)(replace_nul)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON,
        str: Text(),
    }


class ApiKey(Base):
    """An API key. Only the sha256 of the key is stored; key_prefix is shown in listings."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(ID, primary_key=True, default=lambda: uuid.uuid4().hex)
    name: Mapped[str]
    owner: Mapped[str]
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    key_prefix: Mapped[str] = mapped_column(String(16))
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]

    _nul_free = nul_free("name", "owner")


class Conversation(Base):
    """A conversation with its per-session overrides (None: the server's default)."""

    __tablename__ = "conversations"
    # Newest-first pages: ORDER BY created_at DESC, id DESC within an owner. A b-tree is
    # read backwards for that, so the index is declared ascending (which also keeps
    # `alembic check` free of sort-order diffs on SQLite).
    __table_args__ = (Index("ix_conversations_owner_created_at_id", "owner", "created_at", "id"),)

    id: Mapped[str] = mapped_column(ID, primary_key=True, default=lambda: new_id("conv_"))
    owner: Mapped[str]
    title: Mapped[str | None]
    system_prompt: Mapped[str | None]
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", default=dict)
    max_context_tokens: Mapped[int | None] = mapped_column(Integer)
    max_kv_tokens: Mapped[int | None] = mapped_column(Integer)
    history_policy: Mapped[str | None] = mapped_column(String(32))
    high_watermark: Mapped[float | None] = mapped_column(Float)
    low_watermark: Mapped[float | None] = mapped_column(Float)
    max_tool_result_tokens: Mapped[int | None] = mapped_column(Integer)
    max_summary_tokens: Mapped[int | None] = mapped_column(Integer)
    retention_ttl_s: Mapped[float | None] = mapped_column(Float)
    retention_priority: Mapped[int | None] = mapped_column(Integer)
    # Message ids, checked by the store rather than by foreign keys (which would make the
    # two tables refer to each other).
    current_leaf_id: Mapped[str | None] = mapped_column(ID)
    trim_start_id: Mapped[str | None] = mapped_column(ID)
    # The fence of the last turn lock that started a reply here (app/coord/locks.py): a
    # turn whose lock's fence is not above it lost its lock and is refused.
    turn_fence: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Counts every change to the message tree and the running summary (app/store/queries.py
    # bump_tree): a process keeping the conversation's branch in memory checks it.
    tree_version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)

    _nul_free = nul_free("owner", "title", "system_prompt")


class Message(Base):
    """One message of a conversation's tree: parent_id None for a root, siblings ordered
    by (created_at, id)."""

    __tablename__ = "messages"
    __table_args__ = (
        Index("ix_messages_conversation_id_created_at", "conversation_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(ID, primary_key=True, default=lambda: new_id("msg_"))
    conversation_id: Mapped[str] = mapped_column(
        ID, ForeignKey("conversations.id", ondelete="CASCADE")
    )
    # Indexed: Postgres looks children up by it on every cascaded delete.
    parent_id: Mapped[str | None] = mapped_column(
        ID, ForeignKey("messages.id", ondelete="CASCADE"), index=True
    )
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str | None]
    name: Mapped[str | None]
    tool_calls: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    tool_call_id: Mapped[str | None]
    num_tokens: Mapped[int | None] = mapped_column(Integer)
    content_tokens: Mapped[int | None] = mapped_column(Integer)
    token_ids: Mapped[list[int] | None] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    total_ms: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None]
    # A Responses API reply: what it was asked with (app/transports/responses.py).
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)

    _nul_free = nul_free(*MESSAGE_TEXT)


class Summary(Base):
    """A summary of dropped messages; the newest one per conversation is the running one."""

    __tablename__ = "summaries"
    __table_args__ = (
        Index("ix_summaries_conversation_id_created_at", "conversation_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(ID, primary_key=True, default=lambda: new_id("sum_"))
    conversation_id: Mapped[str] = mapped_column(
        ID, ForeignKey("conversations.id", ondelete="CASCADE")
    )
    text: Mapped[str]
    num_tokens: Mapped[int] = mapped_column(Integer)
    covers: Mapped[list[str]] = mapped_column(JSON)  # message ids, oldest first
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    _nul_free = nul_free("text")
