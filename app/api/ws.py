"""`GET /v1/conversations/{id}/ws`: a conversation over a WebSocket (see
app/transports/websocket.py for the frames). The key comes in the Authorization header or,
from browsers, which cannot set headers, as the `access_token` query parameter."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from kvchat.app.transports import websocket as realtime

router = APIRouter(tags=["realtime"])


@router.websocket("/v1/conversations/{conversation_id}/ws")
async def conversation_socket(websocket: WebSocket, conversation_id: str) -> None:
    await realtime.serve(websocket.app.state.kvchat, websocket, conversation_id)
