"""The conversations API: server-side history as a tree of messages."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from kvchat.app.schemas.chat import SamplingFields, TextPart, ToolCall
from kvchat.app.session_settings import SESSION_FIELDS, SessionSettings
from kvchat.history import HistoryPolicyError

ROOT = "root"  # parent_id that makes a new message a root (editing the first message)


SETTINGS_FIELDS = SESSION_FIELDS
WATERMARKS = ("low_watermark", "high_watermark")


class InvalidSessionSettings(HistoryPolicyError):
    """Session settings that cannot run a turn; `field` names the setting as the API does (the
    service answers a HistoryPolicyError 400 with that param)."""


def check_session_settings(
    stored: Mapping[str, Any], changes: Mapping[str, Any], defaults: Mapping[str, Any]
) -> None:
    """Check a conversation's settings as they will be once `changes` (the fields a request
    sets; None: back to the default) apply over `stored` (what it holds now; None or absent:
    unset), each unset one taking its value from `defaults` (the server's, all fields).

    Checked together, since settings checked one request at a time can add up to a policy no
    turn can run (`low_watermark` 0.6 stored, `high_watermark` 0.3 patched later). Raises
    InvalidSessionSettings naming a field the request changed where one is to blame, else one
    the conversation stores; the message says where each value came from."""
    merged = {name: stored.get(name) for name in SETTINGS_FIELDS} | dict(changes)

    def source(name: str) -> str:
        if merged[name] is None:
            return "the server default"
        return "this request" if name in changes else "stored on the conversation"

    def blamed(involved: tuple[str, ...], named: str) -> str:
        candidates = (
            [n for n in involved if n in changes]
            or [n for n in involved if merged[n] is not None]
            or list(involved)
        )
        return named if named in candidates else candidates[0]

    try:
        SessionSettings.model_validate({n: v for n, v in merged.items() if v is not None})
    except ValidationError as e:
        errors = [
            (str(err["loc"][0]), str(err["msg"]).removeprefix("Value error, "))
            for err in e.errors()
            if err["loc"] and err["loc"][0] in merged
        ]
        if not errors:  # no field named: say what pydantic says
            raise InvalidSessionSettings(str(e), next(iter(changes), "settings")) from None
        name, message = next(((n, m) for n, m in errors if n in changes), errors[0])
        raise InvalidSessionSettings(
            f"{name} {merged[name]!r} ({source(name)}): {message}", name
        ) from None
    effective: dict[str, Any] = {
        n: defaults[n] if merged[n] is None else merged[n] for n in SETTINGS_FIELDS
    }
    try:
        SessionSettings.of(effective).policy()
    except HistoryPolicyError as e:
        named = "history_policy" if e.field == "policy" else e.field
        involved = WATERMARKS if named in WATERMARKS else (named,)
        message = str(e)
        if named in WATERMARKS and effective["low_watermark"] > effective["high_watermark"]:
            message = "low_watermark must not exceed high_watermark"
        sources = "; ".join(f"{n} {effective[n]!r}: {source(n)}" for n in involved)
        raise InvalidSessionSettings(f"{message} ({sources})", blamed(involved, named)) from None


class StoredSessionSettings(BaseModel):
    """A conversation's settings as stored, in a response: SessionSettings' fields with their
    types only, no ranges, so a row that SessionSettings would refuse now (stored before
    settings were checked together, or by hand) still lists and reads; a turn on it answers
    400 naming the field. A test holds its fields to SessionSettings'."""

    max_context_tokens: int | None = None
    max_kv_tokens: int | None = None
    history_policy: str | None = None
    high_watermark: float | None = None
    low_watermark: float | None = None
    max_tool_result_tokens: int | None = None
    max_summary_tokens: int | None = None
    retention_ttl_s: float | None = None
    retention_priority: int | None = None


class ConversationCreate(SessionSettings):
    title: str | None = Field(None, max_length=512)
    system: str | None = None
    metadata: dict[str, Any] | None = None
    items: list[Any] | None = Field(
        None,
        max_length=20,
        description="OpenAI's Conversations API: the first items "
        "(messages, function calls and their outputs), stored in order.",
    )


class ConversationPatch(SessionSettings):
    title: str | None = Field(None, max_length=512)
    system: str | None = None
    metadata: dict[str, Any] | None = None
    current_leaf_id: str | None = None


class ConversationOut(StoredSessionSettings):
    """kvchat's conversation, with OpenAI's Conversation fields (`id`, `object`,
    `created_at`, `metadata`): times are Unix seconds, as OpenAI's."""

    id: str
    object: Literal["conversation"] = "conversation"
    title: str | None
    system: str | None
    metadata: dict[str, Any]
    current_leaf_id: str | None
    created_at: int
    updated_at: int


class ConversationList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ConversationOut]
    has_more: bool
    next_cursor: str | None


class ConversationDeleted(BaseModel):
    """`DELETE /v1/conversations/{id}`, as OpenAI's Conversations API answers."""

    id: str
    object: Literal["conversation.deleted"]
    deleted: bool


class StopResult(BaseModel):
    """`POST /v1/conversations/{id}/stop` (and `POST /v1/ui/chat/{id}/stop`, with the chat's
    id): whether a reply was being generated (stopped, and stored as cancelled)."""

    id: str
    stopped: bool


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
        None,
        description=f"Branch from this message instead of the current leaf; '{ROOT}' "
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
