"""What the store returns: plain frozen dataclasses, detached from any database session."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypedDict

from kvchat.app.session_settings import SESSION_FIELDS
from kvchat.app.store.tables import ApiKey, Conversation, Message, Summary

ROLES = ("system", "user", "assistant", "tool")
STATUSES = ("complete", "generating", "cancelled", "interrupted", "error")
# Per-conversation settings that override the server's defaults when not None: the fields of
# SessionSettings (app/session_settings.py). The TypedDict below, ConversationRecord's fields
# and the conversations table's columns spell them out for the type checkers (mypy, SQLAlchemy's
# Mapped); tests/app/store/test_session_columns.py holds all three to SessionSettings.
OVERRIDE_FIELDS = SESSION_FIELDS


class ConversationOverrides(TypedDict, total=False):
    """OVERRIDE_FIELDS, as create_conversation() takes them (None: the server's default)."""

    max_context_tokens: int | None
    max_kv_tokens: int | None
    history_policy: str | None
    high_watermark: float | None
    low_watermark: float | None
    max_tool_result_tokens: int | None
    max_summary_tokens: int | None
    retention_ttl_s: float | None
    retention_priority: int | None


# The names checked at run time are the TypedDict's, which mypy checks callers against.
assert frozenset(OVERRIDE_FIELDS) == ConversationOverrides.__optional_keys__


class ConversationUpdate(ConversationOverrides, total=False):
    """What update_conversation() may set (None clears a field); its UPDATABLE_FIELDS."""

    title: str | None
    system_prompt: str | None
    metadata: dict[str, Any] | None
    current_leaf_id: str | None
    trim_start_id: str | None


class MessageFields(TypedDict, total=False):
    """A message's optional fields, as add_message() takes them; its MESSAGE_FIELDS."""

    name: str | None
    tool_calls: Sequence[dict[str, Any]] | None  # stored as a JSON list
    tool_call_id: str | None
    num_tokens: int | None
    content_tokens: int | None
    token_ids: Sequence[int] | None  # stored as a JSON list
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    ttft_ms: float | None
    total_ms: float | None
    error: str | None
    response: dict[str, Any] | None


class MessageUpdate(MessageFields, total=False):
    """What update_message() may set: MessageFields, the status and the content."""

    status: str  # one of STATUSES
    content: str | None


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    name: str
    owner: str
    key_prefix: str
    is_admin: bool
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None

    @classmethod
    def of(cls, row: ApiKey) -> KeyRecord:
        return cls(
            id=row.id,
            name=row.name,
            owner=row.owner,
            key_prefix=row.key_prefix,
            is_admin=row.is_admin,
            created_at=row.created_at,
            last_used_at=row.last_used_at,
            revoked_at=row.revoked_at,
        )


@dataclass(frozen=True, slots=True)
class ConversationRecord:
    id: str
    owner: str
    title: str | None
    system_prompt: str | None
    metadata: dict[str, Any]
    max_context_tokens: int | None
    max_kv_tokens: int | None
    history_policy: str | None
    high_watermark: float | None
    low_watermark: float | None
    max_tool_result_tokens: int | None
    max_summary_tokens: int | None
    retention_ttl_s: float | None
    retention_priority: int | None
    current_leaf_id: str | None
    trim_start_id: str | None
    turn_fence: int
    tree_version: int
    created_at: datetime
    updated_at: datetime

    @property
    def overrides(self) -> dict[str, Any]:
        """The overrides that are set, by field name."""
        values = {name: getattr(self, name) for name in OVERRIDE_FIELDS}
        return {name: value for name, value in values.items() if value is not None}

    @classmethod
    def of(cls, row: Conversation) -> ConversationRecord:
        return cls(
            id=row.id,
            owner=row.owner,
            title=row.title,
            system_prompt=row.system_prompt,
            metadata=dict(row.meta),
            max_context_tokens=row.max_context_tokens,
            max_kv_tokens=row.max_kv_tokens,
            history_policy=row.history_policy,
            high_watermark=row.high_watermark,
            low_watermark=row.low_watermark,
            max_tool_result_tokens=row.max_tool_result_tokens,
            max_summary_tokens=row.max_summary_tokens,
            retention_ttl_s=row.retention_ttl_s,
            retention_priority=row.retention_priority,
            current_leaf_id=row.current_leaf_id,
            trim_start_id=row.trim_start_id,
            turn_fence=row.turn_fence or 0,
            tree_version=row.tree_version or 0,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )


@dataclass(frozen=True, slots=True)
class MessageRecord:
    id: str
    conversation_id: str
    parent_id: str | None
    role: str  # one of ROLES
    content: str | None
    name: str | None
    tool_calls: list[dict[str, Any]] | None  # OpenAI tool-call objects (assistant)
    tool_call_id: str | None  # the call a tool message answers
    num_tokens: int | None  # segment length under the model's chat template
    content_tokens: int | None  # the content alone
    token_ids: tuple[int, ...] | None  # what an assistant message was generated as
    status: str  # one of STATUSES
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    ttft_ms: float | None
    total_ms: float | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    # What a Responses API reply was asked with (None for other messages).
    response: dict[str, Any] | None = None

    @classmethod
    def of(cls, row: Message) -> MessageRecord:
        return cls(
            id=row.id,
            conversation_id=row.conversation_id,
            parent_id=row.parent_id,
            role=row.role,
            content=row.content,
            name=row.name,
            tool_calls=row.tool_calls,
            tool_call_id=row.tool_call_id,
            num_tokens=row.num_tokens,
            content_tokens=row.content_tokens,
            token_ids=None if row.token_ids is None else tuple(row.token_ids),
            status=row.status,
            finish_reason=row.finish_reason,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            cached_tokens=row.cached_tokens,
            ttft_ms=row.ttft_ms,
            total_ms=row.total_ms,
            error=row.error,
            created_at=row.created_at,
            updated_at=row.updated_at,
            response=None if row.response is None else dict(row.response),
        )


@dataclass(frozen=True, slots=True)
class SummaryRecord:
    id: str
    conversation_id: str
    text: str
    num_tokens: int
    covers: tuple[str, ...]  # message ids, oldest first
    created_at: datetime

    @classmethod
    def of(cls, row: Summary) -> SummaryRecord:
        return cls(
            id=row.id,
            conversation_id=row.conversation_id,
            text=row.text,
            num_tokens=row.num_tokens,
            covers=tuple(row.covers),
            created_at=row.created_at,
        )
