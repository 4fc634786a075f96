"""RequestChecks: what every request passes before a route sees it (pure ASGI, in front of the
routes, so one place covers them all):

- a body over `max_request_bytes` is a 413 `request_too_large`: on its Content-Length before a
  byte of it is read, or, chunked, as soon as the bytes received pass the cap;
- a body over AUTH_FIRST_BYTES, or chunked, needs a valid key before it is read (401
  otherwise): nobody without a key makes the server take in megabytes;
- a JSON body must pass `kvchat.app.schemas.json_input` (nesting, valid Unicode without NUL): a 400
  naming the field, before validation;
- the URL's path and query must hold no NUL (400 naming the query parameter).

Refusals that leave a body unread close the connection (`Connection: close`), so the client
cannot go on sending it. A body that passes is handed to the app as it was received; after it,
the app's `receive` is the client's (a disconnect still reaches the routes)."""

from __future__ import annotations

import json
from email.message import Message as MIMEMessage
from urllib.parse import parse_qsl

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvchat.app.deps import bearer_token
from kvchat.app.errors import APIError, invalid_api_key, invalid_request, request_too_large
from kvchat.app.schemas.json_input import JSONInputError, parse_json

AUTH_FIRST_BYTES = 64 * 1024  # bodies larger (or of unknown size) are read only with a key
THREAD_CHECK_BYTES = 64 * 1024  # larger bodies are parsed and checked off the event loop

_CLOSE = {"Connection": "close"}


class RequestChecks:
    def __init__(self, app: ASGIApp, max_request_bytes: int) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        url_error = _url_error(scope)
        if url_error is not None:
            if scope["type"] == "websocket":  # refused at the handshake (403)
                await send({"type": "websocket.close", "code": 1008})
            else:
                await url_error.response()(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not chunked and (length is None or length == "0"):
            await self.app(scope, receive, send)  # no body
            return
        size = None if chunked or length is None else int(length)  # the server checked it
        if size is not None and size > self.max_request_bytes:
            await self._refuse(request_too_large(self.max_request_bytes), scope, receive, send)
            return
        if (size is None or size > AUTH_FIRST_BYTES) and not await _has_valid_key(scope, headers):
            await self._refuse(invalid_api_key(), scope, receive, send)
            return
        try:
            body = await self._read_body(receive)
        except _ClientLeft:
            return  # nobody to answer
        if body is None:
            await self._refuse(request_too_large(self.max_request_bytes), scope, receive, send)
            return
        if body and _is_json(headers):
            error = (
                await run_in_threadpool(_json_error, body)
                if len(body) > THREAD_CHECK_BYTES
                else _json_error(body)
            )
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body; None once it passes the cap (the rest left unread)."""
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientLeft
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_request_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer without reading (the rest of) the body, and close the connection."""
        error.headers = {**error.headers, **_CLOSE}
        await error.response()(scope, receive, send)


class _ClientLeft(Exception):
    """The client disconnected before its body was read."""


def _json_error(body: bytes) -> APIError | None:
    """The 400 for a body that parses but fails the JSON checks; None when it passes or is not
    JSON at all (the route's validation answers that, as it always has)."""
    try:
        parse_json(body)
    except JSONInputError as e:
        return invalid_request(e.message, e.param, e.code)
    except json.JSONDecodeError:
        return None
    return None


def _is_json(headers: Headers) -> bool:
    """Whether FastAPI reads the body as JSON: no content type, or application/json or
    application/*+json (the test FastAPI itself makes)."""
    content_type = headers.get("content-type")
    if not content_type:
        return True
    message = MIMEMessage()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def _url_error(scope: Scope) -> APIError | None:
    """A 400 for NUL in the path or a query parameter (uvicorn decodes `%00` to NUL; Postgres
    cannot compare text holding it)."""
    if "\x00" in scope["path"]:
        return invalid_request("The URL path holds U+0000 (NUL).", code="invalid_unicode")
    query = scope.get("query_string", b"")
    if b"%00" not in query:
        return None
    for name, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if "\x00" in value or "\x00" in name:
            param = name.replace("\x00", "\\u0000")
            return invalid_request(
                f"Invalid value for '{param}': the text holds U+0000 (NUL), "
                "which is not accepted in text.",
                param,
                "invalid_unicode",
            )
    return None


async def _has_valid_key(scope: Scope, headers: Headers) -> bool:
    token = bearer_token(headers.get("authorization"))
    if token is None:
        return False
    store = scope["app"].state.kvchat.store
    return await store.authenticate(token) is not None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's receive: the body read here, then the client's own (its disconnect)."""
    delivered = False

    async def replayed() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
