"""The conversation WebSocket: frames, stop within a step, resume after a drop, the grace
period, bad frames, limits. In process (TestClient), and against a started server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from kvchat_testing.app_service import Service, service_settings
from kvchat_testing.sampling_knobs import check_sampling_knobs
from kvchat_testing.service import Server

LONG = {"max_tokens": 2000, "temperature": 1.0, "seed": 1, "ignore_eos": True}


@pytest.fixture(scope="module")
def ws_service(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from kvchat.app.main import create_app

    settings = service_settings(dev_model, tmp_path_factory.mktemp("ws"), None)
    settings.ws_grace_period = 600.0  # a dropped reply waits for its client (no race)
    settings.ws_max_connections_per_key = 3
    app = create_app(settings)
    with TestClient(app) as client:
        state = app.state.kvchat
        _, alice = client.portal.call(lambda: state.store.create_key("alice"))
        _, bob = client.portal.call(lambda: state.store.create_key("bob"))
        yield Service(client, state, alice, bob, "sqlite")


def conversation(service: Service, key: str | None = None) -> str:
    return str(service.post("/v1/conversations", {}, key=key).json()["id"])


def socket(service: Service, conv: str, key: str | None = None) -> Any:
    return service.client.websocket_connect(
        f"/v1/conversations/{conv}/ws", headers=service.headers(key)
    )


def until(ws: Any, kind: str) -> list[dict[str, Any]]:
    frames = []
    while True:
        frame = ws.receive_json()
        frames.append(frame)
        if frame["type"] in (kind, "error") and (frame["type"] == kind or kind != "error"):
            return frames


def stored(service: Service, conv: str) -> list[dict[str, Any]]:
    return service.get(f"/v1/conversations/{conv}/messages").json()["data"]  # type: ignore[no-any-return]


def test_a_turn_streams_start_deltas_and_done(ws_service: Service) -> None:
    conv = conversation(ws_service)
    with socket(ws_service, conv) as ws:
        ws.send_json(
            {"type": "message", "content": "Hello socket", "max_tokens": 12, "temperature": 0}
        )
        frames = until(ws, "done")
    assert frames[0]["type"] == "start"
    deltas = [f for f in frames if f["type"] == "delta"]
    assert [d["offset"] for d in deltas] == [
        sum(len(d["text"]) for d in deltas[:i]) for i in range(len(deltas))
    ]
    done = frames[-1]
    assert done["message_id"] == frames[0]["message_id"]
    assert done["finish_reason"] in ("stop", "length")
    assert set(done["usage"]) >= {"prompt_tokens", "completion_tokens", "cached_tokens"}
    assert (
        done["timings"]["ttft_ms"] > 0 and done["timings"]["total_ms"] >= done["timings"]["ttft_ms"]
    )
    reply = stored(ws_service, conv)[-1]
    assert reply["id"] == done["message_id"] and reply["status"] == "complete"
    assert reply["content"] == "".join(d["text"] for d in deltas)


def test_stop_ends_the_reply_within_one_step(
    ws_service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the engine had generated when the stop reached it, read as the abort is queued
    # (deltas already on their way to the client when it sent the stop say nothing about
    # the engine: on a loaded machine the client reads them late).
    engine = ws_service.state.runtime.engine_client.async_engine
    at_abort: list[int] = []
    real_abort = engine.abort

    def abort(request_id: str, reason: str = "cancelled") -> None:
        seq = engine.engine._seqs.get(request_id)
        at_abort.append(seq.num_output_tokens if seq is not None else -1)
        real_abort(request_id, reason)

    monkeypatch.setattr(engine, "abort", abort)
    conv = conversation(ws_service)
    with socket(ws_service, conv) as ws:
        ws.send_json({"type": "message", "content": "Talk for long", **LONG})
        frames = until(ws, "delta")
        frames += [ws.receive_json() for _ in range(3)]
        ws.send_json({"type": "stop"})
        frames += until(ws, "done")
    done = frames[-1]
    assert done["finish_reason"] == "cancelled"
    # Tokens the engine produced after the stop reached it: at most one decode step's worth
    # (the step under way, and the token its sampling had already emitted).
    assert len(at_abort) == 1 and at_abort[0] >= 4
    reply = stored(ws_service, conv)[-1]
    assert reply["usage"]["completion_tokens"] - at_abort[0] <= 2
    assert reply["status"] == "cancelled"
    assert reply["usage"]["completion_tokens"] < LONG["max_tokens"]
    assert reply["content"] == "".join(f["text"] for f in frames if f["type"] == "delta")


def test_resume_after_a_drop_gets_exactly_the_missing_text(ws_service: Service) -> None:
    conv = conversation(ws_service)
    seen = ""
    with socket(ws_service, conv) as ws:
        ws.send_json(
            {"type": "message", "content": "A long answer please", **{**LONG, "max_tokens": 60}}
        )
        start = ws.receive_json()
        while len(seen) < 5:
            frame = ws.receive_json()
            if frame["type"] == "delta":
                assert frame["offset"] == len(seen)
                seen += frame["text"]
    # The socket dropped; the reply goes on. A new socket resumes from what was seen.
    with socket(ws_service, conv) as ws:
        ws.send_json({"type": "resume", "message_id": start["message_id"], "offset": len(seen)})
        frames = until(ws, "done")
    rest = [f for f in frames if f["type"] == "delta"]
    assert not rest or rest[0]["offset"] == len(seen)
    text = seen + "".join(f["text"] for f in rest)
    reply = stored(ws_service, conv)[-1]
    assert frames[-1]["finish_reason"] == "length" and reply["status"] == "complete"
    assert reply["content"] == text  # no gap, no repeat
    # Resuming a finished reply mid-way gives the remainder from the store.
    with socket(ws_service, conv) as ws:
        ws.send_json({"type": "resume", "message_id": reply["id"], "offset": 3})
        again = until(ws, "done")
    assert "".join(f["text"] for f in again if f["type"] == "delta") == reply["content"][3:]


def test_a_drop_without_resume_is_cancelled_after_the_grace_period(ws_service: Service) -> None:
    settings = ws_service.state.settings
    conv = conversation(ws_service)
    try:
        settings.ws_grace_period = 0.2
        with socket(ws_service, conv) as ws:
            ws.send_json({"type": "message", "content": "Keep going", **LONG})
            until(ws, "delta")
        deadline = time.monotonic() + 60  # a safety net: the grace period ends the reply
        while stored(ws_service, conv)[-1]["status"] == "generating":
            assert time.monotonic() < deadline, "the reply was never stopped"
            time.sleep(0.05)
    finally:
        settings.ws_grace_period = 600.0
    reply = stored(ws_service, conv)[-1]
    assert reply["status"] == "cancelled"
    assert reply["usage"]["completion_tokens"] < LONG["max_tokens"]


def test_a_client_back_within_the_grace_period_keeps_the_reply(ws_service: Service) -> None:
    """The reply of a dropped socket has no watcher and its grace period running; a socket
    that resumes it stops the clock, and the reply runs to its end."""
    conv = conversation(ws_service)
    with socket(ws_service, conv) as ws:
        ws.send_json({"type": "message", "content": "Go on", **{**LONG, "max_tokens": 40}})
        start = ws.receive_json()
    turn = ws_service.state.turns.running(conv)
    if turn is not None:  # still generating (the usual case): watched by nobody now
        deadline = time.monotonic() + 60
        while turn.watchers or not (turn.in_grace_period or turn.is_done):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    with socket(ws_service, conv) as ws:
        ws.send_json({"type": "resume", "message_id": start["message_id"], "offset": 0})
        frames = until(ws, "done")
    assert frames[-1]["status"] == "complete" and frames[-1]["finish_reason"] == "length"


def test_bad_frames_get_error_frames_and_the_socket_stays_usable(ws_service: Service) -> None:
    conv = conversation(ws_service)
    with socket(ws_service, conv) as ws:
        cases = [
            ("{nope", "invalid_json"),
            ("[1, 2]", "unknown_type"),
            (json.dumps({"type": "dance"}), "unknown_type"),
            (json.dumps({"type": "message"}), "invalid_request"),
            (json.dumps({"type": "message", "content": "x", "temperature": 9}), "invalid_request"),
            (json.dumps({"type": "resume", "message_id": "msg_nope", "offset": 0}), "not_found"),
            (json.dumps({"type": "message", "content": "x" * 300_000}), "frame_too_large"),
            (json.dumps({"type": "regenerate"}), "invalid_request"),
            (json.dumps({"type": "typing", "text": 5}), "invalid_request"),
        ]
        for text, code in cases:
            ws.send_text(text)
            frame = ws.receive_json()
            assert frame["type"] == "error" and frame["code"] == code, (text[:40], frame)
        ws.send_json({"type": "ping"})
        assert ws.receive_json() == {"type": "pong"}
        ws.send_json({"type": "message", "content": "Still here?", "max_tokens": 4})
        assert until(ws, "done")[-1]["type"] == "done"


def test_a_second_message_while_generating_is_busy(ws_service: Service) -> None:
    conv = conversation(ws_service)
    with socket(ws_service, conv) as ws:
        ws.send_json({"type": "message", "content": "First", **LONG})
        until(ws, "delta")
        ws.send_json({"type": "message", "content": "Second"})
        frames = until(ws, "error")
        assert frames[-1]["code"] == "busy"
        ws.send_json({"type": "stop"})
        until(ws, "done")


def test_keys_and_owners(ws_service: Service) -> None:
    conv = conversation(ws_service)
    with (
        pytest.raises(WebSocketDisconnect) as closed,
        ws_service.client.websocket_connect(
            f"/v1/conversations/{conv}/ws", headers={"Authorization": "Bearer nope"}
        ) as ws,
    ):
        ws.receive_json()
    assert closed.value.code == 4401
    with (
        pytest.raises(WebSocketDisconnect) as closed,
        socket(ws_service, conv, ws_service.other_key) as ws,
    ):
        assert ws.receive_json()["code"] == "not_found"
        ws.receive_json()
    assert closed.value.code == 4404
    # Browsers pass the key as a query parameter.
    with ws_service.client.websocket_connect(
        f"/v1/conversations/{conv}/ws?access_token={ws_service.key}"
    ) as ws:
        ws.send_json({"type": "ping"})
        assert ws.receive_json()["type"] == "pong"
    with (
        pytest.raises(WebSocketDisconnect) as closed,
        ws_service.client.websocket_connect(
            f"/v1/conversations/{conv}/ws",
            headers={**ws_service.headers(), "Origin": "http://evil.example"},
        ) as ws,
    ):
        ws.receive_json()
    assert closed.value.code == 4403


def test_connections_per_key_are_limited(ws_service: Service) -> None:
    conv = conversation(ws_service)
    with (
        socket(ws_service, conv) as a,
        socket(ws_service, conv) as b,
        socket(ws_service, conv) as c,
    ):
        for ws in (a, b, c):
            ws.send_json({"type": "ping"})
            assert ws.receive_json()["type"] == "pong"
        with pytest.raises(WebSocketDisconnect) as closed, socket(ws_service, conv) as d:
            assert d.receive_json()["code"] == "too_many_connections"
            d.receive_json()
        assert closed.value.code == 4429


@pytest.fixture(scope="module")
def server(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(dev_model, tmp_path_factory.mktemp("ws-server")).start()
    try:
        yield server
    finally:
        server.stop()


def test_two_sockets_stream_independently_against_a_started_server(server: Server) -> None:
    import httpx

    convs = [
        httpx.post(f"{server.url}/v1/conversations", headers=server.headers(), json={}).json()["id"]
        for _ in range(2)
    ]

    async def chat(conv: str, text: str) -> tuple[str, dict[str, Any]]:
        url = f"ws://127.0.0.1:{server.port}/v1/conversations/{conv}/ws"
        async with websockets.connect(url, additional_headers=server.headers()) as ws:
            await ws.send(
                json.dumps({"type": "message", "content": text, "max_tokens": 24, "temperature": 0})
            )
            deltas = ""
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "delta":
                    deltas += frame["text"]
                if frame["type"] == "done":
                    return deltas, frame

    async def both() -> list[tuple[str, dict[str, Any]]]:
        return list(
            await asyncio.gather(chat(convs[0], "First socket"), chat(convs[1], "Second socket"))
        )

    results = asyncio.run(both())
    for conv, (text, done) in zip(convs, results):
        reply = httpx.get(
            f"{server.url}/v1/conversations/{conv}/messages", headers=server.headers()
        ).json()["data"][-1]
        assert reply["id"] == done["message_id"] and reply["content"] == text


def test_a_revoked_key_closes_its_open_socket_at_the_next_message(ws_service: Service) -> None:
    state, portal = ws_service.state, ws_service.client.portal
    record, key = portal.call(lambda: state.store.create_key("soon-revoked", owner="alice"))
    conv = conversation(ws_service, key)
    with socket(ws_service, conv, key) as ws:
        ws.send_json({"type": "message", "content": "Before", "max_tokens": 3})
        assert until(ws, "done")[-1]["status"] == "complete"
        portal.call(lambda: state.store.revoke_key(record.id))
        ws.send_json({"type": "ping"})
        assert ws.receive_json() == {"type": "pong"}  # no turn: nothing to refuse yet
        ws.send_json({"type": "message", "content": "After", "max_tokens": 3})
        frame = ws.receive_json()
        assert frame["type"] == "error" and frame["code"] == "invalid_api_key"
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
    assert closed.value.code == 4401
    # nothing was stored for the refused message
    messages = ws_service.get(f"/v1/conversations/{conv}/messages").json()["data"]
    assert [m["content"] for m in messages if m["role"] == "user"] == ["Before"]


def _faults() -> list[tuple[BaseException, str]]:
    from kvchat.app.store import StaleFence
    from kvchat.history import ContextLengthExceeded, HistoryPolicyError, InvalidHistoryError
    from kvchat.inference.engine.async_engine import EngineDeadError
    from kvchat.inference.errors import InvalidRequestError
    from kvchat.inference.text.chat_template import ChatTemplateError

    return [
        (ChatTemplateError("the template refused it"), "invalid_request"),
        (EngineDeadError("the engine stopped"), "service_unavailable"),
        (InvalidRequestError("max_tokens too big", "max_tokens"), "invalid_request"),
        (ContextLengthExceeded(900, 512, 4), "context_length_exceeded"),
        (InvalidHistoryError("an orphan tool result"), "invalid_request"),
        (HistoryPolicyError("bad watermark", "low_watermark"), "invalid_request"),
        (StaleFence("taken over"), "busy"),
        (RuntimeError("something unexpected"), "internal_error"),
    ]


def test_every_typed_error_is_an_error_frame_and_the_socket_stays_open(
    ws_service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected faults: planning a turn raises each error the service knows (and one it does
    not); each is answered with its error frame, the socket answers ping afterwards, the
    conversation's lock is free and nothing was stored."""
    conv = conversation(ws_service)
    planner = ws_service.state.turns.planner
    real = planner.prepare_turn
    with socket(ws_service, conv) as ws:
        for fault, code in _faults():

            async def failing(*args: Any, error: BaseException = fault, **kwargs: Any) -> Any:
                raise error

            monkeypatch.setattr(planner, "prepare_turn", failing)
            ws.send_json({"type": "message", "content": "Hello", "max_tokens": 3})
            frame = ws.receive_json()
            assert frame["type"] == "error" and frame["code"] == code, (fault, frame)
            ws.send_json({"type": "ping"})
            assert ws.receive_json() == {"type": "pong"}
        monkeypatch.setattr(planner, "prepare_turn", real)
        ws.send_json({"type": "message", "content": "And now for real", "max_tokens": 3})
        assert until(ws, "done")[-1]["status"] == "complete"
    assert [m["content"] for m in stored(ws_service, conv) if m["role"] == "user"] == [
        "And now for real"
    ]


def test_sampling_knobs_reach_the_engine(ws_service: Service) -> None:
    """Each turn in a conversation of its own (the same prompt every time)."""

    def frames(fields: dict[str, Any]) -> list[dict[str, Any]]:
        with socket(ws_service, conversation(ws_service)) as ws:
            ws.send_json({"type": "message", "content": "Hello!", **fields})
            return until(ws, "done")

    def reply(fields: dict[str, Any]) -> str:
        got = frames(fields)
        assert got[-1]["type"] == "done", got[-1]
        return "".join(f["text"] for f in got if f["type"] == "delta")

    def refused(fields: dict[str, Any]) -> tuple[int, str | None]:
        error = frames(fields)[-1]
        assert error["type"] == "error", error
        return (400 if error["code"] == "invalid_request" else 0), error.get("param")

    check_sampling_knobs(ws_service.state.runtime.tokenizer, reply, refused)


# -- the session's presence and its user typing (the retention policy's hints) --------------------


def wait_for(condition: Any, what: str, timeout: float = 120.0) -> None:
    """Until `condition()` holds; the bound only catches a hang, the wait is on the condition."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.01)


def signals(service: Service, conv: str) -> Any:
    """What the engine's session store knows of the conversation's next turn (read from this
    thread: the test looks, the engine thread writes)."""
    session = service.state.runtime.engine_client.engine.sessions.get(conv)
    return None if session is None else session.signals


def pong(ws: Any) -> None:
    """A round trip: every frame the socket got before the ping has been handled."""
    ws.send_json({"type": "ping"})
    assert ws.receive_json() == {"type": "pong"}


def test_a_conversation_is_present_while_a_socket_of_it_is_open(ws_service: Service) -> None:
    conv = conversation(ws_service)
    sockets = ws_service.state.conversation_sockets
    assert signals(ws_service, conv) is None  # the engine has not heard of it
    with socket(ws_service, conv) as first:
        pong(first)  # the open is noted before the socket reads a frame
        assert signals(ws_service, conv).present is True and sockets[conv] == 1
        with socket(ws_service, conv) as second:
            pong(second)
            assert sockets[conv] == 2
        wait_for(lambda: sockets[conv] == 1, "the second socket's close")
        pong(first)
        assert signals(ws_service, conv).present is True  # one is still open
    wait_for(lambda: signals(ws_service, conv).present is False, "the last socket's close")
    assert conv not in sockets


def admin_view(service: Service, conv: str, admin: str) -> dict[str, Any]:
    r = service.get(f"/v1/admin/sessions/{conv}", key=admin)
    assert r.status_code == 200, r.text
    engine: dict[str, Any] = r.json()["engine"]
    return engine


def test_typing_brings_an_evicted_session_back_onto_the_device(
    ws_service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvchat.app.transports import presence

    # Typing notes are one a second per socket; here none comes due twice, whatever the
    # machine's speed, so the frames past the first are the ignored ones.
    monkeypatch.setattr(presence, "TYPING_NOTE_INTERVAL_S", 3600.0)
    state, portal = ws_service.state, ws_service.client.portal
    _, admin = portal.call(lambda: state.store.create_key("ws-ops", admin=True))
    # An owner of its own: nothing learned from other tests' sessions predicts its return.
    _, typist = portal.call(lambda: state.store.create_key("typist"))
    conv = conversation(ws_service, typist)
    with socket(ws_service, conv, typist) as ws:
        ws.send_json({"type": "message", "content": "Remember me", "max_tokens": 4})
        assert until(ws, "done")[-1]["status"] == "complete"
        wait_for(lambda: admin_view(ws_service, conv, admin)["state"] == "resident", "pinning")
        evicted = ws_service.post(f"/v1/admin/sessions/{conv}/evict?offload=true", {}, key=admin)
        assert evicted.json()["state"] == "offloaded", evicted.text
        before = admin_view(ws_service, conv, admin)
        assert (before["tier"], before["held"]) == ("host", False)
        assert before["host_blocks"] > 0 and before["device_blocks"] == 0

        ws.send_json({"type": "typing"})
        wait_for(lambda: admin_view(ws_service, conv, admin)["tier"] == "device", "the restore")
        after = admin_view(ws_service, conv, admin)
        assert after["state"] == "resident"
        assert after["device_blocks"] > 0 and after["tokens"] == before["tokens"]
        noted_at = signals(ws_service, conv).typing_at
        assert noted_at is not None

        # More typing frames are accepted and ignored: no answer, no note.
        for _ in range(3):
            ws.send_json({"type": "typing"})
        pong(ws)  # the next frame the socket sends answers the ping: nothing came before it
        assert signals(ws_service, conv).typing_at == noted_at
        # A bad one is answered and the socket stays open.
        ws.send_json({"type": "typing", "text": "hello"})
        error = ws.receive_json()
        assert (error["type"], error["code"], error["param"]) == (
            "error",
            "invalid_request",
            "text",
        )
        pong(ws)
        # Another socket has its own pace: its first typing frame is noted.
        with socket(ws_service, conv, typist) as other:
            other.send_json({"type": "typing"})
            pong(other)
        assert signals(ws_service, conv).typing_at > noted_at
        # The message finds its KV on the device: every token of the history is reused.
        ws.send_json({"type": "message", "content": "Here I am", "max_tokens": 4})
        done = until(ws, "done")[-1]
        assert done["usage"]["cached_tokens"] >= after["tokens"]
