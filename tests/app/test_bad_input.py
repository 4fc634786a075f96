"""Bad input, row by row: numbers past their range, nesting too deep, text that is not valid
Unicode (lone surrogates, NUL), bodies and frames too large. Each row is answered with a typed
error naming the field (never a 500, a dropped socket or a stall); after it the server still
answers and nothing stored changed. In process on SQLite and Postgres (the REST routes and
the WebSocket frames), then against a started server for what only a real socket shows:
bodies refused before they are read, and WebSocket frames over the limits."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from kvchat_testing.app_service import Service
from kvchat_testing.service import Server

# The documented ranges and depths (README, "Bad input").
INT32_MAX = 2**31 - 1  # token counts and budgets (Postgres INTEGER columns)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seed
MAX_JSON_DEPTH = 100  # any request body or WebSocket frame
MAX_SCHEMA_DEPTH = 64  # a response_format schema or a tool's parameters

USER = [{"role": "user", "content": "hi"}]
REPLY = {"max_tokens": 2, "temperature": 0}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "dev", "messages": USER, "max_tokens": 1, **fields}


def respond(**fields: Any) -> dict[str, Any]:
    return {"model": "dev", "input": "hi", "max_output_tokens": 1, **fields}


def ui_chat(**fields: Any) -> dict[str, Any]:
    return {
        "id": "{conv}",
        "messages": [{"id": "m1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}],
        **fields,
    }


def nested_schema(depth: int) -> dict[str, Any]:
    """An object schema whose document is exactly `depth` levels deep (each object level is
    two: properties, then the property's schema)."""
    schema: dict[str, Any] = {"type": "string"}
    levels = 1
    if depth % 2 == 0:
        schema, levels = {"type": "array", "items": schema}, 2
    while levels + 2 <= depth:
        schema = {"type": "object", "properties": {"a": schema}}
        levels += 2
    return schema


def tool(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def deep_object(depth: int) -> str:
    """JSON text of an object nested `depth` levels (built as text: no recursion)."""
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


def deep_array(depth: int) -> str:
    return "[" * depth + "]" * depth


@dataclass(frozen=True)
class Row:
    """One bad request: `body` is a JSON value (sent with ASCII escapes, so lone surrogates
    arrive as JSON escapes), or `str`/`bytes` sent as they are. `{conv}` in the path or body
    is the module's conversation."""

    id: str
    method: str
    path: str
    body: Any
    status: int
    code: str | None
    param: str | None
    admin: bool = False


SCHEMA = "response_format.json_schema.schema"
MESSAGES = "/v1/conversations/{conv}/messages"
RESPONSES = "/v1/responses"
TOO_DEEP = MAX_SCHEMA_DEPTH + 8  # deeper than a schema may be, shallower than a body may be
assert TOO_DEEP + 4 < MAX_JSON_DEPTH

ROWS = [
    # -- 6: numbers past their range ----------------------------------------------------------
    Row("chat-seed-2^64", "POST", "/v1/chat/completions", chat(seed=2**64), 400, None, "seed"),
    Row(
        "chat-seed-below-int64",
        "POST",
        "/v1/chat/completions",
        chat(seed=INT64_MIN - 1),
        400,
        None,
        "seed",
    ),
    Row("chat-seed-1.2e24", "POST", "/v1/chat/completions", chat(seed=1.2e24), 400, None, "seed"),
    Row(
        "chat-stream-seed",
        "POST",
        "/v1/chat/completions",
        chat(seed=2**64, stream=True),
        400,
        None,
        "seed",
    ),
    Row(
        "chat-max-completion-tokens",
        "POST",
        "/v1/chat/completions",
        chat(max_completion_tokens=2**64),
        400,
        None,
        "max_completion_tokens",
    ),
    Row(
        "message-seed",
        "POST",
        MESSAGES,
        {"content": "hi", **REPLY, "seed": 2**64},
        400,
        None,
        "seed",
    ),
    Row(
        "message-max-tokens",
        "POST",
        MESSAGES,
        {"content": "hi", "max_tokens": 2**64},
        400,
        None,
        "max_tokens",
    ),
    Row(
        "message-top-k",
        "POST",
        MESSAGES,
        {"content": "hi", **REPLY, "top_k": 2**64},
        400,
        None,
        "top_k",
    ),
    Row(
        "regenerate-seed",
        "POST",
        "/v1/conversations/{conv}/regenerate",
        {**REPLY, "seed": 2**64},
        400,
        None,
        "seed",
    ),
    Row("ui-chat-seed", "POST", "/v1/ui/chat", ui_chat(seed=2**64), 400, None, "seed"),
    Row(
        "create-max-kv-tokens-int64",
        "POST",
        "/v1/conversations",
        {"max_kv_tokens": 2**63},
        400,
        None,
        "max_kv_tokens",
    ),
    Row(
        "create-max-context-tokens-int32",
        "POST",
        "/v1/conversations",
        {"max_context_tokens": INT32_MAX + 1},
        400,
        None,
        "max_context_tokens",
    ),
    Row(
        "create-max-tool-result-tokens",
        "POST",
        "/v1/conversations",
        {"max_tool_result_tokens": 2**64},
        400,
        None,
        "max_tool_result_tokens",
    ),
    Row(
        "create-max-summary-tokens",
        "POST",
        "/v1/conversations",
        {"max_summary_tokens": INT32_MAX + 1},
        400,
        None,
        "max_summary_tokens",
    ),
    Row(
        "patch-max-kv-tokens",
        "PATCH",
        "/v1/conversations/{conv}",
        {"max_kv_tokens": 2**64},
        400,
        None,
        "max_kv_tokens",
    ),
    Row(
        "admin-session-max-context-tokens",
        "PUT",
        "/v1/admin/sessions/{conv}",
        {"max_context_tokens": 2**64},
        400,
        None,
        "max_context_tokens",
        admin=True,
    ),
    Row(
        "admin-defaults-max-kv-tokens",
        "PUT",
        "/v1/admin/defaults",
        {"max_kv_tokens": INT32_MAX + 1},
        400,
        None,
        "max_kv_tokens",
        admin=True,
    ),
    Row(
        "number-of-5000-digits",
        "POST",
        "/v1/chat/completions",
        '{"model": "dev", "messages": [], "seed": ' + "9" * 5000 + "}",
        400,
        "invalid_json",
        None,
    ),
    # -- 8: nesting too deep ------------------------------------------------------------------
    Row(
        "chat-schema-200-deep",
        "POST",
        "/v1/chat/completions",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": nested_schema(400)},
            }
        ),
        400,
        "json_too_deep",
        "response_format",
    ),
    Row(
        "chat-tool-parameters-200-deep",
        "POST",
        "/v1/chat/completions",
        chat(tools=[tool(nested_schema(400))]),
        400,
        "json_too_deep",
        "tools",
    ),
    Row(
        "chat-schema-past-its-depth",
        "POST",
        "/v1/chat/completions",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": nested_schema(TOO_DEEP)},
            }
        ),
        400,
        "schema_too_deep",
        SCHEMA,
    ),
    Row(
        "chat-tool-parameters-past-their-depth",
        "POST",
        "/v1/chat/completions",
        chat(tools=[tool(nested_schema(TOO_DEEP))]),
        400,
        "schema_too_deep",
        "tools.0.function.parameters",
    ),
    Row(
        "message-tool-parameters-past-their-depth",
        "POST",
        MESSAGES,
        {"content": "hi", **REPLY, "tools": [tool(nested_schema(TOO_DEEP))]},
        400,
        "schema_too_deep",
        "tools.0.function.parameters",
    ),
    Row(
        "create-metadata-200-deep",
        "POST",
        "/v1/conversations",
        '{"metadata": ' + deep_object(200) + "}",
        400,
        "json_too_deep",
        "metadata",
    ),
    Row(
        "body-50000-deep",
        "POST",
        "/v1/chat/completions",
        deep_array(50_000),
        400,
        "json_too_deep",
        None,
    ),
    Row(
        "body-just-too-deep",
        "POST",
        "/v1/chat/completions",
        deep_array(MAX_JSON_DEPTH + 1),
        400,
        "json_too_deep",
        None,
    ),
    # -- 9: text that is not valid Unicode ----------------------------------------------------
    Row(
        "chat-content-surrogate",
        "POST",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "x\ud800"}]),
        400,
        "invalid_unicode",
        "messages.0.content",
    ),
    Row(
        "chat-tool-description-surrogate",
        "POST",
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "f", "description": "\udfff"}}]),
        400,
        "invalid_unicode",
        "tools.0.function.description",
    ),
    Row(
        "chat-stop-surrogate",
        "POST",
        "/v1/chat/completions",
        chat(stop=["ok", "\ud83d"]),
        400,
        "invalid_unicode",
        "stop.1",
    ),
    Row(
        "message-content-surrogate",
        "POST",
        MESSAGES,
        {"content": "x\ud800", **REPLY},
        400,
        "invalid_unicode",
        "content",
    ),
    Row(
        "message-content-part-surrogate",
        "POST",
        MESSAGES,
        {"content": [{"type": "text", "text": "x\ud800"}], **REPLY},
        400,
        "invalid_unicode",
        "content.0.text",
    ),
    Row(
        "message-name-surrogate",
        "POST",
        MESSAGES,
        {"content": "x", "name": "a\udc00", **REPLY},
        400,
        "invalid_unicode",
        "name",
    ),
    Row(
        "tool-result-id-surrogate",
        "POST",
        MESSAGES,
        {"role": "tool", "content": "5", "tool_call_id": "call\ud800", **REPLY},
        400,
        "invalid_unicode",
        "tool_call_id",
    ),
    Row(
        "create-title-surrogate",
        "POST",
        "/v1/conversations",
        {"title": "t\ud800"},
        400,
        "invalid_unicode",
        "title",
    ),
    Row(
        "create-system-surrogate",
        "POST",
        "/v1/conversations",
        {"system": "\ud800 be brief"},
        400,
        "invalid_unicode",
        "system",
    ),
    Row(
        "create-metadata-key-surrogate",
        "POST",
        "/v1/conversations",
        {"metadata": {"k\ud800": 1}},
        400,
        "invalid_unicode",
        "metadata.k\\ud800",
    ),
    Row(
        "create-metadata-value-surrogate",
        "POST",
        "/v1/conversations",
        {"metadata": {"k": ["ok", "v\ud800"]}},
        400,
        "invalid_unicode",
        "metadata.k.1",
    ),
    Row(
        "patch-title-surrogate",
        "PATCH",
        "/v1/conversations/{conv}",
        {"title": "\ud800"},
        400,
        "invalid_unicode",
        "title",
    ),
    Row(
        "ui-chat-text-surrogate",
        "POST",
        "/v1/ui/chat",
        {
            **ui_chat(),
            "messages": [
                {"id": "m1", "role": "user", "parts": [{"type": "text", "text": "x\ud800"}]}
            ],
        },
        400,
        "invalid_unicode",
        "messages.0.parts.0.text",
    ),
    Row(
        "tokenize-content-surrogate",
        "POST",
        "/v1/tokenize",
        {"messages": [{"role": "user", "content": "x\ud800"}]},
        400,
        "invalid_unicode",
        "messages.0.content",
    ),
    Row(
        "create-title-nul",
        "POST",
        "/v1/conversations",
        {"title": "a\x00b"},
        400,
        "invalid_unicode",
        "title",
    ),
    Row(
        "patch-title-nul",
        "PATCH",
        "/v1/conversations/{conv}",
        {"title": "a\x00b"},
        400,
        "invalid_unicode",
        "title",
    ),
    Row(
        "create-metadata-nul",
        "POST",
        "/v1/conversations",
        {"metadata": {"k": "a\x00"}},
        400,
        "invalid_unicode",
        "metadata.k",
    ),
    Row(
        "message-content-nul",
        "POST",
        MESSAGES,
        {"content": "a\x00b", **REPLY},
        400,
        "invalid_unicode",
        "content",
    ),
    Row(
        "body-not-utf8", "POST", MESSAGES, b'{"content": "\xff\xfe"}', 400, "invalid_unicode", None
    ),
    Row(
        "body-encoded-surrogate",
        "POST",
        MESSAGES,
        b'{"content": "\xed\xa0\x80"}',
        400,
        "invalid_unicode",
        None,
    ),
    Row(
        "query-nul",
        "GET",
        "/v1/conversations/{conv}/messages?leaf=%00",
        None,
        400,
        "invalid_unicode",
        "leaf",
    ),
    Row("path-nul", "GET", "/v1/conversations/%00", None, 400, "invalid_unicode", None),
    # -- the Responses and Conversations APIs (issue 21) ---------------------------------------
    Row("responses-seed-2^64", "POST", RESPONSES, respond(seed=2**64), 400, None, "seed"),
    Row(
        "responses-max-output-tokens",
        "POST",
        RESPONSES,
        respond(max_output_tokens=2**64),
        400,
        None,
        "max_output_tokens",
    ),
    Row(
        "responses-stream-max-output-tokens",
        "POST",
        RESPONSES,
        respond(max_output_tokens=INT32_MAX + 1, stream=True),
        400,
        None,
        "max_output_tokens",
    ),
    Row(
        "responses-schema-200-deep",
        "POST",
        RESPONSES,
        respond(
            text={"format": {"type": "json_schema", "name": "s", "schema": nested_schema(400)}}
        ),
        400,
        "json_too_deep",
        "text",
    ),
    Row(
        "responses-schema-past-its-depth",
        "POST",
        RESPONSES,
        respond(
            text={"format": {"type": "json_schema", "name": "s", "schema": nested_schema(TOO_DEEP)}}
        ),
        400,
        "schema_too_deep",
        "text.format.schema",
    ),
    Row(
        "responses-tool-parameters-past-their-depth",
        "POST",
        RESPONSES,
        respond(tools=[{"type": "function", "name": "f", "parameters": nested_schema(TOO_DEEP)}]),
        400,
        "schema_too_deep",
        "tools.0.parameters",
    ),
    Row(
        "responses-input-surrogate",
        "POST",
        RESPONSES,
        respond(input="x\ud800"),
        400,
        "invalid_unicode",
        "input",
    ),
    Row(
        "responses-item-text-surrogate",
        "POST",
        RESPONSES,
        respond(input=[{"role": "user", "content": [{"type": "input_text", "text": "x\ud800"}]}]),
        400,
        "invalid_unicode",
        "input.0.content.0.text",
    ),
    Row(
        "responses-instructions-nul",
        "POST",
        RESPONSES,
        respond(instructions="a\x00b"),
        400,
        "invalid_unicode",
        "instructions",
    ),
    Row(
        "responses-metadata-surrogate",
        "POST",
        RESPONSES,
        respond(metadata={"k": "v\ud800"}),
        400,
        "invalid_unicode",
        "metadata.k",
    ),
    Row(
        "responses-output-for-no-call",
        "POST",
        RESPONSES,
        respond(
            previous_response_id="{resp}",
            input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}],
        ),
        400,
        None,
        "input.0.call_id",
    ),
    Row(
        "responses-conversation-and-previous",
        "POST",
        RESPONSES,
        respond(previous_response_id="{resp}", conversation="{conv}"),
        400,
        None,
        "conversation",
    ),
    Row(
        "responses-input-items-limit",
        "GET",
        "/v1/responses/{resp}/input_items?limit=1000",
        None,
        400,
        None,
        "limit",
    ),
    Row(
        "responses-resume-starting-after",
        "GET",
        "/v1/responses/{resp}?stream=true&starting_after=-1",
        None,
        400,
        None,
        "starting_after",
    ),
    Row(
        "items-text-surrogate",
        "POST",
        "/v1/conversations/{conv}/items",
        {"items": [{"role": "user", "content": "x\ud800"}]},
        400,
        "invalid_unicode",
        "items.0.content",
    ),
    Row(
        "items-bad-role",
        "POST",
        "/v1/conversations/{conv}/items",
        {"items": [{"role": "robot", "content": "x"}]},
        400,
        None,
        "items.0.role",
    ),
    Row(
        "items-output-for-no-call",
        "POST",
        "/v1/conversations/{conv}/items",
        {"items": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
        400,
        None,
        "items.0.call_id",
    ),
    Row(
        "create-items-bad-arguments",
        "POST",
        "/v1/conversations",
        {"items": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
        400,
        None,
        "items.0.arguments",
    ),
    Row(
        "items-list-order",
        "GET",
        "/v1/conversations/{conv}/items?order=sideways",
        None,
        400,
        None,
        "order",
    ),
    # -- 10: a body over the cap, refused on its Content-Length --------------------------------
    Row(
        "body-over-the-cap",
        "POST",
        MESSAGES,
        {"content": "x" * (4 * 2**20), "max_tokens": 0},
        413,
        "request_too_large",
        None,
    ),
]


@dataclass(frozen=True)
class FrameRow:
    """One bad WebSocket frame: a JSON value (sent with ASCII escapes) or raw text."""

    id: str
    frame: Any
    code: str
    param: str | None


FRAME_ROWS = [
    FrameRow(
        "message-seed",
        {"type": "message", "content": "hi", **REPLY, "seed": 2**64},
        "invalid_request",
        "seed",
    ),
    FrameRow(
        "message-seed-below-int64",
        {"type": "message", "content": "hi", **REPLY, "seed": INT64_MIN - 1},
        "invalid_request",
        "seed",
    ),
    FrameRow(
        "regenerate-seed", {"type": "regenerate", **REPLY, "seed": 2**64}, "invalid_request", "seed"
    ),
    FrameRow(
        "resume-offset",
        {"type": "resume", "message_id": "{reply}", "offset": 2**64},
        "invalid_request",
        "offset",
    ),
    FrameRow(
        "message-max-tokens",
        {"type": "message", "content": "hi", "max_tokens": 2**63},
        "invalid_request",
        "max_tokens",
    ),
    FrameRow(
        "number-of-5000-digits", '{"type": "ping", "n": ' + "9" * 5000 + "}", "invalid_json", None
    ),
    FrameRow("50000-deep", deep_array(50_000), "invalid_json", None),
    FrameRow(
        "tools-200-deep",
        '{"type": "message", "content": "hi", "tools": [' + deep_object(200) + "]}",
        "invalid_json",
        "tools",
    ),
    FrameRow(
        "tool-parameters-past-their-depth",
        {
            "type": "message",
            "content": "hi",
            **REPLY,
            "tool_choice": "required",
            "tools": [tool(nested_schema(TOO_DEEP))],
        },
        "schema_too_deep",
        "tools.0.function.parameters",
    ),
    FrameRow(
        "content-surrogate",
        {"type": "message", "content": "x\ud800", **REPLY},
        "invalid_request",
        "content",
    ),
    FrameRow(
        "content-part-surrogate",
        {"type": "message", **REPLY, "content": [{"type": "text", "text": "\udbff"}]},
        "invalid_request",
        "content.0.text",
    ),
    FrameRow("type-surrogate", {"type": "ping\ud800"}, "invalid_request", "type"),
    FrameRow(
        "content-nul",
        {"type": "message", "content": "a\x00", **REPLY},
        "invalid_request",
        "content",
    ),
]


def encode(body: Any) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    return json.dumps(body).encode()  # ASCII escapes: "\ud800" arrives as the JSON escape


def fill(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, str):
        for name, text in names.items():
            value = value.replace("{" + name + "}", text)
        return value
    if isinstance(value, bytes):
        return value
    if isinstance(value, dict):
        return {k: fill(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, names) for v in value]
    return value


@dataclass
class World:
    """The module's conversation (one exchange, so regenerate and resume have a reply) and
    an admin key."""

    service: Service
    conv: str
    reply: str
    admin: str

    @property
    def names(self) -> dict[str, str]:
        return {
            "conv": self.conv,
            "reply": self.reply,
            "resp": "resp_" + self.reply.removeprefix("msg_"),
        }

    def snapshot(self) -> Any:
        """Everything a bad request could have changed."""
        s = self.service
        conv = s.get(f"/v1/conversations/{self.conv}")
        messages = s.get(f"/v1/conversations/{self.conv}/messages", params={"all": "true"})
        listing = s.get("/v1/conversations", params={"limit": 100})
        defaults = s.get("/v1/admin/defaults", key=self.admin)
        for r in (conv, messages, listing, defaults):
            assert r.status_code == 200, r.text  # the server still answers
        return conv.json(), messages.json(), listing.json(), defaults.json()


@pytest.fixture(scope="module")
def world(service: Service) -> World:
    _, admin = service.client.portal.call(lambda: service.state.store.create_key("ops", admin=True))
    conv = service.post("/v1/conversations", {"title": "bad input"}).json()["id"]
    r = service.post(f"/v1/conversations/{conv}/messages", {"content": "hello", **REPLY})
    assert r.status_code == 200, r.text
    return World(service, conv, r.json()["id"], admin)


def assert_error(r: httpx.Response, row: Row) -> None:
    assert r.status_code == row.status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (row.code, row.param), error
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_a_bad_request_is_answered_and_changes_nothing(world: World, row: Row) -> None:
    s = world.service
    before = world.snapshot()
    body = fill(row.body, world.names)
    headers = s.headers(world.admin if row.admin else None)
    if body is not None:
        headers["content-type"] = "application/json"
    r = s.client.request(
        row.method,
        fill(row.path, world.names),
        headers=headers,
        content=None if body is None else encode(body),
    )
    assert_error(r, row)
    assert world.snapshot() == before


@pytest.mark.parametrize("row", FRAME_ROWS, ids=[r.id for r in FRAME_ROWS])
def test_a_bad_frame_gets_an_error_frame_and_the_socket_stays_open(
    world: World, row: FrameRow
) -> None:
    s = world.service
    before = world.snapshot()
    frame = fill(row.frame, world.names)
    with s.client.websocket_connect(
        f"/v1/conversations/{world.conv}/ws", headers=s.headers()
    ) as ws:
        ws.send_text(frame if isinstance(frame, str) else json.dumps(frame))
        error = ws.receive_json()
        assert (error["type"], error["code"], error.get("param")) == (
            "error",
            row.code,
            row.param,
        ), error
        ws.send_json({"type": "ping"})
        assert ws.receive_json() == {"type": "pong"}
    assert world.snapshot() == before


def test_nul_in_a_websocket_url_is_refused_at_the_handshake(world: World) -> None:
    from starlette.websockets import WebSocketDisconnect

    s = world.service
    before = world.snapshot()
    for url in ("/v1/conversations/%00/ws", f"/v1/conversations/{world.conv}/ws?x=%00"):
        with (
            pytest.raises(WebSocketDisconnect) as refused,
            s.client.websocket_connect(url, headers=s.headers()) as ws,
        ):
            ws.receive_json()
        assert refused.value.code == 1008
    assert world.snapshot() == before


def test_nesting_up_to_the_limits_is_accepted(service: Service) -> None:
    metadata = json.loads(deep_object(MAX_JSON_DEPTH - 1))  # the body is MAX_JSON_DEPTH deep
    r = service.post("/v1/conversations", {"metadata": metadata})
    assert r.status_code == 200, r.text
    assert service.get(f"/v1/conversations/{r.json()['id']}").json()["metadata"] == metadata
    schema = nested_schema(MAX_SCHEMA_DEPTH)
    r = service.post(
        "/v1/chat/completions",
        chat(
            max_tokens=2,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            tools=[tool(schema)],
        ),
    )
    assert r.status_code == 200, r.text
    r = service.post(
        "/v1/chat/completions",
        chat(tools=[tool(nested_schema(MAX_SCHEMA_DEPTH))], tool_choice="required", max_tokens=2),
    )
    assert r.status_code == 200, r.text


def test_the_documented_limits_are_the_codes() -> None:
    from kvchat.app import ranges as limits
    from kvchat.app.schemas.json_input import MAX_JSON_DEPTH as json_depth
    from kvchat.app.turns.structured import MAX_SCHEMA_DEPTH as schema_depth

    assert (limits.INT32_MAX, limits.INT64_MIN, limits.INT64_MAX) == (
        INT32_MAX,
        INT64_MIN,
        INT64_MAX,
    )
    assert (json_depth, schema_depth) == (MAX_JSON_DEPTH, MAX_SCHEMA_DEPTH)


def test_the_seeds_of_n_choices_wrap_within_int64(service: Service) -> None:
    """n choices take seeds seed, seed+1, ...: from the top of int64 they wrap to its bottom,
    so every accepted seed gives n valid seeds, and the same seeds as asked for directly."""
    from kvchat.app.schemas.chat import SamplingFields

    fields = SamplingFields(seed=INT64_MAX)
    assert [fields.choice_seed(i) for i in range(3)] == [INT64_MAX, INT64_MIN, INT64_MIN + 1]
    body = chat(max_tokens=4, temperature=1.0, seed=INT64_MAX, n=2)
    r = service.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    alone = service.post(
        "/v1/chat/completions", chat(max_tokens=4, temperature=1.0, seed=INT64_MIN)
    ).json()
    assert alone["choices"][0]["message"]["content"] == texts[1]


# -- a started server: bodies refused before they are read, WebSocket frames over the limits ---

MAX_BODY = 256 * 1024
MAX_FRAME = 16 * 1024


@pytest.fixture(scope="module")
def server(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        dev_model,
        tmp_path_factory.mktemp("bad-input"),
        env={
            "KVCHAT_MAX_REQUEST_BYTES": str(MAX_BODY),
            "KVCHAT_WS_MAX_FRAME_BYTES": str(MAX_FRAME),
        },
    ).start()
    assert server.key is not None
    try:
        yield server
    finally:
        server.stop()


def exchange(
    server: Server,
    head: dict[str, str],
    sent: bytes,
    path: str = "/v1/conversations",
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """Send a POST's headers and only `sent` of its body, then read the answer: it comes
    without the rest of the body ever being sent, or the read times out (a safety net)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        lines = [
            f"POST {path} HTTP/1.1",
            f"Host: 127.0.0.1:{server.port}",
            "Content-Type: application/json",
            *(f"{k}: {v}" for k, v in head.items()),
        ]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + sent)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"closed without an answer: {data!r}"
            data += chunk
        header, _, rest = data.partition(b"\r\n\r\n")
        status_line, *header_lines = header.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
        while len(rest) < int(headers["content-length"]):
            chunk = sock.recv(65536)
            assert chunk
            rest += chunk
        return int(status_line.split()[1]), headers, json.loads(rest)


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_bodies_over_the_cap_and_unauthenticated_big_bodies_are_refused_unread(
    server: Server,
) -> None:
    key = {"Authorization": f"Bearer {server.key}"}
    piece = b'{"title": "' + b"x" * 1000
    # Content-Length over the cap: 413 on the headers, with or without a key.
    for auth in (key, {}):
        status, headers, body = exchange(server, {**auth, "Content-Length": "52428800"}, piece)
        assert (status, body["error"]["code"]) == (413, "request_too_large"), body
        assert headers["connection"] == "close" and "x-request-id" in headers
    # Under the cap but big: no (or a wrong) key is a 401 before the body is read.
    for auth in ({}, {"Authorization": "Bearer sk-wrong"}):
        status, _, body = exchange(server, {**auth, "Content-Length": str(MAX_BODY - 10)}, piece)
        assert (status, body["error"]["code"]) == (401, "invalid_api_key"), body
    # Chunked (no Content-Length): the key is checked first, then the bytes are counted as
    # they come and the 413 answered while the client is still sending.
    status, _, body = exchange(server, {"Transfer-Encoding": "chunked"}, chunk(piece))
    assert (status, body["error"]["code"]) == (401, "invalid_api_key"), body
    over = chunk(piece) + b"".join(chunk(b"x" * 32768) for _ in range(MAX_BODY // 32768 + 1))
    status, _, body = exchange(server, {**key, "Transfer-Encoding": "chunked"}, over)
    assert (status, body["error"]["code"]) == (413, "request_too_large"), body
    # A chunked body under the cap reaches the route whole.
    title = "chunked " + "y" * 70_000
    whole = json.dumps({"title": title[:500], "metadata": {"note": title}}).encode()
    parts = b"".join(chunk(whole[i : i + 4096]) for i in range(0, len(whole), 4096))
    status, _, body = exchange(
        server, {**key, "Transfer-Encoding": "chunked"}, parts + b"0\r\n\r\n"
    )
    assert status == 200 and body["metadata"] == {"note": title}, body
    # And a body just under the cap with its Content-Length, too.
    status, _, body = exchange(server, {**key, "Content-Length": str(len(whole))}, whole)
    assert status == 200 and body["title"] == title[:500]
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_bad_websocket_frames_keep_the_socket_and_oversized_ones_close_it(
    server: Server,
) -> None:
    conv = httpx.post(f"{server.url}/v1/conversations", headers=server.headers(), json={}).json()[
        "id"
    ]
    url = f"ws://127.0.0.1:{server.port}/v1/conversations/{conv}/ws"
    bad = [
        (
            json.dumps({"type": "message", "content": "x\ud800", "max_tokens": 2}),
            "invalid_request",
            "content",
        ),
        (
            json.dumps({"type": "message", "content": "hi", "seed": 2**64}),
            "invalid_request",
            "seed",
        ),
        (deep_array(MAX_FRAME // 2 - 1), "invalid_json", None),
        ('{"type": "ping", "n": ' + "9" * 5000 + "}", "invalid_json", None),
        # Over the app's frame limit, under the protocol's: read, refused, socket kept.
        (
            json.dumps({"type": "message", "content": "x" * (2 * MAX_FRAME)}),
            "frame_too_large",
            None,
        ),
    ]

    async def drive() -> int | None:
        async with websockets.connect(
            url, additional_headers=server.headers(), max_size=None
        ) as ws:
            for frame, code, param in bad:
                await ws.send(frame)
                error = json.loads(await asyncio.wait_for(ws.recv(), 60))
                assert (error["type"], error["code"], error.get("param")) == (
                    "error",
                    code,
                    param,
                ), error
                await ws.send(json.dumps({"type": "ping"}))
                assert json.loads(await asyncio.wait_for(ws.recv(), 60)) == {"type": "pong"}
            # Over the protocol's limit (four frame limits): closed with 1009, not buffered.
            await ws.send(json.dumps({"type": "message", "content": "x" * (5 * MAX_FRAME)}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 60)
            return closed.value.rcvd.code if closed.value.rcvd else None

    assert asyncio.run(drive()) == 1009
    messages = httpx.get(
        f"{server.url}/v1/conversations/{conv}/messages", headers=server.headers()
    ).json()["data"]
    assert messages == []
