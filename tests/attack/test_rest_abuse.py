"""The hand fuzzing of the campaign, kept: requests that once produced a 500, or were taken
whole, against a started server on SQLite and on Postgres + Redis. Integers no column or
sampler can hold, JSON nested deeper than the pipeline recurses, lone surrogates, settings
valid alone but not together, bodies far past any chat request; and keys sent under query
names that decode to `access_token` never reach the log."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import select
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from kvchat_testing.attack_servers import (
    BACKENDS,
    assert_openai_error,
    create_key,
    database_of,
    started_server,
    wait_until,
)
from kvchat_testing.service import Server

HUGE = 2**70  # past every 64-bit column and generator seed
BIG_BODY = 64 * 2**20  # a 4,096-token context is some 16 KB of text: this is no chat request


@pytest.fixture(scope="module", params=BACKENDS)
def server(
    request: pytest.FixtureRequest, dev_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    with started_server(dev_model, tmp_path_factory.mktemp("data"), request.param) as server:
        yield server


@pytest.fixture
def api(server: Server) -> Server:
    """The server, seen through an admin key of an owner of its own: what one test stores
    (and breaks) is not in another's listings."""
    key = create_key(database_of(server), f"attack-{uuid.uuid4().hex[:8]}", admin=True)
    return dataclasses.replace(server, key=key)  # the same process and log


def send(
    server: Server,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | str | None = None,
    **kw: Any,
) -> httpx.Response:
    headers = {**server.headers(), "Content-Type": "application/json", **kw.pop("headers", {})}
    content = raw if raw is not None else None if body is None else json.dumps(body)
    return httpx.request(
        method, f"{server.url}{path}", headers=headers, content=content, timeout=120, **kw
    )


def new_conversation(server: Server) -> str:
    r = send(server, "POST", "/v1/conversations", {})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def refused(response: httpx.Response, param: str | None = None, status: int = 400) -> None:
    """A typed refusal: `status`, OpenAI's error shape, naming `param` when given."""
    assert response.status_code == status, (response.status_code, response.text[:300])
    error = assert_openai_error(response.json())
    if param is not None:
        assert error["param"] == param, error


def refused_or_served(response: httpx.Response, param: str) -> None:
    """400 naming `param`, or served (the value is one the server can take as it is)."""
    if response.status_code != 200:
        refused(response, param)


TURN = {"content": "hello", "max_tokens": 2}
CHAT = {"model": "dev", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
SETTINGS = ("max_context_tokens", "max_kv_tokens", "max_tool_result_tokens", "max_summary_tokens")


@pytest.mark.parametrize("field", SETTINGS)
def test_a_setting_past_64_bits_is_refused_naming_it(api: Server, field: str) -> None:
    refused(send(api, "POST", "/v1/conversations", {field: HUGE}), field)
    conv = new_conversation(api)
    refused(send(api, "PATCH", f"/v1/conversations/{conv}", {field: HUGE}), field)
    refused(send(api, "PUT", f"/v1/admin/sessions/{conv}", {field: HUGE}), field)
    defaults = send(api, "GET", "/v1/admin/defaults").json()
    try:
        refused(send(api, "PUT", "/v1/admin/defaults", {field: HUGE}), field)
    finally:  # the other tests run on the server's own defaults, whatever happened here
        send(api, "PUT", "/v1/admin/defaults", defaults)
    assert send(api, "POST", f"/v1/conversations/{conv}/messages", TURN).status_code == 200


@pytest.mark.parametrize("field, value", [("seed", HUGE), ("seed", -HUGE), ("top_k", HUGE)])
def test_a_sampling_integer_past_64_bits_is_refused_or_served(
    api: Server, field: str, value: int
) -> None:
    conv = new_conversation(api)
    refused_or_served(
        send(api, "POST", f"/v1/conversations/{conv}/messages", {**TURN, field: value}), field
    )
    refused_or_served(send(api, "POST", "/v1/chat/completions", {**CHAT, field: value}), field)
    refused_or_served(
        send(api, "POST", "/v1/chat/completions", {**CHAT, field: value, "stream": True}), field
    )


def nested(depth: int, inner: str = "1") -> str:
    return '{"a":' * depth + inner + "}" * depth


@pytest.mark.parametrize("depth", [500, 900, 50_000])
def test_deeply_nested_json_is_refused_or_served(api: Server, depth: int) -> None:
    """Nesting that the JSON parser takes but the pipeline recursed over (hundreds deep), and
    nesting the parser refuses (50,000): never a 500."""
    conv = new_conversation(api)
    bodies = [
        ("/v1/conversations", '{"metadata": ' + nested(depth) + "}"),
        ("/v1/conversations", '{"metadata": {"a": ' + "[" * depth + "]" * depth + "}}"),
        (
            f"/v1/conversations/{conv}/messages",
            '{"content": "x", "max_tokens": 2, "tools": [{"type": "function", "function": '
            '{"name": "f", "parameters": ' + nested(depth) + "}}]}",
        ),
        (
            f"/v1/conversations/{conv}/messages",
            '{"content": "x", "max_tokens": 2, "response_format": {"type": "json_schema", '
            '"json_schema": {"name": "f", "schema": '
            + '{"items":' * depth
            + "{}"
            + "}" * depth
            + "}}}",
        ),
        (
            "/v1/chat/completions",
            '{"model": "dev", "max_tokens": 2, "messages": ' + "[" * depth + "]" * depth + "}",
        ),
    ]
    for path, raw in bodies:
        r = send(api, "POST", path, raw=raw)
        assert r.status_code < 500, (path, depth, r.text[:300])
        if r.status_code != 200:
            refused(r)
    r = send(api, "GET", f"/v1/conversations/{conv}/messages")
    assert r.status_code == 200, r.text[:300]


SURROGATES = [
    # (where, path, raw JSON with a lone surrogate escaped in it)
    (
        "message content",
        "/v1/conversations/{conv}/messages",
        '{"content": "a\\ud800b", "max_tokens": 2}',
    ),
    (
        "message name",
        "/v1/conversations/{conv}/messages",
        '{"content": "x", "name": "\\udfff", "max_tokens": 2}',
    ),
    (
        "streamed message",
        "/v1/conversations/{conv}/messages",
        '{"content": "\\udbff", "max_tokens": 2, "stream": true}',
    ),
    ("system prompt", "/v1/conversations", '{"system": "be \\ud800 brief"}'),
    ("metadata key", "/v1/conversations", '{"metadata": {"\\ud800": 1}}'),
    ("metadata value", "/v1/conversations", '{"metadata": {"k": "\\udc00"}}'),
    ("conversation title", "/v1/conversations/{conv}", '{"title": "\\ud800"}'),
    (
        "chat completion",
        "/v1/chat/completions",
        '{"model": "dev", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\udc00"}]}',
    ),
    (
        "tool call id",
        "/v1/chat/completions",
        '{"model": "dev", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}, '
        '{"role": "assistant", "tool_calls": [{"id": "\\ud800", "type": "function", "function": '
        '{"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "\\ud800", '
        '"content": "1"}]}',
    ),
    (
        "tokenize",
        "/v1/tokenize",
        '{"model": "dev", "messages": [{"role": "user", "content": "\\ud800"}]}',
    ),
]


@pytest.mark.parametrize(
    "path, raw", [(p, r) for _, p, r in SURROGATES], ids=[name for name, _, _ in SURROGATES]
)
def test_a_lone_surrogate_is_refused_or_served_and_what_is_stored_reads_back(
    api: Server, path: str, raw: str
) -> None:
    conv = new_conversation(api)
    method = "PATCH" if path == "/v1/conversations/{conv}" else "POST"
    r = send(api, method, path.format(conv=conv), raw=raw)
    assert r.status_code < 500, r.text[:300]
    if r.status_code != 200:
        refused(r)
    for read in (
        f"/v1/conversations/{conv}",
        f"/v1/conversations/{conv}/messages",
        "/v1/conversations?limit=100",
    ):
        got = send(api, "GET", read)
        assert got.status_code == 200, (read, got.text[:300])


def test_settings_valid_alone_but_not_together_are_refused_and_the_conversation_still_works(
    api: Server,
) -> None:
    # The campaign's case: each value fits the server's defaults (high 0.8), not together.
    conv = new_conversation(api)
    r = send(api, "PATCH", f"/v1/conversations/{conv}", {"low_watermark": 0.6})
    assert r.status_code == 200, r.text
    r = send(api, "PATCH", f"/v1/conversations/{conv}", {"high_watermark": 0.3})
    assert r.status_code == 400, r.text[:300]
    assert assert_openai_error(r.json())["param"] in ("high_watermark", "low_watermark")
    # A value that does not fit the defaults is refused when it is sent alone too.
    r = send(api, "PATCH", f"/v1/conversations/{conv}", {"low_watermark": 0.9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "low_watermark", r.text[:300]
    # Nothing was written: the conversation keeps its settings and takes turns.
    got = send(api, "GET", f"/v1/conversations/{conv}").json()
    assert (got["low_watermark"], got["high_watermark"]) == (0.6, None)
    r = send(api, "POST", f"/v1/conversations/{conv}/messages", TURN)
    assert r.status_code == 200, r.text[:300]


def post_big(server: Server, path: str, size: int, chunked: bool) -> tuple[int, Any]:
    """POST a JSON body of `size` bytes over a plain socket, as curl does with a large body:
    `Expect: 100-continue`, the body only once the server asks for it, and no more of it once
    the server has answered. Returns the final status and JSON body."""
    head, tail = b'{"title": "big", "metadata": {"blob": "', b'"}}'
    pieces = [head, *([b"a" * 2**20] * ((size - len(head) - len(tail)) // 2**20))]
    pieces.append(b"a" * (size - sum(map(len, pieces)) - len(tail)) + tail)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        reader = sock.makefile("rb")
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.key}"
            f"\r\nContent-Type: application/json\r\n{framing}\r\nExpect: 100-continue"
            "\r\n\r\n".encode()
        )
        status, headers = read_head(reader)
        if status == 100:
            try:
                for piece in pieces:
                    if select.select([sock], [], [], 0)[0]:
                        break  # answered already: stop sending
                    sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                else:
                    if chunked:
                        sock.sendall(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server closed after answering; the answer is read below
            status, headers = read_head(reader)
        body = reader.read(int(headers.get("content-length", "0")))
    return status, json.loads(body) if body else None


def read_head(reader: Any) -> tuple[int, dict[str, str]]:
    """An HTTP response's status and headers (lower-case names)."""
    status_line = reader.readline()
    assert status_line, "the server closed the connection without an answer"
    status = int(status_line.split()[1])
    headers = {}
    for line in iter(reader.readline, b"\r\n"):
        assert line, "the server closed the connection in the middle of its answer"
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_far_past_any_chat_request_is_refused_with_413(api: Server, chunked: bool) -> None:
    status, body = post_big(api, "/v1/conversations", BIG_BODY, chunked)
    assert status == 413, (status, str(body)[:300])
    assert_openai_error(body)
    listed = send(api, "GET", "/v1/conversations?limit=100").json()["data"]
    assert all(c["title"] != "big" for c in listed)  # nothing was stored


SECRET_QUERIES = [
    "access_token",
    "access%5Ftoken",
    "%61ccess_token",
    "access%255Ftoken",
    "ACCESS_TOKEN",
    "api%5Fkey",
    "x&access%5ftoken",
]


def test_keys_in_query_parameters_never_reach_the_log(api: Server) -> None:
    key = api.key  # made for this test: never printed by the server
    assert key is not None
    conv = new_conversation(api)

    async def websocket(name: str) -> None:
        url = f"ws://127.0.0.1:{api.port}/v1/conversations/{conv}/ws?{name}={key}"
        try:
            async with websockets.connect(url, open_timeout=60) as ws:
                await ws.send(json.dumps({"type": "ping"}))
                await ws.recv()
        except websockets.ConnectionClosed:
            pass  # a name the server does not read the key from: refused, still logged

    for name in SECRET_QUERIES:
        httpx.get(f"{api.url}/healthz?{name}={key}", timeout=60)
        asyncio.run(websocket(name))
    marker = uuid.uuid4().hex
    httpx.get(f"{api.url}/healthz?marker={marker}", timeout=60)
    # Log lines come in order: once the marker is out, every line before it is too.
    wait_until(lambda: marker in "".join(api.output), "the server logged the marker")
    leaked = [line for line in api.output if key in line]
    assert not leaked, leaked
