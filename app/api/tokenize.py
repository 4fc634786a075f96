"""`POST /v1/tokenize`: token counts of a messages array under the model's chat template."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from kvchat.app.deps import RateLimitedKey, StateDep
from kvchat.app.schemas.chat import Message, Tool
from kvchat.app.turns.prompting import chat_messages, offered_tools

router = APIRouter(prefix="/v1", tags=["tokenize"])


class TokenizeRequest(BaseModel):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    return_token_ids: bool = False


class TokenizeResponse(BaseModel):
    count: int = Field(description="Tokens of the whole prompt.")
    max_model_len: int
    messages: list[int] = Field(description="Tokens of each message's segment.")
    token_ids: list[int] | None = None


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, key: RateLimitedKey, state: StateDep) -> Any:
    """Counted against the key's request rate like a chat request: tokenizing is work per byte."""
    from kvchat.app.schemas.chat import SamplingFields

    tools = offered_tools(SamplingFields(tools=body.tools)) if body.tools else None
    names = {t.function.name for t in body.tools} if body.tools else None
    messages = chat_messages(body.messages, names)
    runtime = state.runtime
    segments = await runtime.run_cpu(
        runtime.builder.renderer.render_segments,
        messages,
        add_generation_prompt=body.add_generation_prompt,
        tools=tools,
    )
    per_message = [0] * len(messages)
    for segment in segments:
        if segment.message_index is not None:
            per_message[segment.message_index] += len(segment.token_ids)
    ids = [t for s in segments for t in s.token_ids]
    return TokenizeResponse(
        count=len(ids),
        max_model_len=state.runtime.max_model_len,
        messages=per_message,
        token_ids=ids if body.return_token_ids else None,
    )
