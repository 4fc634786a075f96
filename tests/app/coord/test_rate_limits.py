"""Sliding-window rate limits on this machine's Redis (a key prefix per test, deleted after)
and in process: a burst from several replicas admits exactly the limit, in the coordinators
and through the service; the window arithmetic at pinned times; remaining, reset and
retry-after of allowed and refused decisions; Redis's clock shared by replicas whose own
clocks disagree; the in-process fallback while Redis is away."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from pytest import approx

from kvchat.app.coord import Coordinator, LocalCoordinator, RateDecision
from kvchat.app.coord.base import sliding_window_decision
from kvchat.app.coord.redis import RedisCoordinator
from kvchat_testing.app_service import service_settings
from kvchat_testing.service import free_port

REDIS = "redis://127.0.0.1:6379/0"
BACKENDS = ["local", "redis"]

# Pinned times are offsets from W0: the start of a minute (so of a 2 s window too) a day
# from now, as windows expire at their end on the clock they follow, Redis's own included.
W0 = (time.time_ns() // 10**6 // 60_000 + 24 * 60) * 60_000


class PinnedClock:
    """A wall clock that reads what the test set (ns, as time.time_ns)."""

    def __init__(self, ms: int = W0) -> None:
        self.ns = ms * 1_000_000

    def at(self, ms: int) -> None:
        self.ns = ms * 1_000_000

    def __call__(self) -> int:
        return self.ns


async def started(coordinator: Coordinator) -> None:
    """Start `coordinator`, a Redis one until it listens for stops: closing one whose stop
    listener is still subscribing can hang (its cancellation is lost: the task stays
    "cancelling" inside pubsub.listen()), seen with redis-py 8.1 under pytest."""
    await coordinator.start()
    if isinstance(coordinator, RedisCoordinator):
        await coordinator.wait_listening()


@pytest.fixture
def prefix() -> Iterator[str]:
    """A key prefix of this test's own; whatever was written under it is deleted after."""
    name = f"kvchat-test-rate-{uuid.uuid4().hex[:10]}:"
    yield name
    client = redis.Redis.from_url(REDIS)
    try:
        for key in client.scan_iter(match=name + "*"):
            client.delete(key)
    finally:
        client.close()


@pytest.fixture
async def replicas(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[list[Coordinator]]:
    """Three started coordinators sharing one Redis prefix (three replicas), or one
    in-process coordinator."""
    coordinators: list[Coordinator] = (
        [LocalCoordinator()]
        if request.param == "local"
        else [RedisCoordinator(REDIS, prefix=prefix) for _ in range(3)]
    )
    for coordinator in coordinators:
        await started(coordinator)
        assert await coordinator.healthy()
    try:
        yield coordinators
    finally:
        for coordinator in coordinators:
            await coordinator.close()


@pytest.fixture
async def pinned(
    request: pytest.FixtureRequest, prefix: str
) -> AsyncIterator[tuple[Coordinator, PinnedClock]]:
    """A started coordinator whose rate windows follow a pinned clock."""
    clock = PinnedClock()
    coordinator: Coordinator = (
        LocalCoordinator(rate_clock=clock)
        if request.param == "local"
        else RedisCoordinator(REDIS, prefix=prefix, clock=clock)
    )
    await started(coordinator)
    try:
        yield coordinator, clock
    finally:
        await coordinator.close()


def decided(d: RateDecision) -> tuple[bool, int, int, float, float]:
    return d.allowed, d.limit, d.remaining, d.reset_s, d.retry_after


# -- a burst ---------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("replicas", BACKENDS, indirect=True)
async def test_a_concurrent_burst_from_several_replicas_admits_exactly_the_limit(
    replicas: list[Coordinator],
) -> None:
    decisions = await asyncio.gather(
        *(replicas[i % len(replicas)].rate_check("requests:k", 5, 60, 1) for i in range(30))
    )
    allowed = [d for d in decisions if d.allowed]
    refused = [d for d in decisions if not d.allowed]
    assert len(allowed) == 5 and len(refused) == 25
    assert sorted(d.remaining for d in allowed) == [0, 1, 2, 3, 4]
    for d in refused:
        assert d.remaining == 0
        # 5 of 5 weigh fully until their window ends; 1 fits a fifth into the next window.
        assert 12 <= d.retry_after <= 72 and d.retry_after == d.reset_s
    look = await replicas[-1].rate_check("requests:k", 5, 60, 0)
    assert look.allowed and look.remaining == 0  # the refused ones counted nothing


# -- the window arithmetic at pinned times -------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("pinned", BACKENDS, indirect=True)
async def test_the_window_slides_at_pinned_times(pinned: tuple[Coordinator, PinnedClock]) -> None:
    coord, clock = pinned

    async def check(at_ms: int, cost: int) -> tuple[bool, int, int, float, float]:
        clock.at(W0 + at_ms)
        return decided(await coord.rate_check("requests:k", 4, 2.0, cost))

    # A quarter into window 0: 3 of 4 fit, 2 more do not (they would fit a third into
    # window 1, once a third of window 0's 3 slid out), 1 more meets the limit exactly.
    assert await check(500, 3) == (True, 4, 1, 0.0, 0.0)
    assert await check(500, 2) == (False, 4, 1, 0.0, approx(2.0 * (0.75 + 1 / 3)))
    assert await check(500, 1) == (True, 4, 0, approx(2.0), 0.0)
    # Window 1: window 0's 4 weigh 3 once a quarter of it passed; a ms before, 1 is refused.
    assert await check(2499, 1) == (False, 4, 0, approx(0.001), approx(0.001))
    assert await check(2500, 1) == (True, 4, 0, approx(0.5), 0.0)
    assert await check(3000, 1) == (True, 4, 0, approx(0.5), 0.0)  # 4 * 0.5 + 1 + 1
    # Window 2, halfway: window 1's 2 weigh 1, window 0 counts nothing any more.
    assert await check(5000, 3) == (True, 4, 0, approx(1.0), 0.0)
    # Window 4: window 2 slid out and window 3 is empty; nothing weighs.
    assert await check(8000, 0) == (True, 4, 4, 0.0, 0.0)
    assert await check(8000, 4) == (True, 4, 0, approx(2.0 * 1.25), 0.0)
    assert await check(8000, 0) == (True, 4, 0, approx(2.5), 0.0)


@pytest.mark.anyio
@pytest.mark.parametrize("pinned", BACKENDS, indirect=True)
async def test_tokens_counted_after_the_fact(pinned: tuple[Coordinator, PinnedClock]) -> None:
    coord, clock = pinned
    clock.at(W0 + 500)
    await coord.rate_add("tokens:k", 2.0, 300)
    await coord.rate_add("tokens:k", 2.0, 200)
    over = await coord.rate_check("tokens:k", 400, 2.0, 0)
    # 500 > 400: refused, even as a look. In window 1 one more token fits once 101 of the 500
    # slid out; the look would pass once 100 did.
    assert decided(over) == (
        False,
        400,
        0,
        approx(2.0 * (0.75 + 101 / 500)),
        approx(2.0 * (0.75 + 100 / 500)),
    )
    clock.at(W0 + 3000)  # window 1, halfway: 250 weigh
    await coord.rate_add("tokens:k", 2.0, 50)
    assert decided(await coord.rate_check("tokens:k", 400, 2.0, 0)) == (True, 400, 100, 0.0, 0.0)


@pytest.mark.anyio
@pytest.mark.parametrize("pinned", BACKENDS, indirect=True)
async def test_a_clock_that_steps_back_never_forgets_what_was_counted(
    pinned: tuple[Coordinator, PinnedClock],
) -> None:
    coord, clock = pinned
    clock.at(W0 + 2500)
    assert (await coord.rate_check("requests:k", 4, 2.0, 4)).remaining == 0
    clock.at(W0 + 1500)  # back into window 0: counted as at the start of window 1
    assert decided(await coord.rate_check("requests:k", 4, 2.0, 1)) == (
        False,
        4,
        0,
        approx(2.5),
        approx(2.5),
    )


@pytest.mark.anyio
async def test_the_script_decides_as_the_in_process_coordinator(prefix: str) -> None:
    """Random counts in two windows (adjacent, or the older one slid out) and a random check:
    Redis and the in-process coordinator at the same pinned times agree with
    sliding_window_decision on the counts, in the decision and in what they counted."""
    rng = random.Random()
    clock = PinnedClock()
    remote = RedisCoordinator(REDIS, prefix=prefix, clock=clock)
    local = LocalCoordinator(rate_clock=clock)
    await started(remote)
    try:
        for case in range(80):
            key, window_ms = f"requests:{case}", rng.choice([1, 7, 1000, 2000, 60_000])
            window_s, gap = window_ms / 1000, rng.choice([1, 1, 1, 2, 3])  # windows apart
            earlier = W0 + rng.randrange(window_ms)
            previous, current = rng.randrange(12), rng.randrange(12)
            limit, cost = rng.randrange(1, 16), rng.randrange(6)
            elapsed_ms = rng.randrange(window_ms)
            start_ms = (earlier // window_ms + gap) * window_ms  # of the window checked in
            weighed = previous if gap == 1 else 0
            expected = sliding_window_decision(
                weighed, current, elapsed_ms / window_ms, window_s, limit, cost
            )
            counted = current + cost if expected.allowed else current
            where = (case, window_ms, gap, previous, current, elapsed_ms, limit, cost)
            for coord in (remote, local):
                clock.at(earlier)
                await coord.rate_add(key, window_s, previous)
                clock.at(start_ms + rng.randrange(elapsed_ms + 1))
                await coord.rate_add(key, window_s, current)
                clock.at(start_ms + elapsed_ms)
                assert await coord.rate_check(key, limit, window_s, cost) == expected, where
                assert await coord.rate_check(key, limit, window_s, 0) == sliding_window_decision(
                    weighed, counted, elapsed_ms / window_ms, window_s, limit, 0
                ), where
    finally:
        await remote.close()


@pytest.mark.anyio
async def test_the_windows_expire_once_they_slid_out(prefix: str) -> None:
    clock = PinnedClock(W0 + 500)
    coord = RedisCoordinator(REDIS, prefix=prefix, clock=clock)
    await started(coord)
    try:
        await coord.rate_check("requests:k", 4, 2.0, 1)
        await coord.rate_add("tokens:k", 2.0, 10)
        clock.at(W0 + 2001)
        await coord.rate_add("tokens:k", 2.0, 10)
        await coord.rate_check("requests:k", 4, 2.0, 0)  # only a look: writes nothing
        expire_at = coord.redis.pexpiretime
        assert await expire_at(prefix + "rate:requests:k") == W0 + 4000  # window 1's end
        assert await expire_at(prefix + "rate:tokens:k") == W0 + 6000  # window 2's end
    finally:
        await coord.close()


# -- Redis's clock -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_replicas_whose_clocks_disagree_share_one_window(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = RedisCoordinator(REDIS, prefix=prefix), RedisCoordinator(REDIS, prefix=prefix)
    await started(a)
    await started(b)
    try:
        assert (await a.rate_check("requests:k", 3, 60, 3)).remaining == 0
        # This process's clock now runs 90 s ahead, as a replica's might: Redis's still rules.
        real_time, real_time_ns = time.time, time.time_ns
        monkeypatch.setattr(time, "time", lambda: real_time() + 90)
        monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + 90 * 10**9)
        refused = await b.rate_check("requests:k", 3, 60, 1)
        assert not refused.allowed and 20 < refused.retry_after <= 80
    finally:
        await a.close()
        await b.close()


# -- Redis away ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_while_redis_is_away_the_process_limits_on_its_own() -> None:
    clock = PinnedClock(W0 + 500)
    coord = RedisCoordinator(f"redis://127.0.0.1:{free_port()}/0", clock=clock, timeout=0.5)
    await coord.start()
    try:
        assert not await coord.healthy()
        decisions = await asyncio.gather(
            *(coord.rate_check("requests:k", 5, 2.0, 1) for _ in range(30))
        )
        assert sorted(d.remaining for d in decisions if d.allowed) == [0, 1, 2, 3, 4]
        await coord.rate_add("tokens:k", 2.0, 7)
        assert (await coord.rate_check("tokens:k", 10, 2.0, 0)).remaining == 3
    finally:
        await coord.close()


# -- the service ---------------------------------------------------------------------------------


def burst(clients: list[TestClient], key: str, body: dict[str, Any], n: int) -> list[Any]:
    """`n` requests at once, spread over the apps (each app's own event loop, at once)."""

    async def send(app: Any, count: int) -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvchat") as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v1/chat/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {key}"},
                        timeout=120,
                    )
                    for _ in range(count)
                )
            )

    share = n // len(clients)
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(c.portal.call, send, c.app, share) for c in clients]
        return [response for future in futures for response in future.result()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_burst_through_the_service_answers_429_past_the_limit(
    backend: str, dev_model: Path, tmp_path: Path, prefix: str
) -> None:
    from kvchat.app.main import create_app

    redis_url = REDIS if backend == "redis" else None

    def app() -> Any:
        config = service_settings(dev_model, tmp_path, None)
        config.redis_url = redis_url
        config.redis_prefix = prefix
        config.rate_limit_requests = 5
        return create_app(config)

    # Two replicas on one database and one Redis; in process, one.
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(TestClient(app())) for _ in range(2 if redis_url else 1)]
        state = clients[0].app.state.kvchat
        _, key = clients[0].portal.call(state.store.create_key, "limited")
        body = {
            "model": str(state.runtime.model_name),
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}],
        }
        responses = burst(clients, key, body, 30)

    served = [r for r in responses if r.status_code != 429]
    limited = [r for r in responses if r.status_code == 429]
    assert [r.status_code for r in served] == [200] * 5, [r.text for r in served]
    assert len(limited) == 25
    assert sorted(r.headers["x-ratelimit-remaining-requests"] for r in served) == list("01234")
    for r in served:
        assert r.headers["x-ratelimit-limit-requests"] == "5"
        reset = float(r.headers["x-ratelimit-reset-requests"].removesuffix("s"))
        assert (reset == 0.0) == (r.headers["x-ratelimit-remaining-requests"] != "0")
    for r in limited:
        assert r.json()["error"]["type"] == "rate_limit_error"
        retry = int(r.headers["Retry-After"])
        reset = float(r.headers["x-ratelimit-reset-requests"].removesuffix("s"))
        assert 12 <= retry <= 72 and math.isclose(retry, reset, abs_tol=1.05)
        assert r.headers["x-ratelimit-remaining-requests"] == "0"


def test_tokenize_and_items_count_against_the_request_rate(dev_model: Path, tmp_path: Path) -> None:
    """Work per byte is rate-limited like chat: a burst of chat and tokenize requests against
    a limit of 5 admits 5 in all."""
    from kvchat.app.main import create_app

    config = service_settings(dev_model, tmp_path, None)
    config.rate_limit_requests = 5
    with TestClient(create_app(config)) as client:
        state = client.app.state.kvchat  # type: ignore[attr-defined]
        _, key = client.portal.call(state.store.create_key, "limited")
        headers = {"Authorization": f"Bearer {key}"}
        messages = [{"role": "user", "content": "hi"}]
        chat = {"model": str(state.runtime.model_name), "max_tokens": 1, "messages": messages}
        codes = [client.post("/v1/chat/completions", headers=headers, json=chat).status_code]
        codes += [
            client.post("/v1/tokenize", headers=headers, json={"messages": messages}).status_code
            for _ in range(6)
        ]
        assert codes == [200] * 5 + [429] * 2
        limited = client.post("/v1/tokenize", headers=headers, json={"messages": messages})
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert limited.headers["x-ratelimit-remaining-requests"] == "0"
