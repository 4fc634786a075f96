"""A reverse proxy that records every request a client sends to a started server, with the
status and body it got back: what a third-party front end (Open WebUI) really sends, in the
test that drives it, instead of what its documentation says it sends.

It runs in a thread of the test process (uvicorn on a free loopback port) and streams responses
through as they come, one chunk behind, so server-sent events still arrive one by one and an
exchange is recorded before its client has the response's last bytes."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from kvchat_testing.service import free_port

# Hop-by-hop headers, and the lengths the proxy's own framing replaces.
_DROPPED_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclass(frozen=True)
class Exchange:
    """One request through the proxy: its JSON body (None when it had none or was not JSON),
    the status, and the response body as text (a stream's events joined, as they were sent;
    what had come when the client went away, if it did)."""

    method: str
    path: str
    body: Any
    status: int
    response: str

    @property
    def response_json(self) -> Any:
        return json.loads(self.response)

    def error_message(self) -> str:
        """The `error.message` of an error response, else its text."""
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            return str(self.response_json["error"]["message"])
        return self.response[:500]


@dataclass
class RecordingProxy:
    upstream: str
    port: int = field(default_factory=free_port)
    exchanges: list[Exchange] = field(default_factory=list)
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def recorded(self, method: str, path: str) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if e.method == method and e.path == path]

    def start(self, timeout: float = 30.0) -> RecordingProxy:
        app = Starlette(
            routes=[Route("/{path:path}", self._forward, methods=["GET", "POST", "DELETE"])]
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the recording proxy did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(30)

    async def _forward(self, request: Request) -> StreamingResponse:
        content = await request.body()
        try:
            body = json.loads(content) if content else None
        except ValueError:
            body = None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED_HEADERS}
        headers["accept-encoding"] = "identity"  # recorded bodies are text, not gzip
        # One client per request: the proxy's loop is uvicorn's, started in its thread.
        client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(600.0))
        upstream = await client.send(
            client.build_request(
                request.method,
                request.url.path,
                params=request.query_params,
                headers=headers,
                content=content,
            ),
            stream=True,
        )
        received: list[bytes] = []
        recorded = False

        def record() -> None:
            nonlocal recorded
            recorded = True
            text = b"".join(received).decode("utf-8", "replace")
            exchange = Exchange(request.method, request.url.path, body, upstream.status_code, text)
            with self._lock:
                self.exchanges.append(exchange)

        async def relay() -> AsyncIterator[bytes]:
            # One chunk behind upstream, so the exchange is recorded before the client has
            # its last bytes: a client that saw a reply end finds it in `exchanges`.
            last: bytes | None = None
            try:
                async for chunk in upstream.aiter_raw():
                    received.append(chunk)
                    if last is not None:
                        yield last
                    last = chunk
                record()
                if last is not None:
                    yield last
            finally:
                if not recorded:  # the client went away mid-stream: what came so far
                    record()
                await upstream.aclose()
                await client.aclose()

        response_headers = {
            k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_HEADERS
        }
        return StreamingResponse(relay(), upstream.status_code, response_headers)


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll `predicate` until it is true, else fail saying `what` was awaited."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.25)
