"""A turn's events as the Vercel AI SDK's UI message stream (AI SDK 5, protocol v1).

SSE `data:` lines, each one part: `start` (messageId: the stored assistant message's id),
`start-step`, `text-start` / `text-delta` / `text-end`, `tool-input-start` /
`tool-input-delta` / `tool-input-available` (or `tool-input-error` when the arguments are not
JSON), `finish-step`, then `finish` (finishReason, usage in messageMetadata) or, for a reply
that was stopped, `message-metadata` and `abort`; an engine fault is an `error` part. The stream
always ends with `data: [DONE]`. Part shapes follow the SDK's `uiMessageChunkSchema`, whose
objects are strict: no field beyond the ones it names.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from kvchat.app.turns.events import (
    TurnDelta,
    TurnDone,
    TurnEvent,
    TurnFailed,
    TurnStarted,
    TurnToolCall,
)

HEADER = "x-vercel-ai-ui-message-stream"
VERSION = "v1"
FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool-calls"}


def metadata(done: TurnDone) -> dict[str, Any]:
    """kvchat's usage and timings of a reply, as the message's metadata."""
    return {
        "status": done.status,
        "finishReason": done.finish_reason,
        "usage": dict(done.usage),
        "timings": dict(done.timings),
    }


class PartWriter:
    """Turns the events of one reply into UI message parts, in order."""

    def __init__(self) -> None:
        self.text_id: str | None = None
        self.text_open = False
        self.tools: dict[int, dict[str, Any]] = {}  # index -> {id, name, arguments}

    def parts(self, event: TurnEvent) -> Iterable[dict[str, Any]]:
        if isinstance(event, TurnStarted):
            self.text_id = f"text_{event.message_id}"
            yield {"type": "start", "messageId": event.message_id}
            yield {"type": "start-step"}
        elif isinstance(event, TurnDelta):
            if not self.text_open:
                self.text_open = True
                yield {"type": "text-start", "id": self._text_id(event.message_id)}
            yield {"type": "text-delta", "id": self._text_id(event.message_id), "delta": event.text}
        elif isinstance(event, TurnToolCall):
            call = self.tools.get(event.index)
            if call is None:
                call = self.tools[event.index] = {
                    "id": event.id or f"call_{event.message_id}_{event.index}",
                    "name": event.name or "",
                    "arguments": "",
                }
                yield {
                    "type": "tool-input-start",
                    "toolCallId": call["id"],
                    "toolName": call["name"],
                }
            if event.arguments:
                call["arguments"] += event.arguments
                yield {
                    "type": "tool-input-delta",
                    "toolCallId": call["id"],
                    "inputTextDelta": event.arguments,
                }
        elif isinstance(event, TurnDone):
            yield from self._close()
            yield {"type": "finish-step"}
            if event.status in ("cancelled", "interrupted"):
                yield {"type": "message-metadata", "messageMetadata": metadata(event)}
                yield {"type": "abort", "reason": event.status}
            else:
                part: dict[str, Any] = {"type": "finish", "messageMetadata": metadata(event)}
                reason = FINISH_REASONS.get(str(event.finish_reason))
                if reason is not None:
                    part["finishReason"] = reason
                yield part
        elif isinstance(event, TurnFailed):
            yield from self._close()
            yield {"type": "error", "errorText": event.message or "engine error"}

    def _text_id(self, message_id: str) -> str:
        if self.text_id is None:  # resumed past the start part
            self.text_id = f"text_{message_id}"
        return self.text_id

    def _close(self) -> Iterable[dict[str, Any]]:
        if self.text_open:
            self.text_open = False
            assert self.text_id is not None
            yield {"type": "text-end", "id": self.text_id}
        for call in self.tools.values():
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except json.JSONDecodeError as e:
                yield {
                    "type": "tool-input-error",
                    "toolCallId": call["id"],
                    "toolName": call["name"],
                    "input": call["arguments"],
                    "errorText": f"the arguments are not JSON: {e.msg}",
                }
                continue
            yield {
                "type": "tool-input-available",
                "toolCallId": call["id"],
                "toolName": call["name"],
                "input": arguments,
            }
        self.tools = {}


def sse_part(part: dict[str, Any]) -> str:
    return f"data: {json.dumps(part, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def ui_stream(events: AsyncIterator[TurnEvent]) -> AsyncIterator[str]:
    """The SSE text of a reply's events, ending with `[DONE]`."""
    writer = PartWriter()
    async for event in events:
        for part in writer.parts(event):
            yield sse_part(part)
    yield "data: [DONE]\n\n"
