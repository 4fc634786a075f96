"""What a turn tells its clients, as typed events: the reply started, text, a tool call's
pieces, done (the stored reply's status, usage and timings) or failed. Every transport
shapes these (WebSocket frames, the conversations API's SSE events, the AI SDK's UI parts);
`frame()` is the JSON form the WebSocket and SSE send and the Redis buffer keeps, `event_of`
reads it back.

A turn publishes exactly one terminal event (TurnDone or TurnFailed), last. Text deltas carry
`offset`, the number of characters of the reply before them, so a client that comes back
with the offset it saw gets the rest without gaps or repeats (`from_offset`), wherever the
events come from: the live turn, the buffer, or the stored message (`stored_events`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from kvchat.app.store import MessageRecord
from kvchat.app.turns.generation import TokenLogprob


@dataclass(frozen=True)
class TurnStarted:
    message_id: str
    parent_id: str | None

    def frame(self) -> dict[str, Any]:
        return {"type": "start", "message_id": self.message_id, "parent_id": self.parent_id}


@dataclass(frozen=True)
class TurnDelta:
    message_id: str
    text: str
    offset: int  # characters of the reply before this text
    # The logprobs of this text's tokens, when the request asked for them (ShownLogprobs). In
    # this process only: frames (the WebSocket, SSE, the Redis buffer) and stored replies do
    # not carry them.
    logprobs: tuple[TokenLogprob, ...] = ()

    def frame(self) -> dict[str, Any]:
        return {
            "type": "delta",
            "message_id": self.message_id,
            "text": self.text,
            "offset": self.offset,
        }


@dataclass(frozen=True)
class TurnToolCall:
    """A piece of a tool call: the first of each call has its id and name, later ones
    argument fragments (OpenAI's streaming convention)."""

    message_id: str
    index: int
    id: str | None
    name: str | None
    arguments: str

    def frame(self) -> dict[str, Any]:
        return {
            "type": "tool_call",
            "message_id": self.message_id,
            "index": self.index,
            "id": self.id,
            "name": self.name,
            "arguments": self.arguments,
        }


@dataclass(frozen=True)
class TurnDone:
    """The reply is stored: its status (complete, cancelled, interrupted), finish reason,
    usage (cached_tokens: prompt tokens served from KV already in memory) and timings."""

    message_id: str
    status: str
    finish_reason: str | None
    usage: dict[str, int]
    timings: dict[str, float | None]

    @classmethod
    def of(cls, message: MessageRecord) -> TurnDone:
        prompt = message.prompt_tokens or 0
        completion = message.completion_tokens or 0
        return cls(
            message_id=message.id,
            status=message.status,
            finish_reason=message.finish_reason,
            usage={
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "cached_tokens": message.cached_tokens or 0,
            },
            timings={"ttft_ms": message.ttft_ms, "total_ms": message.total_ms},
        )

    def frame(self) -> dict[str, Any]:
        return {
            "type": "done",
            "message_id": self.message_id,
            "finish_reason": self.finish_reason,
            "status": self.status,
            "usage": dict(self.usage),
            "timings": dict(self.timings),
        }


@dataclass(frozen=True)
class TurnFailed:
    """The turn ended without a stored reply to show (the engine failed, the conversation was
    deleted under it): `code` and `message` as the API error would say them."""

    message_id: str | None
    code: str
    message: str
    status: int = 500

    def frame(self) -> dict[str, Any]:
        return {
            "type": "error",
            "code": self.code,
            "message": self.message,
            "message_id": self.message_id,
        }


TurnEvent = TurnStarted | TurnDelta | TurnToolCall | TurnDone | TurnFailed
TERMINAL = (TurnDone, TurnFailed)


def is_terminal(event: TurnEvent) -> bool:
    return isinstance(event, TERMINAL)


def event_of(frame: dict[str, Any]) -> TurnEvent:
    """An event back from its frame (the Redis buffer's entries). KeyError/ValueError for a
    frame that is not one."""
    kind = frame["type"]
    if kind == "start":
        return TurnStarted(frame["message_id"], frame.get("parent_id"))
    if kind == "delta":
        return TurnDelta(frame["message_id"], frame["text"], int(frame["offset"]))
    if kind == "tool_call":
        return TurnToolCall(
            frame["message_id"],
            int(frame["index"]),
            frame.get("id"),
            frame.get("name"),
            frame.get("arguments") or "",
        )
    if kind == "done":
        return TurnDone(
            frame["message_id"],
            frame["status"],
            frame.get("finish_reason"),
            dict(frame.get("usage") or {}),
            dict(frame.get("timings") or {}),
        )
    if kind == "error":
        return TurnFailed(frame.get("message_id"), frame["code"], frame["message"])
    raise ValueError(f"not a turn event: {kind!r}")


def stored_events(message: MessageRecord) -> list[TurnEvent]:
    """A reply that is no longer generating, as the events a client would have seen."""
    events: list[TurnEvent] = [TurnStarted(message.id, message.parent_id)]
    if message.content:
        events.append(TurnDelta(message.id, message.content, 0))
    for index, call in enumerate(message.tool_calls or ()):
        function = call.get("function", {})
        events.append(
            TurnToolCall(
                message.id,
                index,
                call.get("id"),
                function.get("name"),
                function.get("arguments", ""),
            )
        )
    events.append(TurnDone.of(message))
    return events


def text_of(events: Iterable[TurnEvent]) -> str:
    """The reply's text as its deltas told it (recovering a reply cut off by a crash)."""
    text = ""
    for event in events:
        if isinstance(event, TurnDelta) and event.offset <= len(text):
            text = text[: event.offset] + event.text
    return text


async def from_offset(events: AsyncIterator[TurnEvent], offset: int) -> AsyncIterator[TurnEvent]:
    """`events` for a client that has seen `offset` characters: with an offset the start is
    skipped (it was seen), text before the offset is not sent again and a delta that straddles
    it is cut. Everything after the terminal event is dropped."""
    async for event in events:
        if isinstance(event, TurnStarted) and offset:
            continue
        if isinstance(event, TurnDelta):
            end = event.offset + len(event.text)
            if end <= offset:
                continue
            if event.offset < offset:
                event = TurnDelta(event.message_id, event.text[offset - event.offset :], offset)
        yield event
        if is_terminal(event):
            return
