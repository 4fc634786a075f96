"""Redis coordination (redis-py asyncio): what spans processes and replicas. Locks and leases
are SET NX PX with token-checked release, idempotency records JSON with a TTL, stop signals
pub/sub, rate limits two fixed windows weighted into a sliding one, a reply's events a Redis
Stream.

When Redis goes away the service keeps serving: every operation falls back to the in-process
coordinator (rate limits and stops then hold per process only), the change is logged once,
`healthy()` turns false (/readyz says degraded), and a probe brings Redis back in when it
answers again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
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
    sliding_window_count,
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


class RedisCoordinator(Coordinator):
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvchat:",
        probe_interval: float = 1.0,
        timeout: float = 2.0,
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
        self.local = LocalCoordinator()
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
        async def work() -> RateDecision:
            now = time.time()
            index = math.floor(now / window_s)
            elapsed = now / window_s - index
            names = [f"{self.prefix}rate:{key}:{index - 1}", f"{self.prefix}rate:{key}:{index}"]
            previous, current = await self.redis.mget(names)
            used = sliding_window_count(float(previous or 0), float(current or 0), elapsed)
            reset = (1.0 - elapsed) * window_s
            if used + cost > limit:
                return RateDecision(False, limit, max(0, int(limit - used)), reset, max(reset, 1.0))
            if cost:
                await self._count(names[1], window_s, cost)
            return RateDecision(True, limit, max(0, int(limit - used - cost)), reset, 0.0)

        return await self._call(work, lambda: self.local.rate_check(key, limit, window_s, cost))

    async def rate_add(self, key: str, window_s: float, cost: int) -> None:
        async def work() -> None:
            index = math.floor(time.time() / window_s)
            await self._count(f"{self.prefix}rate:{key}:{index}", window_s, cost)

        await self._call(work, lambda: self.local.rate_add(key, window_s, cost))

    async def _count(self, name: str, window_s: float, cost: int) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incrby(name, cost)
            pipe.pexpire(name, int(2 * window_s * 1000) + 1000)
            await pipe.execute()

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
