"""`POST /v1/chat/completions`: OpenAI's Chat Completions, stateless."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request

from kvchat.app.deps import RateLimitedKey, StateDep
from kvchat.app.schemas.chat import ChatCompletion, ChatCompletionRequest
from kvchat.app.schemas.streams import event_stream
from kvchat.app.transports import chat_completions as completions

router = APIRouter(prefix="/v1", tags=["chat"])


@router.post(
    "/chat/completions",
    response_model=ChatCompletion,
    responses=event_stream(
        "A chat.completion, or with stream=true chat.completion.chunk "
        "events ending with `data: [DONE]`.",
        data="A chat.completion.chunk (JSON), or `[DONE]` last.",
    ),
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    key: RateLimitedKey,
    state: StateDep,
    x_session_id: Annotated[
        str | None,
        Header(
            alias="X-Session-Id",
            description="Pin this session's KV between calls (scoped to the key's owner); "
            "wins over a prompt_cache_key.",
        ),
    ] = None,
) -> Any:
    return await completions.create(state, key, body, request, x_session_id)
