"""What the store returns: plain frozen dataclasses, detached from any database session."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvchat.app.store.tables import ApiKey, Conversation, Message, Summary

ROLES = ("system", "user", "assistant", "tool")
STATUSES = ("complete", "generating", "cancelled", "interrupted", "error")
# Per-conversation settings that override the server's defaults when not None.
OVERRIDE_FIELDS = (
    "max_context_tokens",
    "max_kv_tokens",
    "history_policy",
    "high_watermark",
    "low_watermark",
    "max_tool_result_tokens",
    "max_summary_tokens",
)


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
            **{name: getattr(row, name) for name in OVERRIDE_FIELDS},
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
