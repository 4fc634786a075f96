"""The Vercel AI SDK's chat endpoints (`useChat`, UI message stream protocol v1) against a
started server: every part is checked against the SDK's part shapes (its schema objects are
strict), and what the stream said is compared with what was stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvchat.app.transports.ui_stream import PartWriter
from kvchat.app.turns.events import TurnDelta, TurnDone, TurnFailed, TurnStarted, TurnToolCall
from kvchat_testing.service import Server

LONG = {"max_tokens": 2000, "temperature": 1.0, "seed": 3, "ignore_eos": True}
SHORT = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}

# The fields each part may have (required, optional): the SDK's uiMessageChunkSchema.
PARTS: dict[str, tuple[set[str], set[str]]] = {
    "start": (set(), {"messageId", "messageMetadata"}),
    "start-step": (set(), set()),
    "text-start": ({"id"}, {"providerMetadata"}),
    "text-delta": ({"id", "delta"}, {"providerMetadata"}),
    "text-end": ({"id"}, {"providerMetadata"}),
    "tool-input-start": (
        {"toolCallId", "toolName"},
        {"providerExecuted", "providerMetadata", "dynamic", "title", "_meta"},
    ),
    "tool-input-delta": ({"toolCallId", "inputTextDelta"}, set()),
    "tool-input-available": (
        {"toolCallId", "toolName", "input"},
        {"providerExecuted", "providerMetadata", "dynamic", "title", "_meta"},
    ),
    "tool-input-error": (
        {"toolCallId", "toolName", "input", "errorText"},
        {"providerExecuted", "providerMetadata", "dynamic", "title"},
    ),
    "finish-step": (set(), set()),
    "finish": (set(), {"finishReason", "messageMetadata"}),
    "abort": (set(), {"reason"}),
    "message-metadata": ({"messageMetadata"}, set()),
    "error": ({"errorText"}, set()),
}
FINISH_REASONS = {"stop", "length", "content-filter", "tool-calls", "error", "other"}


def check_part(part: dict[str, Any]) -> None:
    kind = part.get("type")
    assert kind in PARTS, f"not a UI message stream part: {part}"
    required, optional = PARTS[kind]
    keys = set(part) - {"type"}
    assert required <= keys, f"{kind} lacks {required - keys}: {part}"
    assert keys <= required | optional, f"{kind} has unknown fields {keys - required - optional}"
    for name in (
        "id",
        "delta",
        "toolCallId",
        "toolName",
        "inputTextDelta",
        "errorText",
        "messageId",
        "reason",
    ):
        if name in part:
            assert isinstance(part[name], str), (name, part)
    if "finishReason" in part:
        assert part["finishReason"] in FINISH_REASONS


def parse_sse(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """`data:` events of an SSE body: parts as dicts, `[DONE]` as the string."""
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            yield data
            return
        part = json.loads(data)
        check_part(part)
        yield part


@pytest.fixture(scope="module")
def server(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(dev_model, tmp_path_factory.mktemp("ui-chat")).start()
    yield server
    server.stop()


def user(text: str, id: str) -> dict[str, Any]:
    return {"id": id, "role": "user", "parts": [{"type": "text", "text": text}]}


def assistant(text: str, id: str) -> dict[str, Any]:
    return {
        "id": id,
        "role": "assistant",
        "parts": [{"type": "step-start"}, {"type": "text", "text": text}],
    }


def post(server: Server, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    with httpx.stream(
        "POST", f"{server.url}/v1/ui/chat", json=body, headers=server.headers(), timeout=120
    ) as r:
        if r.status_code != 200:
            r.read()
            return r, []
        return r, list(parse_sse(r.iter_lines()))


def chat_conversation(server: Server, chat_id: str) -> dict[str, Any]:
    """The conversation kvchat made for a useChat chat id."""
    page = httpx.get(f"{server.url}/v1/conversations?limit=100", headers=server.headers()).json()
    (conv,) = [c for c in page["data"] if c["metadata"].get("ui_chat_id") == chat_id]
    return conv  # type: ignore[no-any-return]


def tree(server: Server, conv_id: str) -> list[dict[str, Any]]:
    r = httpx.get(
        f"{server.url}/v1/conversations/{conv_id}/messages?all=true", headers=server.headers()
    )
    return r.json()["data"]  # type: ignore[no-any-return]


def text_of(parts: list[Any]) -> str:
    return "".join(p["delta"] for p in parts if isinstance(p, dict) and p["type"] == "text-delta")


def test_a_reply_streams_as_ui_message_parts_and_is_stored(server: Server) -> None:
    r, parts = post(
        server,
        {
            "id": "chat-text",
            "messages": [user("Hello there", "u1")],
            "trigger": "submit-message",
            **SHORT,
        },
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-vercel-ai-ui-message-stream"] == "v1"
    assert r.headers["content-type"].startswith("text/event-stream")
    assert parts[-1] == "[DONE]"
    kinds = [p["type"] for p in parts[:-1]]
    assert kinds[:3] == ["start", "start-step", "text-start"]
    assert kinds[-3:] == ["text-end", "finish-step", "finish"]
    assert set(kinds[3:-3]) == {"text-delta"}
    text_id = parts[2]["id"]
    assert all(p["id"] == text_id for p in parts[2:-3])
    finish = parts[-2]
    assert finish["finishReason"] == "length"
    usage = finish["messageMetadata"]["usage"]
    assert usage["completion_tokens"] == SHORT["max_tokens"]

    conv = chat_conversation(server, "chat-text")
    assert conv["title"] == "Hello there"
    stored = tree(server, conv["id"])
    assert (stored[0]["role"], stored[0]["content"]) == ("user", "Hello there")
    reply = stored[1]
    assert reply["id"] == parts[0]["messageId"]
    assert reply["content"] == text_of(parts)
    assert reply["usage"]["completion_tokens"] == usage["completion_tokens"]
    assert reply["status"] == "complete"


def test_the_next_request_continues_the_stored_branch_from_its_cache(server: Server) -> None:
    chat_id = "chat-next"
    _, first = post(server, {"id": chat_id, "messages": [user("First question", "c1")], **SHORT})
    reply_id, reply_text = first[0]["messageId"], text_of(first)
    history = [user("First question", "c1"), assistant(reply_text, reply_id)]
    r, second = post(
        server, {"id": chat_id, "messages": [*history, user("And then?", "c2")], **SHORT}
    )
    assert r.status_code == 200, r.text
    usage = second[-2]["messageMetadata"]["usage"]
    assert usage["cached_tokens"] > 0  # the first turn's KV was reused

    stored = tree(server, chat_conversation(server, chat_id)["id"])
    assert [m["role"] for m in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[2]["parent_id"] == reply_id  # nothing was stored twice
    assert stored[3]["id"] == second[0]["messageId"]

    # Editing the first message (useChat drops what followed it): a new root branch.
    r, edited = post(
        server, {"id": chat_id, "messages": [user("First question, edited", "c3")], **SHORT}
    )
    assert r.status_code == 200 and edited[-1] == "[DONE]"
    stored = tree(server, chat_conversation(server, chat_id)["id"])
    roots = [m for m in stored if m["parent_id"] is None]
    assert [m["content"] for m in roots] == ["First question", "First question, edited"]

    # Regenerating the first reply: a sibling of it.
    r, again = post(
        server,
        {
            "id": chat_id,
            "messages": [user("First question", "c1")],
            "trigger": "regenerate-message",
            "messageId": reply_id,
            **SHORT,
        },
    )
    assert r.status_code == 200, r.text
    stored = {m["id"]: m for m in tree(server, chat_conversation(server, chat_id)["id"])}
    regenerated = stored[again[0]["messageId"]]
    assert regenerated["parent_id"] == stored[reply_id]["parent_id"]
    assert regenerated["siblings"] == [reply_id, regenerated["id"]]


def test_history_the_server_has_not_seen_is_stored_before_the_turn(server: Server) -> None:
    chat_id = "chat-imported"
    messages = [
        {"id": "s", "role": "system", "parts": [{"type": "text", "text": "Be brief."}]},
        user("Earlier question", "i1"),
        assistant("An **earlier** answer.", "i2"),
        user("Now this", "i3"),
    ]
    r, parts = post(server, {"id": chat_id, "messages": messages, **SHORT})
    assert r.status_code == 200
    conv = chat_conversation(server, chat_id)
    assert conv["system"] == "Be brief."
    stored = tree(server, conv["id"])
    assert [(m["role"], m["content"]) for m in stored[:3]] == [
        ("user", "Earlier question"),
        ("assistant", "An **earlier** answer."),
        ("user", "Now this"),
    ]
    assert stored[3]["id"] == parts[0]["messageId"]
    assert stored[3]["usage"]["prompt_tokens"] > 0


def test_stop_stores_the_partial_reply_and_ends_the_stream_with_abort(server: Server) -> None:
    chat_id = "chat-stop"
    body = {"id": chat_id, "messages": [user("Tell me a long story", "s1")], **LONG}
    parts: list[Any] = []
    with httpx.stream(
        "POST", f"{server.url}/v1/ui/chat", json=body, headers=server.headers(), timeout=120
    ) as r:
        assert r.status_code == 200
        stream = parse_sse(r.iter_lines())
        for part in stream:
            parts.append(part)
            if len([p for p in parts if p["type"] == "text-delta"]) == 3:
                break
        # Resuming while it generates: the whole reply so far, from its start part.
        with httpx.stream(
            "GET",
            f"{server.url}/v1/ui/chat/{chat_id}/stream",
            headers=server.headers(),
            timeout=120,
        ) as resumed:
            assert resumed.status_code == 200
            assert resumed.headers["x-vercel-ai-ui-message-stream"] == "v1"
            again = parse_sse(resumed.iter_lines())
            assert next(again) == parts[0]  # start, with the same messageId
            stopped = httpx.post(
                f"{server.url}/v1/ui/chat/{chat_id}/stop", headers=server.headers()
            )
            assert stopped.json() == {"id": chat_id, "stopped": True}
            resumed_parts = [parts[0], *again]
        parts.extend(stream)
    assert parts[-1] == "[DONE]" and resumed_parts[-1] == "[DONE]"
    kinds = [p["type"] for p in parts[:-1]]
    assert kinds[-4:] == ["text-end", "finish-step", "message-metadata", "abort"]
    assert "finish" not in kinds
    metadata = parts[-3]["messageMetadata"]
    assert metadata["status"] == "cancelled"
    assert [p["type"] for p in resumed_parts[-3:-1]] == ["message-metadata", "abort"]
    assert text_of(resumed_parts) == text_of(parts)

    stored = tree(server, chat_conversation(server, chat_id)["id"])[-1]
    assert stored["id"] == parts[0]["messageId"]
    assert stored["status"] == "cancelled"
    assert stored["content"] == text_of(parts)
    assert 3 <= stored["usage"]["completion_tokens"] < LONG["max_tokens"]
    assert stored["usage"]["completion_tokens"] == metadata["usage"]["completion_tokens"]


def test_resume_answers_204_when_nothing_is_generating(server: Server) -> None:
    post(server, {"id": "chat-idle", "messages": [user("Hi", "r1")], **SHORT})
    for chat_id in ("chat-idle", "a-chat-never-seen"):
        r = httpx.get(f"{server.url}/v1/ui/chat/{chat_id}/stream", headers=server.headers())
        assert r.status_code == 204
        assert r.content == b""
    stop = httpx.post(f"{server.url}/v1/ui/chat/chat-idle/stop", headers=server.headers())
    assert stop.json() == {"id": "chat-idle", "stopped": False}  # nothing was running
    unknown = httpx.post(
        f"{server.url}/v1/ui/chat/a-chat-never-seen/stop", headers=server.headers()
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


def test_a_second_request_while_generating_is_busy(server: Server) -> None:
    chat_id = "chat-busy"
    body = {"id": chat_id, "messages": [user("Long one", "b1")], **LONG}
    with httpx.stream(
        "POST", f"{server.url}/v1/ui/chat", json=body, headers=server.headers(), timeout=120
    ) as r:
        stream = parse_sse(r.iter_lines())
        next(stream)
        busy, _ = post(
            server,
            {"id": chat_id, "messages": [user("Long one", "b1"), user("again", "b2")], **SHORT},
        )
        httpx.post(f"{server.url}/v1/ui/chat/{chat_id}/stop", headers=server.headers())
        list(stream)
    assert busy.status_code == 409
    assert busy.json()["error"]["code"] == "conversation_busy"
    stored = tree(server, chat_conversation(server, chat_id)["id"])
    assert [m["role"] for m in stored] == ["user", "assistant"]  # nothing stored by the 409


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"messages": []}, "messages", None),
        ({"messages": [assistant("hi", "a")]}, "messages", None),
        ({"messages": [user("", "u")]}, "messages", None),
        (
            {
                "messages": [
                    {
                        "id": "u",
                        "role": "user",
                        "parts": [{"type": "file", "url": "data:,x", "mediaType": "text/plain"}],
                    }
                ]
            },
            "messages.0.parts.0",
            "unsupported",
        ),
        (
            {"messages": [user("a", "u"), {"id": "s", "role": "system", "parts": []}]},
            "messages",
            None,
        ),
        ({"messages": [{"id": "x", "role": "wizard", "parts": []}]}, "messages.0.role", None),
        ({"messages": [user("a", "u")], "trigger": "guess"}, "trigger", None),
        ({"messages": [user("a", "u")], "max_tokens": 0}, "max_tokens", None),
        (
            {
                "messages": [
                    user("a", "u"),
                    {
                        "id": "t",
                        "role": "assistant",
                        "parts": [{"type": "tool-x", "toolCallId": "c"}],
                    },
                    user("b", "v"),
                ]
            },
            "messages.1",
            "unsupported",
        ),
    ],
)
def test_bad_requests_are_typed_errors_and_store_nothing(
    server: Server, body: dict[str, Any], param: str, code: str | None
) -> None:
    chat_id = f"chat-bad-{param}-{code}"
    r = httpx.post(
        f"{server.url}/v1/ui/chat", json={"id": chat_id, **body}, headers=server.headers()
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["code"] == code
    page = httpx.get(f"{server.url}/v1/conversations?limit=100", headers=server.headers()).json()
    assert all(c["metadata"].get("ui_chat_id") != chat_id for c in page["data"])


def test_a_conversation_id_of_someone_else_is_not_found(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/ui/chat",
        json={"id": "conv_doesnotexist", "messages": [user("a", "u")]},
        headers=server.headers(),
    )
    assert r.status_code == 404
    assert (
        httpx.post(f"{server.url}/v1/ui/chat", json={"id": "x", "messages": []}).status_code == 401
    )


def test_tool_call_events_become_tool_input_parts() -> None:
    """The turn pipeline's tool_call events (a name first, then argument fragments) as parts;
    a random-weight model does not call tools on its own, so the events are given here."""
    writer = PartWriter()
    m = "msg_1"
    events = [
        TurnStarted(m, "msg_0"),
        TurnDelta(m, "Let me look.", 0),
        TurnToolCall(m, 0, "call_a", "get_weather", ""),
        TurnToolCall(m, 0, None, None, '{"city": '),
        TurnToolCall(m, 0, None, None, '"Paris"}'),
        TurnToolCall(m, 1, "call_b", "broken", "{not json"),
        TurnDone(
            m,
            "complete",
            "tool_calls",
            {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14, "cached_tokens": 0},
            {"ttft_ms": 1.0, "total_ms": 2.0},
        ),
    ]
    parts = [part for event in events for part in writer.parts(event)]
    for part in parts:
        check_part(part)
    assert [p["type"] for p in parts] == [
        "start",
        "start-step",
        "text-start",
        "text-delta",
        "tool-input-start",
        "tool-input-delta",
        "tool-input-delta",
        "tool-input-start",
        "tool-input-delta",
        "text-end",
        "tool-input-available",
        "tool-input-error",
        "finish-step",
        "finish",
    ]
    assert parts[4] == {
        "type": "tool-input-start",
        "toolCallId": "call_a",
        "toolName": "get_weather",
    }
    assert parts[10] == {
        "type": "tool-input-available",
        "toolCallId": "call_a",
        "toolName": "get_weather",
        "input": {"city": "Paris"},
    }
    assert parts[11]["toolCallId"] == "call_b" and parts[11]["input"] == "{not json"
    assert parts[-1]["finishReason"] == "tool-calls"


def test_an_engine_error_is_an_error_part() -> None:
    writer = PartWriter()
    m = "msg_1"
    parts = [
        p
        for e in (TurnStarted(m, None), TurnDelta(m, "x", 0), TurnFailed(m, "engine_error", "boom"))
        for p in writer.parts(e)
    ]
    for part in parts:
        check_part(part)
    assert [p["type"] for p in parts][-2:] == ["text-end", "error"]
    assert parts[-1]["errorText"] == "boom"


def test_an_engine_fault_mid_reply_ends_the_stream_with_an_error_part(
    dev_model: Path, tmp_path: Path
) -> None:
    """An injected engine fault (as the chat completions test does): text parts, then an
    `error` part and [DONE]; the reply is stored with status error and the text streamed."""
    from fastapi.testclient import TestClient

    from kvchat.app.main import create_app
    from kvchat_testing.app_service import service_settings
    from kvchat_testing.faults import StepFault

    app = create_app(service_settings(dev_model, tmp_path, None))
    with TestClient(app) as client:
        state = app.state.kvchat
        _, key = client.portal.call(state.store.create_key, "k")
        StepFault(state.runtime.engine_client.engine, after=3)
        headers = {"Authorization": f"Bearer {key}"}
        body = {"id": "chat-fault", "messages": [user("Hello", "f1")], **LONG}
        with client.stream("POST", "/v1/ui/chat", headers=headers, json=body) as r:
            assert r.status_code == 200
            parts = list(parse_sse(r.iter_lines()))
        (conv,) = client.get("/v1/conversations", headers=headers).json()["data"]
        stored = client.get(f"/v1/conversations/{conv['id']}/messages", headers=headers).json()[
            "data"
        ][-1]
    assert parts[-1] == "[DONE]"
    kinds = [p["type"] for p in parts[:-1]]
    assert kinds[-2:] == ["text-end", "error"] and "text-delta" in kinds
    assert "finish" not in kinds and "abort" not in kinds
    assert stored["id"] == parts[0]["messageId"]
    assert stored["status"] == "error"
    # What was streamed before the fault is kept with the error.
    streamed = "".join(p["delta"] for p in parts[:-1] if p["type"] == "text-delta")
    assert streamed and stored["content"] == streamed
