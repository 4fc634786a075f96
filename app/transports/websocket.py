"""One WebSocket of a conversation: JSON text frames in, the turn's events out.

Client -> server: message, regenerate, stop, resume, ping, typing. Server -> client: start,
delta (`offset`: characters of the reply sent before it), tool_call, done, error (`code`),
pong. A bad frame gets an error frame (`invalid_json`, `unknown_type`, `invalid_request`,
`frame_too_large`) and the socket stays usable; a second message while a reply is being
generated gets `busy`.

The sockets tell the engine's retention policy of the conversation's session
(app/transports/presence.py): present while one is open, and its user typing (`typing`).

A reply belongs to its conversation, not to the socket: when the socket drops, the reply goes
on for a grace period; a client that reconnects and sends `resume` with the last offset it saw
gets the rest, without gaps or repeats (from this process's turn, or from the reply's buffered
events in Redis, or from the stored message once it is done). With no client back in time,
the reply is stopped and stored as cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import WebSocket
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from kvchat.app.deps import AppState, bearer_token
from kvchat.app.errors import APIError, _param, api_error
from kvchat.app.ops import limits
from kvchat.app.ranges import INT32_MAX
from kvchat.app.schemas.chat import SamplingFields, TextPart
from kvchat.app.schemas.json_input import JSONInputError, parse_json
from kvchat.app.store import KeyRecord
from kvchat.app.transports import presence
from kvchat.app.turns.events import TurnEvent
from kvchat.app.turns.turn import Turn
from kvchat.inference import ChatMessage

log = logging.getLogger(__name__)

CLOSE_BAD_KEY = 4401
CLOSE_FORBIDDEN_ORIGIN = 4403
CLOSE_NOT_FOUND = 4404
CLOSE_TOO_MANY = 4429


class MessageFrame(SamplingFields):
    type: Literal["message"]
    role: Literal["user", "tool"] = "user"
    content: str | list[TextPart]
    name: str | None = None
    tool_call_id: str | None = None
    parent_id: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class RegenerateFrame(SamplingFields):
    type: Literal["regenerate"]
    message_id: str | None = None


class StopFrame(BaseModel):
    type: Literal["stop"]


class ResumeFrame(BaseModel):
    type: Literal["resume"]
    message_id: str
    offset: int = Field(0, ge=0, le=INT32_MAX)


class PingFrame(BaseModel):
    type: Literal["ping"]


class TypingFrame(BaseModel):
    """Its user is typing (no other fields)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["typing"]


Frame = Annotated[
    MessageFrame | RegenerateFrame | StopFrame | ResumeFrame | PingFrame | TypingFrame,
    Field(discriminator="type"),
]
FRAME = TypeAdapter(Frame)
TYPES = ("message", "regenerate", "stop", "resume", "ping", "typing")


def error_frame(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message, **extra}


def origin_allowed(websocket: WebSocket, allowed: list[str]) -> bool:
    """Browsers send Origin; it must be this server's own or one the CORS setting lists."""
    origin = websocket.headers.get("origin")
    if origin is None or "*" in allowed or origin in allowed:
        return True
    host = websocket.headers.get("host")
    return host is not None and origin in (f"http://{host}", f"https://{host}")


async def serve(state: AppState, websocket: WebSocket, conversation_id: str) -> None:
    settings = state.settings
    token = bearer_token(websocket.headers.get("authorization")) or websocket.query_params.get(
        "access_token"
    )
    key = await state.store.authenticate(token) if token else None
    await websocket.accept()
    if key is None:
        await websocket.close(CLOSE_BAD_KEY, "invalid API key")
        return
    if not origin_allowed(websocket, settings.cors_origins):
        await websocket.close(CLOSE_FORBIDDEN_ORIGIN, "origin not allowed")
        return
    conv = await state.store.get_conversation(key.owner, conversation_id)
    if conv is None:
        await websocket.send_json(error_frame("not_found", "conversation not found"))
        await websocket.close(CLOSE_NOT_FOUND, "conversation not found")
        return
    if state.websockets.get(key.id, 0) >= settings.ws_max_connections_per_key:
        await websocket.send_json(
            error_frame(
                "too_many_connections",
                f"this key has {settings.ws_max_connections_per_key} sockets open already",
            )
        )
        await websocket.close(CLOSE_TOO_MANY, "too many connections")
        return
    state.websockets[key.id] = state.websockets.get(key.id, 0) + 1
    state.runtime.metrics.websocket_connections.inc()
    socket = Socket(state, websocket, key, conv.id)
    arrival = presence.arrive(state, conv.id)
    try:
        if arrival is not None:
            await asyncio.shield(arrival)
        await socket.run()
    finally:
        state.websockets[key.id] -= 1
        state.runtime.metrics.websocket_connections.dec()
        leaving = presence.leave(state, conv.id)
        await socket.detach()
        if leaving is not None:
            await asyncio.shield(leaving)


class Socket:
    def __init__(
        self, state: AppState, websocket: WebSocket, key: KeyRecord, conversation_id: str
    ) -> None:
        self.state = state
        self.websocket = websocket
        self.key = key
        self.conversation_id = conversation_id
        self.send_lock = asyncio.Lock()
        self.turn: Turn | None = None  # the reply this socket streams (generated here)
        self.streaming: asyncio.Task[None] | None = None
        self.last_activity = time.monotonic()
        self.typing = presence.TypingPace()

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        settings = self.state.settings
        while True:
            idle = settings.ws_idle_timeout - (time.monotonic() - self.last_activity)
            try:
                message = await asyncio.wait_for(self.websocket.receive(), max(idle, 0.01))
            except TimeoutError:
                if time.monotonic() - self.last_activity >= settings.ws_idle_timeout:
                    await self.websocket.close(1001, "idle")
                    return
                continue
            except (WebSocketDisconnect, RuntimeError):
                return
            if message["type"] == "websocket.disconnect":
                return
            self.last_activity = time.monotonic()
            text = message.get("text")
            if text is None:
                await self.send(error_frame("invalid_json", "frames are JSON text"))
                continue
            if len(text.encode()) > settings.ws_max_frame_bytes:
                await self.send(
                    error_frame(
                        "frame_too_large", f"frames are at most {settings.ws_max_frame_bytes} bytes"
                    )
                )
                continue
            await self.handle(text)

    async def handle(self, text: str) -> None:
        try:
            data = parse_json(text)
        except JSONInputError as e:  # too deep or unreadable: invalid_json; bad text: by field
            code = "invalid_request" if e.code == "invalid_unicode" else "invalid_json"
            await self.send(error_frame(code, e.message, param=e.param))
            return
        except json.JSONDecodeError as e:
            await self.send(error_frame("invalid_json", f"not JSON: {e.msg}"))
            return
        if not isinstance(data, dict) or data.get("type") not in TYPES:
            kind = data.get("type") if isinstance(data, dict) else None
            await self.send(
                error_frame(
                    "unknown_type",
                    f"unknown frame type {kind!r}; expected one of {', '.join(TYPES)}",
                )
            )
            return
        try:
            frame = FRAME.validate_python(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = _param(tuple(first.get("loc", ()))[1:])
            await self.send(error_frame("invalid_request", str(first.get("msg")), param=param))
            return
        if isinstance(frame, TypingFrame) and not self.typing.due():
            return  # one was noted moments ago: accepted, nothing to do
        try:
            if not isinstance(frame, PingFrame):
                await self.state.turns.check_key(self.key)
            if isinstance(frame, PingFrame):
                await self.send({"type": "pong"})
            elif isinstance(frame, TypingFrame):
                await presence.note_typing(self.state, self.conversation_id)
            elif isinstance(frame, StopFrame):
                await self.state.turns.stop(self.key.owner, self.conversation_id)
            elif isinstance(frame, ResumeFrame):
                await self.resume(frame)
            else:
                await self.start(frame)
        except Exception as e:
            error = api_error(e)
            await self.send(api_error_frame(error))
            if error.status == 401:
                await self.websocket.close(CLOSE_BAD_KEY, "API key revoked")

    # -- frames ------------------------------------------------------------------------------------

    async def start(self, frame: MessageFrame | RegenerateFrame) -> None:
        if self.turn is not None and not self.turn.is_done:
            await self.send(error_frame("busy", "a reply is being generated; stop it or wait"))
            return
        await self.state.limits.admit(self.key)
        service = self.state.turns
        if isinstance(frame, MessageFrame):
            if frame.role == "tool" and not frame.tool_call_id:
                raise APIError(400, "a tool message needs tool_call_id", param="tool_call_id")
            message: ChatMessage | None = ChatMessage(
                frame.role,
                frame.text,
                name=frame.name,
                tool_call_id=frame.tool_call_id if frame.role == "tool" else None,
            )
            parent_id = frame.parent_id
        else:
            message = None
            parent_id = await service.regenerate_parent(
                self.key.owner, self.conversation_id, frame.message_id
            )
        turn = await service.start(
            self.key, self.conversation_id, frame, new_message=message, parent_id=parent_id
        )
        self.stream(turn, turn.events())

    async def resume(self, frame: ResumeFrame) -> None:
        if self.streaming is not None and not self.streaming.done():
            await self.send(error_frame("busy", "this socket is streaming a reply already"))
            return
        events = await self.state.turns.attach(self.conversation_id, frame.message_id, frame.offset)
        turn = self.state.turns.running(self.conversation_id)
        self.stream(
            turn if turn is not None and turn.message_id == frame.message_id else None, events
        )

    # -- streaming a turn --------------------------------------------------------------------------

    def stream(self, turn: Turn | None, events: AsyncIterator[TurnEvent]) -> None:
        """Send `events` as frames; `turn` (when the reply is generated here) is watched
        while they go."""
        self.turn = turn
        if turn is not None:
            turn.watch()
        self.streaming = asyncio.create_task(self.forward(turn, events))

    async def forward(self, turn: Turn | None, events: AsyncIterator[TurnEvent]) -> None:
        try:
            async for event in events:
                await self.send(event.frame())
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
        finally:
            if turn is not None:
                # Gone mid-reply: the reply goes on for the grace period (a client may resume).
                turn.unwatch(
                    None if self.state.shutting_down else self.state.settings.ws_grace_period
                )
                if self.turn is turn and turn.is_done:
                    self.turn = None

    async def send(self, frame: dict[str, Any]) -> None:
        async with self.send_lock:
            if self.websocket.application_state is WebSocketState.CONNECTED:
                await self.websocket.send_text(json.dumps(frame, ensure_ascii=False))
                self.last_activity = time.monotonic()

    async def detach(self) -> None:
        """The socket is gone: stop forwarding (the reply it streamed goes on for the grace
        period, then stops unless a client resumed it)."""
        if self.streaming is not None:
            self.streaming.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.streaming


def api_error_frame(error: APIError) -> dict[str, Any]:
    if error.status == 429:
        return limits.rate_limit_frame(error)
    code = {409: "busy", 404: "not_found"}.get(error.status) or error.code or "invalid_request"
    if error.status == 400 and error.code in (None, "unsupported"):
        code = error.code or "invalid_request"
    return error_frame(code, error.message, param=error.param)
