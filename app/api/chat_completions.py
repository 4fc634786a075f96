"""`POST /v1/chat/completions`: OpenAI's Chat Completions, stateless."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request

from kvchat.app.ops.limits import RateLimitedKey
from kvchat.app.schemas.chat import ChatCompletion, ChatCompletionRequest
from kvchat.app.state import StateDep
from kvchat.app.transports import chat_completions as completions

router = APIRouter(prefix="/v1", tags=["chat"])


@router.post(
    "/chat/completions",
    response_model=ChatCompletion,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "A chat.completion, or with stream=true chat.completion.chunk "
            "events ending with `data: [DONE]`.",
        }
    },
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
            description="Pin this session's KV between calls (scoped to the key's owner).",
        ),
    ] = None,
) -> Any:
    return await completions.create(state, key, body, request, x_session_id)
