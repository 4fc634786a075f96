"""Coordination against real Redis (this machine's, under a key prefix of the test's own, or
a Redis the test starts on another port) and the in-process back end: locks, idempotency,
rate limits, leases, stop signals across processes, buffered events, and a Redis that goes
away and comes back."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.coord import Coordinator, LocalCoordinator
from app.coord.redis import RedisCoordinator
from tests.app.conftest import Service, service_settings
from tests.service import free_port

REDIS = "redis://127.0.0.1:6379/0"


def prefix() -> str:
    return f"kvchat-test-{uuid.uuid4().hex[:10]}:"


@pytest.fixture(params=["local", "redis"])
async def coord(request: pytest.FixtureRequest) -> AsyncIterator[Coordinator]:
    backend: Coordinator = (
        LocalCoordinator() if request.param == "local" else RedisCoordinator(REDIS, prefix=prefix())
    )
    await backend.start()
    assert await backend.healthy()
    try:
        yield backend
    finally:
        await backend.close()


@pytest.mark.anyio
async def test_locks_are_exclusive_and_released_by_their_holder(coord: Coordinator) -> None:
    assert await coord.try_lock("turn:c1", "a", 5)
    assert not await coord.try_lock("turn:c1", "b", 5)
    await coord.unlock("turn:c1", "b")  # not b's: still held
    assert not await coord.try_lock("turn:c1", "b", 5)
    await coord.unlock("turn:c1", "a")
    assert await coord.try_lock("turn:c1", "b", 0.2)
    await asyncio.sleep(0.3)  # expired
    assert await coord.try_lock("turn:c1", "c", 5)


@pytest.mark.anyio
async def test_idempotency_records(coord: Coordinator) -> None:
    assert await coord.idempotency_begin("idem:k", "fp1", 60) is None
    first = await coord.idempotency_begin("idem:k", "fp1", 60)
    assert first is not None and first.fingerprint == "fp1" and first.result is None
    await coord.idempotency_finish("idem:k", {"id": "msg_1"}, 60)
    done = await coord.idempotency_get("idem:k")
    assert done is not None and done.result == {"id": "msg_1"} and done.fingerprint == "fp1"
    await coord.idempotency_abandon("idem:k")
    assert await coord.idempotency_get("idem:k") is None


@pytest.mark.anyio
async def test_sliding_window_rate_limit(coord: Coordinator) -> None:
    decisions = [await coord.rate_check("req:key", 3, 60, 1) for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert [d.remaining for d in decisions[:3]] == [2, 1, 0]
    # 3 counted in this window weigh fully until it ends, then one fits 1/3 into the next.
    assert 20 < decisions[-1].retry_after <= 80
    await coord.rate_add("tok:key", 60, 500)
    assert (await coord.rate_check("tok:key", 400, 60, 0)).remaining == 0


@pytest.mark.anyio
async def test_leases(coord: Coordinator) -> None:
    assert await coord.acquire_lease("session:c", "replica-a", 0.5)
    assert not await coord.acquire_lease("session:c", "replica-b", 0.5)
    assert await coord.acquire_lease("session:c", "replica-a", 0.5)  # renewal
    assert await coord.lease_holder("session:c") == "replica-a"
    await coord.release_lease("session:c", "replica-a")
    assert await coord.lease_holder("session:c") is None


@pytest.mark.anyio
async def test_buffered_events_replay_then_follow(coord: Coordinator) -> None:
    await coord.append_event("reply:m", {"type": "start"}, 60)
    await coord.append_event("reply:m", {"type": "delta", "text": "ab", "offset": 0}, 60)

    async def read() -> list[dict[str, Any]]:
        return [e async for e in coord.read_events("reply:m", 5)]

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.2)
    await coord.append_event("reply:m", {"type": "delta", "text": "c", "offset": 2}, 60)
    await coord.append_event("reply:m", {"type": "done"}, 60)
    events = await reader
    assert [e["type"] for e in events] == ["start", "delta", "delta", "done"]


@pytest.mark.anyio
async def test_a_stop_published_by_another_process_reaches_the_subscriber() -> None:
    shared = prefix()
    a, b = RedisCoordinator(REDIS, prefix=shared), RedisCoordinator(REDIS, prefix=shared)
    await a.start()
    await b.start()
    try:
        await a.wait_listening()
        stopped: list[str] = []
        unsubscribe = await a.subscribe_stop("conv-1", stopped.append)
        await b.publish_stop("conv-1")
        for _ in range(100):
            if stopped:
                break
            await asyncio.sleep(0.02)
        assert stopped == ["conv-1"]
        unsubscribe()
    finally:
        await a.close()
        await b.close()


# -- the service with Redis: two app instances share it --------------------------------------------


def app_instance(
    model: Path, data: Path, redis_url: str | None, redis_prefix: str, **settings: Any
) -> Any:
    from app.main import create_app

    config = service_settings(model, data, None)
    config.redis_url = redis_url
    config.redis_prefix = redis_prefix
    for name, value in settings.items():
        setattr(config, name, value)
    return create_app(config)


@pytest.fixture
def two_instances(dev_model: Path, tmp_path: Path) -> Iterator[tuple[Service, Service]]:
    """Two app instances (as two replicas would be) on one database and one Redis."""
    shared = prefix()
    a = app_instance(dev_model, tmp_path, REDIS, shared, replica_id="replica-a", lease_ttl=1.5)
    b = app_instance(dev_model, tmp_path, REDIS, shared, replica_id="replica-b", lease_ttl=1.5)
    with TestClient(a) as client_a, TestClient(b) as client_b:
        state_a, state_b = a.state.kvchat, b.state.kvchat
        _, key = client_a.portal.call(lambda: state_a.store.create_key("ops", admin=True))
        client_a.portal.call(lambda: state_a.coord.wait_listening())
        client_b.portal.call(lambda: state_b.coord.wait_listening())
        yield (
            Service(client_a, state_a, key, key, "sqlite"),
            Service(client_b, state_b, key, key, "sqlite"),
        )


def test_a_stop_sent_to_another_instance_stops_the_reply(
    two_instances: tuple[Service, Service],
) -> None:
    a, b = two_instances
    conv = a.post("/v1/conversations", {}).json()["id"]
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.update(
            reply=a.post(
                f"/v1/conversations/{conv}/messages",
                {"content": "go", "max_tokens": 3000, "temperature": 1.0, "ignore_eos": True},
            ).json()
        )
    )
    thread.start()
    for _ in range(500):
        if conv in a.state.turns:
            break
        time.sleep(0.01)
    time.sleep(0.3)
    stop = b.post(f"/v1/conversations/{conv}/stop", {}).json()
    assert stop["stopped"] is False  # not generated by b: the stop went through Redis
    thread.join(60)
    reply = result["reply"]
    assert reply["status"] == "cancelled"
    assert reply["usage"]["completion_tokens"] < 3000


def test_idempotency_holds_across_instances(two_instances: tuple[Service, Service]) -> None:
    a, b = two_instances
    conv = a.post("/v1/conversations", {}).json()["id"]
    body = {"content": "exactly once", "max_tokens": 6}
    first = a.post(
        f"/v1/conversations/{conv}/messages", body, headers={"Idempotency-Key": "k-1"}
    ).json()
    again = b.post(
        f"/v1/conversations/{conv}/messages", body, headers={"Idempotency-Key": "k-1"}
    ).json()
    assert again["id"] == first["id"]
    messages = b.get(f"/v1/conversations/{conv}/messages").json()["data"]
    assert len(messages) == 2


def test_the_lease_is_held_renewed_and_released_on_evict(
    two_instances: tuple[Service, Service],
) -> None:
    a, b = two_instances
    conv = a.post("/v1/conversations", {}).json()["id"]
    a.post(f"/v1/conversations/{conv}/messages", {"content": "pin me", "max_tokens": 4})
    holder = lambda: b.get(f"/v1/admin/sessions/{conv}").json()["lease_holder"]  # noqa: E731
    for _ in range(100):
        if holder() == "replica-a":
            break
        time.sleep(0.05)
    assert holder() == "replica-a"
    time.sleep(2.5)  # longer than the 1.5 s TTL: only renewal keeps it
    assert holder() == "replica-a"
    evicted = a.post(f"/v1/admin/sessions/{conv}/evict?offload=false", {}).json()
    assert evicted["state"] == "empty"
    assert holder() is None


def test_rate_limits_answer_429_and_a_socket_error_frame(dev_model: Path, tmp_path: Path) -> None:
    for redis_url in (None, REDIS):
        app = app_instance(
            dev_model, tmp_path / str(redis_url is None), redis_url, prefix(), rate_limit_requests=2
        )
        with TestClient(app) as client:
            state = app.state.kvchat
            _, key = client.portal.call(state.store.create_key, "limited")
            service = Service(client, state, key, key, "sqlite")
            conv = service.post("/v1/conversations", {}).json()["id"]
            body = {"content": "hi", "max_tokens": 2}
            first = service.post(f"/v1/conversations/{conv}/messages", body)
            assert first.status_code == 200
            assert first.headers["x-ratelimit-limit-requests"] == "2"
            assert first.headers["x-ratelimit-remaining-requests"] == "1"
            service.post(f"/v1/conversations/{conv}/messages", body)
            third = service.post(f"/v1/conversations/{conv}/messages", body)
            assert third.status_code == 429, third.text
            assert int(third.headers["Retry-After"]) >= 1
            assert third.json()["error"]["type"] == "rate_limit_error"
            with client.websocket_connect(
                f"/v1/conversations/{conv}/ws", headers=service.headers()
            ) as ws:
                ws.send_json({"type": "message", "content": "hi", "max_tokens": 2})
                frame = ws.receive_json()
                assert frame["code"] == "rate_limited" and frame["retry_after"] >= 1
                ws.send_json({"type": "ping"})
                assert ws.receive_json()["type"] == "pong"
            metrics = client.get("/metrics").text
            assert "kvchat:rate_limited_requests_total 2.0" in metrics


def start_redis(port: int) -> subprocess.Popen[bytes]:
    redis_server = shutil.which("redis-server")
    assert redis_server, "redis-server is not installed"
    process = subprocess.Popen(
        [
            redis_server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    for _ in range(100):
        try:
            redis.Redis(port=port).ping()
            return process
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def test_the_service_keeps_serving_while_redis_is_away(dev_model: Path, tmp_path: Path) -> None:
    port = free_port()
    redis_process = start_redis(port)
    app = app_instance(dev_model, tmp_path, f"redis://127.0.0.1:{port}/0", prefix())
    try:
        with TestClient(app) as client:
            state = app.state.kvchat
            _, key = client.portal.call(lambda: state.store.create_key("k"))
            service = Service(client, state, key, key, "sqlite")
            conv = service.post("/v1/conversations", {}).json()["id"]

            def turn() -> int:
                return service.post(
                    f"/v1/conversations/{conv}/messages", {"content": "hello", "max_tokens": 3}
                ).status_code

            assert turn() == 200 and client.get("/readyz").json()["status"] == "ready"
            redis_process.kill()
            redis_process.wait()
            assert turn() == 200  # keeps serving on in-process coordination
            ready = client.get("/readyz")
            assert ready.status_code == 200 and ready.json()["status"] == "degraded"
            redis_process = start_redis(port)
            deadline = time.monotonic() + 10
            while client.get("/readyz").json()["status"] != "ready":
                assert time.monotonic() < deadline, "never recovered"
                time.sleep(0.2)
            assert turn() == 200
    finally:
        redis_process.kill()
        redis_process.wait()
