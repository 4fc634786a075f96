"""The conversations API: server-side history as a tree of messages."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from memory.history import MIN_TOOL_RESULT_TOKENS, POLICIES

from app.schemas.chat import SamplingFields, TextPart, ToolCall
from app.schemas.ranges import INT32_MAX

ROOT = "root"  # parent_id that makes a new message a root (editing the first message)


class SessionSettings(BaseModel):
    """Per-conversation budget and history policy; unset fields take the server defaults.
    Token counts are at most INT32_MAX (the columns they are stored in are 32-bit)."""

    model_config = ConfigDict(extra="forbid")

    max_context_tokens: int | None = Field(None, ge=16, le=INT32_MAX)
    max_kv_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    history_policy: str | None = Field(None, description=f"One of {', '.join(POLICIES)}.")
    high_watermark: float | None = Field(None, ge=0.0, le=1.0)
    low_watermark: float | None = Field(None, ge=0.0, le=1.0)
    max_tool_result_tokens: int | None = Field(None, ge=MIN_TOOL_RESULT_TOKENS, le=INT32_MAX)
    max_summary_tokens: int | None = Field(None, ge=1, le=INT32_MAX)

    @field_validator("history_policy")
    @classmethod
    def _known_policy(cls, value: str | None) -> str | None:
        if value is not None and value not in POLICIES:
            raise ValueError(f"must be one of {', '.join(POLICIES)}")
        return value

    @model_validator(mode="after")
    def _watermarks(self) -> SessionSettings:
        low, high = self.low_watermark, self.high_watermark
        if low is not None and high is not None and low > high:
            raise ValueError("low_watermark must not exceed high_watermark")
        return self


class ConversationCreate(SessionSettings):
    title: str | None = Field(None, max_length=512)
    system: str | None = None
    metadata: dict[str, Any] | None = None


class ConversationPatch(SessionSettings):
    title: str | None = Field(None, max_length=512)
    system: str | None = None
    metadata: dict[str, Any] | None = None
    current_leaf_id: str | None = None


class ConversationOut(BaseModel):
    """A stored conversation. Its settings are shown as stored, not checked again (a value an
    older version accepted still reads back)."""

    max_context_tokens: int | None = None
    max_kv_tokens: int | None = None
    history_policy: str | None = None
    high_watermark: float | None = None
    low_watermark: float | None = None
    max_tool_result_tokens: int | None = None
    max_summary_tokens: int | None = None
    id: str
    object: Literal["conversation"] = "conversation"
    title: str | None
    system: str | None
    metadata: dict[str, Any]
    current_leaf_id: str | None
    created_at: datetime
    updated_at: datetime


class ConversationList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ConversationOut]
    has_more: bool
    next_cursor: str | None


class MessageUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int


class Timings(BaseModel):
    ttft_ms: float | None
    total_ms: float | None


class MessageOut(BaseModel):
    id: str
    object: Literal["conversation.message"] = "conversation.message"
    conversation_id: str
    parent_id: str | None
    role: str
    content: str | None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    status: str
    finish_reason: str | None = None
    usage: MessageUsage | None = None
    timings: Timings | None = None
    num_tokens: int | None = None
    siblings: list[str] = Field(
        default_factory=list,
        description="Ids of the messages sharing this one's parent, itself included, oldest "
        "first (branch switching).",
    )
    children: list[str] | None = Field(None, description="With ?all=true: child ids.")
    created_at: datetime


class MessageList(BaseModel):
    object: Literal["list"] = "list"
    data: list[MessageOut]
    leaf_id: str | None


class PostMessage(SamplingFields):
    """A user (or tool-result) message to append, and how to generate the reply. Without
    content (and with parent_id naming a user or tool message) it regenerates the reply to
    that message as a new sibling."""

    role: Literal["user", "tool"] = "user"
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    parent_id: str | None = Field(
        None, description=f"Branch from this message instead of the current leaf; '{ROOT}' "
        "starts a new root (editing the first message).",
    )

    @property
    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class Regenerate(SamplingFields):
    message_id: str | None = Field(
        None, description="The assistant message to regenerate (default: the current leaf's)."
    )
