"""How the OpenAPI document describes a Server-Sent Events answer (`text/event-stream`).

As FastAPI documents its own SSE routes (`EventSourceResponse`), and as Open API 3.2 puts it:
the media type's `itemSchema` is the schema of each event, `{data, event, id, retry}`, not of
the body as a whole (schema-checking clients such as schemathesis read it so). kvchat's events
carry one `data` each (a JSON object, or `[DONE]` where the route says), some an `event` name."""

from __future__ import annotations

from typing import Any

EVENT_STREAM = "text/event-stream"


def event_schema(data: str) -> dict[str, Any]:
    """The schema of one event; `data` says what its data is."""
    return {
        "type": "object",
        "properties": {
            "data": {"type": "string", "description": data},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer", "minimum": 0},
        },
        "required": ["data"],
    }


def event_stream(
    description: str,
    data: str = "A JSON object.",
    status: int = 200,
) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route that answers (or, with `stream`, may answer) with an event
    stream: its media type, with the schema of each event."""
    return {
        status: {
            "description": description,
            "content": {EVENT_STREAM: {"itemSchema": event_schema(data)}},
        }
    }
