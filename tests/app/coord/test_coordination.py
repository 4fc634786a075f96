"""Coordination against real Redis (this machine's, under a key prefix of the test's own, or
a Redis the test starts on another port) and the in-process back end: locks, idempotency,
rate limits, leases, stop signals across processes, buffered events, and a Redis that goes
away and comes back."""

from __future__ import annotations

import asyncio
import logging
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

from kvchat.app.coord import Coordinator, LocalCoordinator, ProcessIdentity
from kvchat.app.coord.leases import LeaseKeeper, lease_name
from kvchat.app.coord.locks import HeldLock, Locks
from kvchat.app.coord.redis import RedisCoordinator
from kvchat_testing.app_service import Service, service_settings
from kvchat_testing.service import free_port

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


ME = ProcessIdentity("replica-test")


async def wait_until(check: Any, timeout: float = 10.0) -> None:
    """Until `await check()` is true (a safety deadline only, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


@pytest.mark.anyio
async def test_locks_are_owned_fenced_and_released_by_their_token(coord: Coordinator) -> None:
    taken, a = await coord.lock_acquire(
        "turn:c1", ME, "a", 5, purpose="turn", data={"message_id": "m1"}
    )
    assert taken and a.token == "a" and a.purpose == "turn" and a.data == {"message_id": "m1"}
    assert (a.owner, a.host, a.pid, a.instance) == (ME.replica_id, ME.host, ME.pid, ME.instance)
    taken, holder = await coord.lock_acquire("turn:c1", ME, "b", 5, purpose="delete")
    assert not taken and holder == a  # b is told who holds it
    assert not await coord.lock_release("turn:c1", "b")  # not b's: still held
    assert await coord.lock_holder("turn:c1") == a
    assert not await coord.lock_renew("turn:c1", "b", 5)
    assert await coord.lock_renew("turn:c1", "a", 5)
    assert await coord.lock_release("turn:c1", "a")
    assert await coord.lock_holder("turn:c1") is None
    taken, b = await coord.lock_acquire("turn:c1", ME, "b", 5, purpose="turn")
    assert taken and b.fence > a.fence  # fences only grow
    # a floor (the fence the store saw last) lifts the next fence above it
    taken, c = await coord.lock_acquire(
        "turn:c2", ME, "c", 5, purpose="turn", fence_floor=b.fence + 1000
    )
    assert taken and c.fence == b.fence + 1001
    assert sorted(k for k, _ in await coord.lock_scan("turn:")) == ["turn:c1", "turn:c2"]
    assert [k for k, _ in await coord.lock_scan("turn:c2")] == ["turn:c2"]


@pytest.mark.anyio
async def test_a_lock_expires_unless_renewed(coord: Coordinator) -> None:
    assert (await coord.lock_acquire("turn:c", ME, "a", 0.3, purpose="turn"))[0]
    await wait_until(lambda: _free(coord, "turn:c"))
    assert not await coord.lock_renew("turn:c", "a", 5)  # lost: it cannot be renewed
    assert (await coord.lock_acquire("turn:c", ME, "b", 5, purpose="turn"))[0]


async def _free(coord: Coordinator, key: str) -> bool:
    return await coord.lock_holder(key) is None


@pytest.mark.anyio
async def test_local_locks_expire_by_the_injected_clock() -> None:
    now = [100.0]
    coord = LocalCoordinator(clock=lambda: now[0])
    assert (await coord.lock_acquire("turn:c", ME, "a", 10, purpose="turn"))[0]
    now[0] += 9.9
    assert await coord.lock_renew("turn:c", "a", 10)  # renewed at 109.9: until 119.9
    now[0] += 9.9
    assert (await coord.lock_holder("turn:c")) is not None
    now[0] += 0.2
    assert await coord.lock_holder("turn:c") is None
    assert (await coord.lock_acquire("turn:c", ME, "b", 10, purpose="turn"))[0]


def test_a_dead_holder_is_recognised() -> None:
    import os
    import subprocess
    import sys

    me = ProcessIdentity("host-a:8000:1")
    gone = subprocess.Popen([sys.executable, "-P", "-c", "pass"])
    gone.wait()

    def holder(**fields: Any) -> dict[str, Any]:
        return {**me.process(), "instance": "another", **fields}

    assert not me.is_dead(me.process())  # this process
    assert me.is_dead(holder(pid=gone.pid))  # an earlier incarnation of this replica id
    assert me.is_dead(holder(owner="x", pid=gone.pid))  # a pid of this host that has ended
    assert not me.is_dead(holder(owner="x", pid=os.getppid()))  # one that runs
    assert me.is_dead(holder(owner="x"))  # our own pid, another instance: a previous life
    sibling = ProcessIdentity("host-b:8001:1")  # another app alive in this process
    assert not me.is_dead(sibling.process())
    sibling.retire()
    assert me.is_dead(sibling.process())
    assert not me.is_dead(holder(owner="x", host="elsewhere", pid=gone.pid))  # unknown


@pytest.mark.anyio
async def test_held_locks_are_renewed_and_dead_holders_taken_over(coord: Coordinator) -> None:
    # A TTL long next to a loaded event loop's stalls (renewals come every TTL/3), so only a
    # lost renewal, not a busy machine, loses the lock.
    locks = Locks(coord, ME, ttl=1.0)
    held = await locks.acquire("turn:c", purpose="turn")
    assert isinstance(held, HeldLock)
    lost: list[bool] = []
    held.on_lost = lambda: lost.append(True)
    await asyncio.sleep(3.5)  # > 3 TTLs: only the renewals keep it
    assert (await coord.lock_holder("turn:c")) == held.holder and not lost
    other = await Locks(coord, ProcessIdentity("replica-other"), ttl=5).acquire(
        "turn:c", purpose="turn"
    )
    assert other == held.holder  # a live holder keeps it
    await held.release()
    assert await coord.lock_holder("turn:c") is None
    # a lock left by a dead incarnation of this replica is taken over at once
    dead = ProcessIdentity(ME.replica_id)
    dead.retire()
    assert (await coord.lock_acquire("turn:d", dead, "old", 60, purpose="turn"))[0]
    taken = await locks.acquire("turn:d", purpose="turn")
    assert isinstance(taken, HeldLock) and taken.token != "old"
    await taken.release()
    assert (await coord.lock_acquire("turn:e", dead, "old2", 60, purpose="turn"))[0]
    assert [k for k, _ in await locks.reclaim_dead()] == ["turn:e"]
    assert await coord.lock_holder("turn:e") is None


class CancelTurnedTimeout(LocalCoordinator):
    """Injected fault: a renewal whose cancellation lands as its command's own timeout fires
    comes out as that TimeoutError (asyncio.timeout's race, which redis-py's socket timeouts
    can hit), not as a cancellation."""

    def __init__(self) -> None:
        super().__init__()
        self.renewing = asyncio.Event()

    async def lock_renew(self, key: str, token: str, ttl: float) -> bool:
        self.renewing.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise TimeoutError from None
        return True


@pytest.mark.anyio
async def test_releasing_a_lock_ends_its_renewer_even_when_the_cancellation_is_lost() -> None:
    coord = CancelTurnedTimeout()
    held = await Locks(coord, ME, ttl=0.3).acquire("turn:r", purpose="turn")
    assert isinstance(held, HeldLock)
    await asyncio.wait_for(coord.renewing.wait(), 60)
    # a safety deadline only: without the fix the renewer loops on and release() never returns
    await asyncio.wait_for(held.release(), 60)
    assert held._renewer.done()
    assert await coord.lock_holder("turn:r") is None


class SessionInfoCancelTurnedTimeout:
    """Injected fault: the engine's answer to a lease renewal, cancelled, comes out as a
    TimeoutError instead."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    async def session_info(self, conversation_id: str) -> None:
        self.asked.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise TimeoutError from None


@pytest.mark.anyio
async def test_closing_the_lease_keeper_ends_its_renewals_even_when_the_cancellation_is_lost() -> (
    None
):
    engine = SessionInfoCancelTurnedTimeout()
    keeper = LeaseKeeper(LocalCoordinator(), engine, "replica-test", ttl=0.3)  # type: ignore[arg-type]
    keeper.held.add("c")
    keeper.start()
    await asyncio.wait_for(engine.asked.wait(), 60)
    keeper.held.clear()
    await asyncio.wait_for(keeper.close(), 60)  # a safety deadline only
    assert keeper._task is not None and keeper._task.done()


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
async def test_idempotency_attempts_progress_and_are_taken_over_once(
    coord: Coordinator,
) -> None:
    first = {"id": "a1", **ME.process()}
    assert await coord.idempotency_begin("idem:t", "fp", 60, first) is None
    assert await coord.idempotency_progress("idem:t", "a1", {"lock": "tok", "user": "msg_u"})
    assert not await coord.idempotency_progress("idem:t", "zz", {"lock": "other"})
    record = await coord.idempotency_get("idem:t")
    assert record is not None and record.attempt == {**first, "lock": "tok", "user": "msg_u"}
    # two retries race to take over the dead attempt: exactly one wins
    won = await asyncio.gather(
        coord.idempotency_takeover("idem:t", "a1", {"id": "r1"}),
        coord.idempotency_takeover("idem:t", "a1", {"id": "r2"}),
    )
    winners = [r for r in won if r is not None]
    assert len(winners) == 1 and winners[0].attempt["id"] in ("r1", "r2")
    assert winners[0].fingerprint == "fp"
    loser = "r2" if winners[0].attempt["id"] == "r1" else "r1"
    await coord.idempotency_abandon("idem:t", loser)  # not the loser's: kept
    assert await coord.idempotency_get("idem:t") is not None
    # The dead attempt comes back (a hung replica resumed): it cannot finish what a retry
    # runs now, nor leave a record whose body a retry would not match.
    await coord.idempotency_finish("idem:t", {"message_id": "cut-off"}, 60, "a1")
    running = await coord.idempotency_get("idem:t")
    assert running is not None and running.result is None and running.fingerprint == "fp"
    await coord.idempotency_abandon("idem:t", winners[0].attempt["id"])
    await coord.idempotency_finish("idem:t", {"message_id": "late"}, 60, "a1")
    assert await coord.idempotency_get("idem:t") is None  # abandoned stays abandoned
    assert await coord.idempotency_begin("idem:t", "fp", 60, {"id": "r3"}) is None
    await coord.idempotency_finish("idem:t", {"message_id": "m"}, 60, "r3")
    assert await coord.idempotency_takeover("idem:t", "r3", {}) is None
    await coord.idempotency_abandon("idem:t", "r3")  # finished: kept
    done = await coord.idempotency_get("idem:t")
    assert done is not None and done.result == {"message_id": "m"}


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
async def test_a_lease_is_taken_over_by_the_replica_that_served_the_last_turn(
    coord: Coordinator,
) -> None:
    assert await coord.take_lease("session:m", "replica-a", 30) is None
    assert await coord.take_lease("session:m", "replica-a", 30) == "replica-a"
    # replica-b served a turn: the lease is its now, and a's renewal says so.
    assert await coord.take_lease("session:m", "replica-b", 30) == "replica-a"
    assert await coord.lease_holder("session:m") == "replica-b"
    assert not await coord.acquire_lease("session:m", "replica-a", 30)
    await coord.release_lease("session:m", "replica-a")  # not a's: kept
    assert await coord.lease_holder("session:m") == "replica-b"
    await coord.release_lease("session:m", "replica-b")
    assert await coord.take_lease("session:m", "replica-a", 30) is None


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
    from kvchat.app.main import create_app

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
        if a.state.turns.running(conv) is not None:
            break
        time.sleep(0.01)
    time.sleep(0.3)
    assert b.state.turns.running(conv) is None  # generated by a: the stop goes through Redis
    stop = b.post(f"/v1/conversations/{conv}/stop", {}).json()
    assert stop["stopped"] is True  # b sees a's turn lock
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
    # Dropped from memory, its KV stays in this replica's KV store ("stored": the predictive
    # policy keeps its token ids to load it back), so the lease stays here, renewed.
    evicted = a.post(f"/v1/admin/sessions/{conv}/evict?offload=false", {}).json()
    assert evicted["state"] == "stored"
    time.sleep(2.5)
    assert holder() == "replica-a"
    # Closed for good (deleted), it holds nothing anywhere: released.
    deleted = a.client.delete(f"/v1/conversations/{conv}", headers=a.headers())
    assert deleted.status_code in (200, 204), deleted.text

    def lease() -> str | None:
        return b.client.portal.call(b.state.coord.lease_holder, lease_name(conv))

    for _ in range(100):
        if lease() is None:
            break
        time.sleep(0.05)
    assert lease() is None


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


@pytest.mark.anyio
async def test_close_is_bounded_when_a_task_swallows_its_cancellation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Injected fault: redis-py can swallow a cancellation while it subscribes. A background
    task that swallows every one must not keep close() (and the process's exit) waiting: it is
    cancelled a bounded number of times, logged and left; the listener itself stops at close."""
    from kvchat.app.coord import redis as redis_coord

    coord = RedisCoordinator(REDIS, prefix=prefix())
    await coord.start()
    await coord.wait_listening()
    listener = coord._tasks[1]
    released = asyncio.Event()
    cancellations: list[int] = []

    async def stubborn() -> None:
        while not released.is_set():
            try:
                await released.wait()
            except asyncio.CancelledError:
                cancellations.append(1)  # swallowed, as the fault does

    task = asyncio.create_task(stubborn(), name="stubborn")
    coord._tasks.append(task)
    with caplog.at_level(logging.WARNING, logger="kvchat.app.coord.redis"):
        await coord.close()
    assert listener.done()
    assert not task.done() and len(cancellations) == redis_coord.CLOSE_ATTEMPTS
    assert any("stubborn" in r.getMessage() for r in caplog.records)
    released.set()
    await task
