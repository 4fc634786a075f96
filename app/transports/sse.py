"""Server-sent events: `data: <json>` lines, as OpenAI streams them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_unset=False)
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


def sse_response(
    stream: AsyncIterator[str], headers: dict[str, str] | None = None
) -> StreamingResponse:
    return StreamingResponse(
        stream, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})}
    )


async def until_disconnected(request: Request, interval: float = 0.05) -> None:
    """Returns when the client has gone (a non-streaming request has no other signal)."""
    while not await request.is_disconnected():
        await asyncio.sleep(interval)


async def run_unless_disconnected(
    request: Request, work: Awaitable[Any], on_disconnect: Callable[[], None]
) -> Any:
    """Await `work`; if the client leaves first, call `on_disconnect` (which makes `work`
    finish quickly, e.g. by stopping its generation) and still return work's result."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            on_disconnect()
        return await task
    finally:
        watcher.cancel()
