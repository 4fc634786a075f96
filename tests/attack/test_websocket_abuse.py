"""WebSocket abuse against a started server, with a real `websockets` client: frames that are
not what they should be (malformed, binary, oversized, 50,000 deep, of unknown types, with a
lone surrogate, with integers no field can hold) each get an error frame and leave the socket
usable (`ping` answers `pong`); two sockets on one conversation both get their reply or a clear
`busy`; 200 sockets opened and dropped leave the server's socket count and file descriptors
where they were; an idle socket is closed by the server; a socket whose key is revoked stops
working."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from kvchat_testing.attack_servers import (
    create_key,
    database_of,
    metric,
    open_fds,
    revoke_key,
    started_server,
    wait_until,
)
from kvchat_testing.service import Server

IDLE_TIMEOUT_S = 8  # the server closes a socket silent this long
FRAME_LIMIT = 256 * 1024  # the server's ws_max_frame_bytes (its default)
RECV_TIMEOUT_S = 60.0  # a safety net: a frame that never comes is a hang
DEEP = 50_000


@pytest.fixture(scope="module")
def server(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {
        "KVCHAT_WS_IDLE_TIMEOUT": str(IDLE_TIMEOUT_S),
        "KVCHAT_WS_MAX_FRAME_BYTES": str(FRAME_LIMIT),
        # Room for the batches of the open-and-drop test (the default is 16 per key).
        "KVCHAT_WS_MAX_CONNECTIONS_PER_KEY": "64",
    }
    with started_server(dev_model, tmp_path_factory.mktemp("data"), "sqlite", env) as server:
        yield server


def new_conversation(server: Server, key: str | None = None) -> str:
    r = httpx.post(
        f"{server.url}/v1/conversations", headers=server.headers(key), json={}, timeout=60
    )
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def stored(server: Server, conv: str, key: str | None = None) -> list[dict[str, Any]]:
    r = httpx.get(
        f"{server.url}/v1/conversations/{conv}/messages", headers=server.headers(key), timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()["data"]  # type: ignore[no-any-return]


def connect(server: Server, conv: str, key: str | None = None) -> Any:
    return websockets.connect(
        f"ws://127.0.0.1:{server.port}/v1/conversations/{conv}/ws",
        additional_headers=server.headers(key),
        max_size=None,
        open_timeout=RECV_TIMEOUT_S,
    )


async def receive(ws: Any) -> dict[str, Any]:
    frame = await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)
    assert isinstance(frame, str), f"binary frame from the server: {frame!r}"
    return json.loads(frame)  # type: ignore[no-any-return]


async def ping(ws: Any) -> None:
    await ws.send(json.dumps({"type": "ping"}))
    assert await receive(ws) == {"type": "pong"}


async def until_end(ws: Any) -> list[dict[str, Any]]:
    """Frames up to and including the reply's `done` or an `error`."""
    frames = []
    while True:
        frames.append(await receive(ws))
        if frames[-1]["type"] in ("done", "error"):
            return frames


def message(text: str, **fields: Any) -> str:
    return json.dumps({"type": "message", "content": text, "max_tokens": 8, **fields})


BAD_FRAMES: list[tuple[str, str | bytes, set[str]]] = [
    # (name, frame, the error codes that may answer it)
    ("malformed json", "{nope", {"invalid_json"}),
    ("binary frame", b"\x00\x01\x02 not text", {"invalid_json"}),
    # Over the app's limit but under the protocol's (4x): an error frame, the socket stays.
    ("oversized frame", message("x" * (2 * FRAME_LIMIT)), {"frame_too_large"}),
    (
        "one byte over the limit",
        message("x" * (FRAME_LIMIT - len(message("")) + 1)),
        {"frame_too_large"},
    ),
    ("50,000 deep array", "[" * DEEP + "]" * DEEP, {"invalid_json", "invalid_request"}),
    (
        "50,000 deep content",
        '{"type": "message", "content": ' + "[" * DEEP + "]" * DEEP + "}",
        {"invalid_json", "invalid_request"},
    ),
    (
        "50,000 deep object",
        '{"type": "message", "content": "x", "stop": ' + '{"":' * DEEP + "1" + "}" * DEEP + "}",
        {"invalid_json", "invalid_request"},
    ),
    ("unknown type", json.dumps({"type": "dance"}), {"unknown_type"}),
    ("no type", json.dumps({"content": "hello"}), {"unknown_type"}),
    ("not an object", "42", {"unknown_type"}),
    ("lone surrogate as the type", '{"type": "\\udc00"}', {"unknown_type", "invalid_request"}),
    (
        "offset past 64 bits",
        json.dumps({"type": "resume", "message_id": "msg_x", "offset": 2**64}),
        {"invalid_request", "not_found"},
    ),
]


@pytest.mark.parametrize(
    "frame, codes", [(f, c) for _, f, c in BAD_FRAMES], ids=[name for name, _, _ in BAD_FRAMES]
)
def test_a_bad_frame_gets_an_error_frame_and_the_socket_still_answers(
    server: Server, frame: str | bytes, codes: set[str]
) -> None:
    assert len(frame) <= FRAME_LIMIT or codes == {"frame_too_large"}
    conv = new_conversation(server)

    async def attack() -> dict[str, Any]:
        async with connect(server, conv) as ws:
            await ping(ws)
            await ws.send(frame)
            answer = await receive(ws)
            await ping(ws)
            return answer

    answer = asyncio.run(attack())
    assert answer["type"] == "error" and answer["code"] in codes, answer
    assert isinstance(answer["message"], str) and answer["message"]
    assert stored(server, conv) == []  # nothing was stored from a refused frame


ODD_MESSAGES: list[tuple[str, str]] = [
    # Frames a fix may refuse (a typed error) or serve (a reply); never a dropped socket.
    (
        "lone surrogate in the content",
        '{"type": "message", "content": "a\\ud800b", "max_tokens": 4}',
    ),
    (
        "lone surrogate in the name",
        '{"type": "message", "content": "x", "name": "\\udfff", "max_tokens": 4}',
    ),
    ("seed past 64 bits", message("x", seed=2**70)),
    ("negative seed past 64 bits", message("x", seed=-(2**70))),
    ("max_tokens past 64 bits", message("x", max_tokens=2**64)),
    ("top_k past 64 bits", message("x", top_k=2**64)),
]


@pytest.mark.parametrize(
    "frame", [f for _, f in ODD_MESSAGES], ids=[name for name, _ in ODD_MESSAGES]
)
def test_an_odd_message_is_refused_or_answered_and_the_socket_still_answers(
    server: Server, frame: str
) -> None:
    conv = new_conversation(server)

    async def attack() -> list[dict[str, Any]]:
        async with connect(server, conv) as ws:
            await ws.send(frame)
            frames = await until_end(ws)
            await ping(ws)
            return frames

    frames = asyncio.run(attack())
    end = frames[-1]
    if end["type"] == "error":  # refused, typed, and nothing stored
        assert end["code"] in ("invalid_request", "context_length_exceeded"), end
        assert isinstance(end["message"], str) and end["message"]
        assert stored(server, conv) == []
    else:  # served: what is stored reads back
        assert end["status"] == "complete", end
        assert [m["role"] for m in stored(server, conv)] == ["user", "assistant"]


def test_two_sockets_on_one_conversation_get_the_reply_or_busy(server: Server) -> None:
    conv = new_conversation(server)

    async def one(ws: Any, text: str) -> list[dict[str, Any]]:
        await ws.send(message(text, max_tokens=16))
        return await until_end(ws)

    async def attack() -> list[list[dict[str, Any]]]:
        async with connect(server, conv) as a, connect(server, conv) as b:
            await asyncio.gather(ping(a), ping(b))
            results = list(await asyncio.gather(one(a, "from socket a"), one(b, "from socket b")))
            await asyncio.gather(ping(a), ping(b))
            return results

    results = asyncio.run(attack())
    ends = [frames[-1] for frames in results]
    for end in ends:
        assert end["type"] == "done" or end.get("code") == "busy", end
    done = [(frames, end) for frames, end in zip(results, ends) if end["type"] == "done"]
    assert done, ends
    replies = {m["id"]: m for m in stored(server, conv) if m["role"] == "assistant"}
    for frames, end in done:
        text = "".join(f["text"] for f in frames if f["type"] == "delta")
        assert replies[end["message_id"]]["content"] == text


def test_two_hundred_sockets_opened_and_dropped_leave_nothing_behind(server: Server) -> None:
    assert server.process is not None
    pid = server.process.pid
    conv = new_conversation(server)
    batch = 20

    async def open_and_drop(i: int) -> None:
        ws = await connect(server, conv)
        await ping(ws)
        if i % 10 == 0:  # some drop in the middle of a reply
            await ws.send(message(f"dropped {i}"))
            await receive(ws)
        ws.transport.abort()  # no close frame: the network went away

    async def drop(first: int, count: int) -> None:
        for start in range(first, first + count, batch):
            await asyncio.gather(*(open_and_drop(i) for i in range(start, start + batch)))

    def idle() -> bool:
        requests = httpx.get(
            f"{server.url}/v1/admin/memory", headers=server.headers(), timeout=30
        ).json()["requests"]
        return metric(server, "kvchat:websocket_connections") == 0 and not requests["running"]

    # One batch first: it opens what the server keeps open at this concurrency (its database
    # connection pool); what is open once it is idle again is the baseline.
    asyncio.run(drop(0, batch))
    wait_until(idle, "no socket open and no reply running")
    baseline = open_fds(pid)
    asyncio.run(drop(batch, 200))
    wait_until(idle, "no socket open and no reply running")
    wait_until(
        lambda: open_fds(pid) <= baseline,
        f"the server's file descriptors back at {baseline} (now {open_fds(pid)})",
    )
    assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200

    async def still_answers() -> None:
        async with connect(server, new_conversation(server)) as ws:
            await ping(ws)
            await ws.send(message("after the drops"))
            assert (await until_end(ws))[-1]["type"] == "done"

    asyncio.run(still_answers())


def test_an_idle_socket_is_closed_by_the_server(server: Server) -> None:
    conv = new_conversation(server)

    async def attack() -> int | None:
        async with connect(server, conv) as ws:
            await ping(ws)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                # Silent from here: the server must close it (after IDLE_TIMEOUT_S).
                await asyncio.wait_for(ws.recv(), IDLE_TIMEOUT_S + RECV_TIMEOUT_S)
            return closed.value.rcvd.code if closed.value.rcvd else None

    assert asyncio.run(attack()) == 1001
    wait_until(
        lambda: metric(server, "kvchat:websocket_connections") == 0,
        "the server counts no open socket",
    )


def test_a_socket_stops_working_when_its_key_is_revoked(server: Server) -> None:
    name = f"revoked-{uuid.uuid4().hex[:8]}"
    key = create_key(database_of(server), name)
    # Another key of the same owner, to read the conversation once `key` is revoked.
    reader = create_key(database_of(server), f"{name}-reader", owner=name)
    conv = new_conversation(server, key)

    async def attack() -> dict[str, Any] | int | None:
        async with connect(server, conv, key) as ws:
            await ping(ws)
            await asyncio.to_thread(revoke_key, database_of(server), name)
            try:
                await ws.send(message("after the revocation"))
                return await receive(ws)  # the socket's answer to a revoked key
            except websockets.ConnectionClosed as closed:
                return closed.rcvd.code if closed.rcvd else None

    answer = asyncio.run(attack())
    assert (
        httpx.get(f"{server.url}/v1/models", headers=server.headers(key), timeout=30).status_code
        == 401
    )  # revoked, as REST sees it
    if isinstance(answer, dict):
        assert answer["type"] == "error" and answer["code"] != "busy", answer
    else:
        assert answer == 4401, answer
    assert stored(server, conv, reader) == []  # no turn ran on the revoked key


def test_a_frame_past_the_protocol_limit_is_closed_1009_and_the_server_serves_on(
    server: Server,
) -> None:
    """Past four times the frame limit uvicorn refuses to buffer the frame at all: the socket
    is closed with 1009 (message too big), as the README says, and the server serves on."""
    conv = new_conversation(server)

    async def attack() -> int | None:
        async with connect(server, conv) as ws:
            await ws.send(message("x" * (5 * FRAME_LIMIT)))
            try:
                await receive(ws)
            except websockets.ConnectionClosed as closed:
                return closed.rcvd.code if closed.rcvd else None
        return None

    assert asyncio.run(attack()) == 1009

    async def after() -> None:
        async with connect(server, conv) as ws:
            await ping(ws)

    asyncio.run(after())
