"""The Vercel AI SDK's chat endpoints (`useChat` with `DefaultChatTransport({api:
"/v1/ui/chat"})`): post a chat, resume its stream, stop it. See app/transports/ui_stream.py
for the parts and app/transports/ui_chat.py for how a chat maps onto a conversation.

A reply is not stopped when its stream's client leaves (useChat resumes streams after a reload):
it goes on for the WebSocket's grace period and stops then unless a client came back; a real
stop is `POST /v1/ui/chat/{id}/stop`, which stores the partial reply as cancelled and ends
the stream with an `abort` part."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from kvchat.app.deps import AppState, CurrentKey, RateLimitedKey, StateDep
from kvchat.app.errors import not_found
from kvchat.app.schemas.conversations import StopResult
from kvchat.app.schemas.streams import event_stream
from kvchat.app.schemas.ui_chat import UIChatRequest
from kvchat.app.transports import ui_chat as ui_messages
from kvchat.app.transports import ui_stream
from kvchat.app.transports.sse import SSE_HEADERS
from kvchat.app.turns.turn import Turn

router = APIRouter(prefix="/v1/ui/chat", tags=["ai-sdk"])

STREAM_RESPONSE = event_stream(
    "The reply as a UI message stream (SSE).",
    data="A UI message stream part (JSON), or `[DONE]` last.",
)


@router.post("", response_class=StreamingResponse, responses=STREAM_RESPONSE)
async def post_chat(body: UIChatRequest, key: RateLimitedKey, state: StateDep) -> Response:
    """useChat's request: `{id, messages, trigger, messageId}` (plus sampling fields)."""
    turn = await ui_messages.start_chat_turn(state, key, body)
    return _stream(state, turn)


@router.get(
    "/{chat_id}/stream",
    response_class=StreamingResponse,
    responses={**STREAM_RESPONSE, 204: {"description": "Nothing is generating."}},
)
async def resume_chat(chat_id: str, key: CurrentKey, state: StateDep) -> Response:
    """The reply being generated, from its start; 204 when nothing is generating."""
    conv = await ui_messages.find_chat(state, key.owner, chat_id)
    turn = state.turns.running(conv.id) if conv is not None else None
    if turn is None or turn.is_done:
        return Response(status_code=204)
    return _stream(state, turn)


@router.post("/{chat_id}/stop", response_model=StopResult)
async def stop_chat(chat_id: str, key: CurrentKey, state: StateDep) -> dict[str, Any]:
    """Stop the chat's reply; it is stored as cancelled with what it has."""
    conv = await ui_messages.find_chat(state, key.owner, chat_id)
    if conv is None:
        raise not_found(f"chat {chat_id!r}")
    stopped = await state.turns.stop(key.owner, conv.id)
    return {"id": chat_id, "stopped": stopped}


def _stream(state: AppState, turn: Turn) -> StreamingResponse:
    return StreamingResponse(
        _watch(state, turn),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, ui_stream.HEADER: ui_stream.VERSION},
    )


async def _watch(state: AppState, turn: Turn) -> AsyncIterator[str]:
    turn.watch()
    try:
        async for text in ui_stream.ui_stream(turn.events()):
            yield text
    finally:
        turn.unwatch(None if state.shutting_down else state.settings.ws_grace_period)
