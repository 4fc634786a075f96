"""The Vercel AI SDK's `useChat` request (AI SDK 5, `DefaultChatTransport`): the chat id, the
chat's UI messages, what triggered the request, and any extra body fields (here: sampling)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvchat.app.schemas.chat import SamplingFields

MAX_CHAT_ID = 200


class UIMessage(BaseModel):
    """A UI message: an id, a role and parts (`{"type": "text", "text"}`, `step-start`,
    `reasoning`, `tool-<name>`, `file`, ...). Only text is read; see app/transports/ui_chat.py."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, max_length=200)
    role: Literal["system", "user", "assistant"]
    parts: list[dict[str, Any]]
    metadata: Any = None


class UIChatRequest(SamplingFields):
    """`POST /v1/ui/chat`: useChat's body. Extra fields given with useChat's `body` option are
    read as sampling fields (`max_tokens`, `temperature`, ...)."""

    id: str = Field(
        min_length=1,
        max_length=MAX_CHAT_ID,
        description="The chat's id: a "
        "conversation id of this key's owner, or any id useChat made (a "
        "conversation is created for it on first use).",
    )
    messages: list[UIMessage] = Field(min_length=1)
    trigger: Literal["submit-message", "regenerate-message"] = "submit-message"
    message_id: str | None = Field(
        None,
        alias="messageId",
        description="With regenerate-message: the assistant message to regenerate.",
    )

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
