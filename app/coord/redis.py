"""Redis coordination (redis-py asyncio): what spans processes and replicas. Locks and leases
are SET NX PX with token-checked release, idempotency records JSON with a TTL, stop signals
pub/sub, rate limits two fixed windows weighted into a sliding one (checked and counted in one
script, on Redis's clock), a reply's events a Redis Stream.

When Redis goes away the service keeps serving: every operation falls back to the in-process
coordinator (rate limits and stops then hold per process only), the change is logged once,
`healthy()` turns false (/readyz says degraded), and a probe brings Redis back in when it
answers again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.coord.base import (
    Coordinator,
    IdempotencyRecord,
    RateDecision,
    StopHandler,
    sliding_window_decision,
    window_ms,
)
from app.coord.local import END_EVENTS, LocalCoordinator

log = logging.getLogger(__name__)
T = TypeVar("T")

UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)

# Delete a key only if it still holds our token (locks and leases).
RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
# Take a key for a token, or extend it when the token already holds it.
HOLD = """
local held = redis.call('get', KEYS[1])
if held == false or held == ARGV[1] then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# Check-and-count a sliding-window rate limit in one step (sliding_window_decision's
# arithmetic, on the key's two fixed windows; LocalCoordinator's RateCounts rolls them the
# same way). KEYS[1]: a hash, w = the window index c counts, p = units in window w - 1,
# c = units in window w. ARGV: limit (COUNT_ANYWAY '': count whatever it comes to), window ms,
# cost, now ms ('': Redis's own clock). Returns {allowed, previous, current before the cost,
# ms elapsed into the current window}. The hash expires when both windows have slid out, on
# the clock they follow.
RATE = """
local limit, window, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = tonumber(ARGV[4])
if now == nil then
  local clock = redis.call('TIME')  -- {seconds, microseconds}
  now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
end
local index = math.floor(now / window)
local elapsed = now - index * window
local held = redis.call('HMGET', KEYS[1], 'w', 'p', 'c')
local w = tonumber(held[1])
local previous, current = 0, 0
if w ~= nil and w > index then
  index, elapsed = w, 0  -- the clock stepped back: stay in the newest window, at its start
end
if w == index then
  previous, current = tonumber(held[2]), tonumber(held[3])
elseif w == index - 1 then
  previous = tonumber(held[3])
end
local allowed = limit == nil or previous * (1 - elapsed / window) + current + cost <= limit
if allowed and cost > 0 then
  redis.call('HSET', KEYS[1], 'w', index, 'p', previous, 'c', current + cost)
  redis.call('PEXPIREAT', KEYS[1], (index + 2) * window)
end
return {allowed and 1 or 0, previous, current, elapsed}
"""
COUNT_ANYWAY = ""


class RedisCoordinator(Coordinator):
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvchat:",
        probe_interval: float = 1.0,
        timeout: float = 2.0,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self.url = url
        self.prefix = prefix  # every key and channel (several deployments can share a Redis)
        self.stop_channel = prefix + "stop"
        self.redis: aioredis.Redis = aioredis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            health_check_interval=0,
        )
        # Rate windows follow Redis's clock (replicas whose clocks disagree share one window)
        # unless a clock is given (ns, as time.time_ns): tests pin the time with it. Windows
        # expire at their end on that clock, so a pinned one must not run behind Redis's.
        self.clock = clock
        self._rate_script = self.redis.register_script(RATE)
        self.local = LocalCoordinator(clock or time.time_ns)
        self.probe_interval = probe_interval
        self._up = True
        self._tasks: list[asyncio.Task[None]] = []
        self._pubsub_ready = asyncio.Event()

    # -- life and health ---------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self.redis.ping()
        except UNAVAILABLE as e:
            self._went_down(e)
        self._tasks = [asyncio.create_task(self._probe()), asyncio.create_task(self._listen())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    async def healthy(self) -> bool:
        return self._up

    def _went_down(self, error: BaseException) -> None:
        if self._up:
            self._up = False
            log.warning(
                "Redis at %s is unavailable (%s): coordination falls back to this "
                "process (rate limits and stop signals hold per process)",
                self.url,
                error,
            )

    async def _probe(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval)
            try:
                await self.redis.ping()
            except UNAVAILABLE as e:
                self._went_down(e)
                continue
            if not self._up:
                self._up = True
                log.warning("Redis at %s is back: coordination spans processes again", self.url)

    async def _call(
        self, work: Callable[[], Awaitable[T]], fallback: Callable[[], Awaitable[T]]
    ) -> T:
        if self._up:
            try:
                return await work()
            except UNAVAILABLE as e:
                self._went_down(e)
        return await fallback()

    # -- locks -------------------------------------------------------------------------------------

    async def try_lock(self, key: str, token: str, ttl: float) -> bool:
        async def work() -> bool:
            return bool(await self.redis.eval(HOLD, 1, self.prefix + key, token, int(ttl * 1000)))

        return await self._call(work, lambda: self.local.try_lock(key, token, ttl))

    async def unlock(self, key: str, token: str) -> None:
        async def work() -> None:
            await self.redis.eval(RELEASE, 1, self.prefix + key, token)

        await self.local.unlock(key, token)
        await self._call(work, _nothing)

    # -- idempotency -------------------------------------------------------------------------------

    async def idempotency_begin(
        self, key: str, fingerprint: str, ttl: float
    ) -> IdempotencyRecord | None:
        async def work() -> IdempotencyRecord | None:
            record = json.dumps({"fingerprint": fingerprint, "result": None})
            if await self.redis.set(self.prefix + key, record, nx=True, px=int(ttl * 1000)):
                return None
            return await self._idempotency_get(key)

        return await self._call(work, lambda: self.local.idempotency_begin(key, fingerprint, ttl))

    async def idempotency_finish(self, key: str, result: dict[str, Any], ttl: float) -> None:
        async def work() -> None:
            current = await self._idempotency_get(key)
            fingerprint = current.fingerprint if current else ""
            await self.redis.set(
                self.prefix + key,
                json.dumps({"fingerprint": fingerprint, "result": result}),
                px=int(ttl * 1000),
            )

        await self._call(work, lambda: self.local.idempotency_finish(key, result, ttl))

    async def idempotency_abandon(self, key: str) -> None:
        async def work() -> None:
            await self.redis.delete(self.prefix + key)

        await self._call(work, lambda: self.local.idempotency_abandon(key))

    async def idempotency_get(self, key: str) -> IdempotencyRecord | None:
        return await self._call(
            lambda: self._idempotency_get(key), lambda: self.local.idempotency_get(key)
        )

    async def _idempotency_get(self, key: str) -> IdempotencyRecord | None:
        raw = await self.redis.get(self.prefix + key)
        if raw is None:
            return None
        data = json.loads(raw)
        return IdempotencyRecord(data["fingerprint"], data["result"])

    # -- stop signals ------------------------------------------------------------------------------

    async def publish_stop(self, conversation_id: str) -> None:
        async def work() -> None:
            await self.redis.publish(self.stop_channel, conversation_id)

        # Handlers in this process are told at once; others through Redis.
        await self.local.deliver_stop(conversation_id)
        await self._call(work, _nothing)

    async def subscribe_stop(
        self, conversation_id: str, handler: StopHandler
    ) -> Callable[[], None]:
        return await self.local.subscribe_stop(conversation_id, handler)

    async def _listen(self) -> None:
        """Deliver stops published by other processes to this process's handlers."""
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.stop_channel)
                self._pubsub_ready.set()
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        await self.local.deliver_stop(str(message["data"]))
            except UNAVAILABLE + (RedisError,) as e:
                self._went_down(e)
                self._pubsub_ready.clear()
                await asyncio.sleep(self.probe_interval)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def wait_listening(self, timeout: float = 5.0) -> None:
        """Until this process receives stops from others (tests, start-up)."""
        await asyncio.wait_for(self._pubsub_ready.wait(), timeout)

    # -- rate limits -------------------------------------------------------------------------------

    async def rate_check(self, key: str, limit: int, window_s: float, cost: int) -> RateDecision:
        assert cost >= 0, cost

        async def work() -> RateDecision:
            allowed, previous, current, elapsed_ms = await self._rate(key, limit, window_s, cost)
            decision = sliding_window_decision(
                previous, current, elapsed_ms / window_ms(window_s), window_s, limit, cost
            )
            assert decision.allowed == bool(allowed), "the script decides as the Python does"
            return decision

        return await self._call(work, lambda: self.local.rate_check(key, limit, window_s, cost))

    async def rate_add(self, key: str, window_s: float, cost: int) -> None:
        async def work() -> None:
            await self._rate(key, COUNT_ANYWAY, window_s, cost)

        await self._call(work, lambda: self.local.rate_add(key, window_s, cost))

    async def _rate(self, key: str, limit: int | str, window_s: float, cost: int) -> list[int]:
        """Run RATE on `key`'s windows: [allowed, previous, current (before this cost),
        elapsed ms into the current window]."""
        now_ms = "" if self.clock is None else str(self.clock() // 1_000_000)
        reply = await self._rate_script(
            keys=[f"{self.prefix}rate:{key}"], args=[limit, window_ms(window_s), cost, now_ms]
        )
        return [int(value) for value in reply]

    # -- leases ------------------------------------------------------------------------------------

    async def acquire_lease(self, name: str, holder: str, ttl: float) -> bool:
        async def work() -> bool:
            return bool(
                await self.redis.eval(
                    HOLD, 1, f"{self.prefix}lease:{name}", holder, int(ttl * 1000)
                )
            )

        return await self._call(work, lambda: self.local.acquire_lease(name, holder, ttl))

    async def release_lease(self, name: str, holder: str) -> None:
        async def work() -> None:
            await self.redis.eval(RELEASE, 1, f"{self.prefix}lease:{name}", holder)

        await self.local.release_lease(name, holder)
        await self._call(work, _nothing)

    async def lease_holder(self, name: str) -> str | None:
        async def work() -> str | None:
            value = await self.redis.get(f"{self.prefix}lease:{name}")
            return None if value is None else str(value)

        return await self._call(work, lambda: self.local.lease_holder(name))

    # -- a reply's events: a Redis Stream per reply ------------------------------------------------

    async def append_event(self, stream: str, event: dict[str, Any], ttl: float) -> None:
        async def work() -> None:
            name = f"{self.prefix}events:{stream}"
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(
                    name,
                    {"event": json.dumps(event, ensure_ascii=False)},
                    maxlen=100_000,
                    approximate=True,
                )
                pipe.pexpire(name, int(ttl * 1000))
                await pipe.execute()

        # The local buffer too: a client of this process resumes from it if Redis goes away.
        await self.local.append_event(stream, event, ttl)
        await self._call(work, _nothing)

    async def read_events(self, stream: str, timeout: float) -> AsyncIterator[dict[str, Any]]:
        if not self._up:
            async for event in self.local.read_events(stream, timeout):
                yield event
            return
        name = f"{self.prefix}events:{stream}"
        last = "0-0"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                batches = await self.redis.xread({name: last}, block=500, count=500)
            except UNAVAILABLE as e:
                self._went_down(e)
                return
            for _, entries in cast(list[tuple[str, list[tuple[str, dict[str, str]]]]],
                                   batches or []):
                for entry_id, fields in entries:
                    last = entry_id
                    event = json.loads(fields["event"])
                    yield event
                    if event.get("type") in END_EVENTS:
                        return
                deadline = time.monotonic() + timeout


async def _nothing() -> None:
    return None
