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

from app.turns.pipeline import TurnEvent

HEADER = "x-vercel-ai-ui-message-stream"
VERSION = "v1"
FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool-calls"}


def metadata(done: dict[str, Any]) -> dict[str, Any]:
    """kvchat's usage and timings of a reply, as the message's metadata."""
    return {"status": done.get("status"), "finishReason": done.get("finish_reason"),
            "usage": done.get("usage"), "timings": done.get("timings")}


class PartWriter:
    """Turns the events of one reply into UI message parts, in order."""

    def __init__(self) -> None:
        self.text_id: str | None = None
        self.text_open = False
        self.tools: dict[int, dict[str, Any]] = {}  # index -> {id, name, arguments}

    def parts(self, event: TurnEvent) -> Iterable[dict[str, Any]]:
        data = event.data
        if event.type == "start":
            self.text_id = f"text_{data['message_id']}"
            yield {"type": "start", "messageId": data["message_id"]}
            yield {"type": "start-step"}
        elif event.type == "delta":
            if not self.text_open:
                self.text_open = True
                yield {"type": "text-start", "id": self._text_id(data)}
            yield {"type": "text-delta", "id": self._text_id(data), "delta": data["text"]}
        elif event.type == "tool_call":
            call = self.tools.get(data["index"])
            if call is None:
                call = self.tools[data["index"]] = {
                    "id": data.get("id") or f"call_{data['message_id']}_{data['index']}",
                    "name": data.get("name") or "", "arguments": ""}
                yield {"type": "tool-input-start", "toolCallId": call["id"],
                       "toolName": call["name"]}
            if data.get("arguments"):
                call["arguments"] += data["arguments"]
                yield {"type": "tool-input-delta", "toolCallId": call["id"],
                       "inputTextDelta": data["arguments"]}
        elif event.type == "done":
            yield from self._close()
            yield {"type": "finish-step"}
            if data.get("status") in ("cancelled", "interrupted"):
                yield {"type": "message-metadata", "messageMetadata": metadata(data)}
                yield {"type": "abort", "reason": data.get("status")}
            else:
                part: dict[str, Any] = {"type": "finish", "messageMetadata": metadata(data)}
                reason = FINISH_REASONS.get(str(data.get("finish_reason")))
                if reason is not None:
                    part["finishReason"] = reason
                yield part
        elif event.type == "error":
            yield from self._close()
            yield {"type": "error", "errorText": str(data.get("message") or "engine error")}

    def _text_id(self, data: dict[str, Any]) -> str:
        if self.text_id is None:  # resumed past the start part
            self.text_id = f"text_{data['message_id']}"
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
                yield {"type": "tool-input-error", "toolCallId": call["id"],
                       "toolName": call["name"], "input": call["arguments"],
                       "errorText": f"the arguments are not JSON: {e.msg}"}
                continue
            yield {"type": "tool-input-available", "toolCallId": call["id"],
                   "toolName": call["name"], "input": arguments}
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
