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

from kvchat.app.coord.base import (
    Coordinator,
    IdempotencyRecord,
    LockHolder,
    ProcessIdentity,
    RateDecision,
    StopHandler,
    sliding_window_decision,
    window_ms,
)
from kvchat.app.coord.local import END_EVENTS, LocalCoordinator

log = logging.getLogger(__name__)
T = TypeVar("T")

UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)
# close() cancels each background task this many times, a second apart, before leaving it:
# the process is exiting, and a task that swallows its cancellation must not hold it.
CLOSE_ATTEMPTS = 5
CLOSE_TIMEOUT_S = 5.0  # the most close() waits for the connection pool to close

# Delete a key only if it still holds our token (locks and leases).
RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
# Locks: the value is the holder's JSON record; KEYS[2] is the one fence counter.
# ARGV: token, ttl ms, fence floor, the holder's record without token and fence (JSON).
LOCK_ACQUIRE = """
local held = redis.call('get', KEYS[1])
if held then
  local holder = cjson.decode(held)
  if holder.token ~= ARGV[1] then return {0, held} end
  redis.call('pexpire', KEYS[1], ARGV[2])
  return {1, held}
end
local fence = tonumber(redis.call('get', KEYS[2]) or '0')
local floor = tonumber(ARGV[3])
if fence < floor then fence = floor end
fence = fence + 1
redis.call('set', KEYS[2], fence)
local holder = cjson.decode(ARGV[4])
holder.token = ARGV[1]
holder.fence = fence
local record = cjson.encode(holder)
redis.call('set', KEYS[1], record, 'PX', ARGV[2])
return {1, record}
"""
# ARGV: token [, ttl ms]: renew (with a ttl) or release (without) if the token holds the key.
LOCK_TOUCH = """
local held = redis.call('get', KEYS[1])
if not held or cjson.decode(held).token ~= ARGV[1] then return 0 end
if ARGV[2] then redis.call('pexpire', KEYS[1], ARGV[2]) else redis.call('del', KEYS[1]) end
return 1
"""
# Idempotency records: JSON {fingerprint, result, attempt}. ARGV[1]: the attempt id that must
# be running it; ARGV[2]: JSON fields to merge into the attempt (progress) or the new attempt
# (takeover, ARGV[3] == "1"). Returns the new record, or false.
IDEMPOTENCY_UPDATE = """
local raw = redis.call('get', KEYS[1])
if not raw then return false end
local record = cjson.decode(raw)
if record.result ~= cjson.null and record.result ~= nil then return false end
if record.attempt == nil or record.attempt.id ~= ARGV[1] then return false end
local fields = cjson.decode(ARGV[2])
if ARGV[3] == '1' then
  record.attempt = fields
else
  for k, v in pairs(fields) do record.attempt[k] = v end
end
local encoded = cjson.encode(record)
redis.call('set', KEYS[1], encoded, 'KEEPTTL')
return encoded
"""
# Finish a record with its result (ARGV[2], JSON; ARGV[3]: its TTL in ms) if the attempt
# ARGV[1] still runs it; 1 if it did.
IDEMPOTENCY_FINISH = """
local raw = redis.call('get', KEYS[1])
if not raw then return 0 end
local record = cjson.decode(raw)
if record.result ~= cjson.null and record.result ~= nil then return 0 end
if record.attempt == nil or record.attempt.id ~= ARGV[1] then return 0 end
record.result = cjson.decode(ARGV[2])
redis.call('set', KEYS[1], cjson.encode(record), 'PX', ARGV[3])
return 1
"""
IDEMPOTENCY_ABANDON = """
if ARGV[1] == '' then return redis.call('del', KEYS[1]) end
local raw = redis.call('get', KEYS[1])
if not raw then return 0 end
local record = cjson.decode(raw)
if record.attempt == nil or record.attempt.id ~= ARGV[1] then return 0 end
if record.result ~= cjson.null and record.result ~= nil then return 0 end
return redis.call('del', KEYS[1])
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
        self.local = LocalCoordinator(rate_clock=clock or time.time_ns)
        self.probe_interval = probe_interval
        self._up = True
        self._tasks: list[asyncio.Task[None]] = []
        self._pubsub_ready = asyncio.Event()
        self._closing = False

    # -- life and health ---------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self.redis.ping()
        except UNAVAILABLE as e:
            self._went_down(e)
        self._tasks = [asyncio.create_task(self._probe()), asyncio.create_task(self._listen())]

    async def close(self) -> None:
        # A task cancelled while redis-py is still subscribing can swallow the cancellation
        # (it stays inside pubsub.listen()): the listener also stops at `_closing`, and each
        # task is cancelled again, a bounded number of times.
        self._closing = True
        for task in self._tasks:
            for _ in range(CLOSE_ATTEMPTS):
                if task.done():
                    break
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(task), 1.0)
            if not task.done():
                log.warning(
                    "closing Redis coordination: task %s ignored %d cancellations; left behind",
                    task.get_name(),
                    CLOSE_ATTEMPTS,
                )
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.redis.aclose(), CLOSE_TIMEOUT_S)

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

    async def lock_acquire(
        self,
        key: str,
        identity: ProcessIdentity,
        token: str,
        ttl: float,
        *,
        purpose: str,
        fence_floor: int = 0,
        data: dict[str, Any] | None = None,
    ) -> tuple[bool, LockHolder]:
        async def work() -> tuple[bool, LockHolder]:
            partial = {
                "owner": identity.replica_id,
                "host": identity.host,
                "pid": identity.pid,
                "instance": identity.instance,
                "purpose": purpose,
                "data": data or {},
            }
            taken, raw = await self.redis.eval(
                LOCK_ACQUIRE,
                2,
                f"{self.prefix}lock:{key}",
                f"{self.prefix}fence",
                token,
                max(1, int(ttl * 1000)),
                int(fence_floor),
                json.dumps(partial),
            )
            return bool(taken), LockHolder.of(json.loads(raw))

        return await self._call(
            work,
            lambda: self.local.lock_acquire(
                key, identity, token, ttl, purpose=purpose, fence_floor=fence_floor, data=data
            ),
        )

    async def lock_renew(self, key: str, token: str, ttl: float) -> bool:
        async def work() -> bool:
            return bool(
                await self.redis.eval(
                    LOCK_TOUCH, 1, f"{self.prefix}lock:{key}", token, max(1, int(ttl * 1000))
                )
            )

        return await self._call(work, lambda: self.local.lock_renew(key, token, ttl))

    async def lock_release(self, key: str, token: str) -> bool:
        async def work() -> bool:
            return bool(await self.redis.eval(LOCK_TOUCH, 1, f"{self.prefix}lock:{key}", token))

        released_here = await self.local.lock_release(key, token)
        return await self._call(work, _false) or released_here

    async def lock_holder(self, key: str) -> LockHolder | None:
        async def work() -> LockHolder | None:
            raw = await self.redis.get(f"{self.prefix}lock:{key}")
            return None if raw is None else LockHolder.of(json.loads(raw))

        return await self._call(work, lambda: self.local.lock_holder(key))

    async def lock_scan(self, prefix: str) -> list[tuple[str, LockHolder]]:
        async def work() -> list[tuple[str, LockHolder]]:
            head = f"{self.prefix}lock:"
            names = [
                name
                async for name in self.redis.scan_iter(
                    match=f"{head}{_glob_escape(prefix)}*", count=500
                )
            ]
            found: list[tuple[str, LockHolder]] = []
            for start in range(0, len(names), 500):
                chunk = names[start : start + 500]
                for name, raw in zip(chunk, await self.redis.mget(chunk)):
                    if raw is not None:
                        found.append((name[len(head) :], LockHolder.of(json.loads(raw))))
            return found

        return await self._call(work, lambda: self.local.lock_scan(prefix))

    # -- idempotency -------------------------------------------------------------------------------

    async def idempotency_begin(
        self, key: str, fingerprint: str, ttl: float, attempt: dict[str, Any] | None = None
    ) -> IdempotencyRecord | None:
        async def work() -> IdempotencyRecord | None:
            record = IdempotencyRecord(fingerprint, attempt=dict(attempt or {}))
            if await self.redis.set(
                self.prefix + key, json.dumps(record.record()), nx=True, px=int(ttl * 1000)
            ):
                return None
            return await self._idempotency_get(key)

        return await self._call(
            work, lambda: self.local.idempotency_begin(key, fingerprint, ttl, attempt)
        )

    async def idempotency_progress(self, key: str, attempt_id: str, fields: dict[str, Any]) -> bool:
        async def work() -> bool:
            return bool(
                await self.redis.eval(
                    IDEMPOTENCY_UPDATE, 1, self.prefix + key, attempt_id, json.dumps(fields), "0"
                )
            )

        return await self._call(
            work, lambda: self.local.idempotency_progress(key, attempt_id, fields)
        )

    async def idempotency_takeover(
        self, key: str, dead_attempt_id: str, attempt: dict[str, Any]
    ) -> IdempotencyRecord | None:
        async def work() -> IdempotencyRecord | None:
            raw = await self.redis.eval(
                IDEMPOTENCY_UPDATE, 1, self.prefix + key, dead_attempt_id, json.dumps(attempt), "1"
            )
            return IdempotencyRecord.of(json.loads(raw)) if raw else None

        return await self._call(
            work, lambda: self.local.idempotency_takeover(key, dead_attempt_id, attempt)
        )

    async def idempotency_finish(
        self, key: str, result: dict[str, Any], ttl: float, attempt_id: str | None = None
    ) -> None:
        async def work() -> None:
            if attempt_id is not None:
                await self.redis.eval(
                    IDEMPOTENCY_FINISH,
                    1,
                    self.prefix + key,
                    attempt_id,
                    json.dumps(result),
                    str(int(ttl * 1000)),
                )
                return
            current = await self._idempotency_get(key)
            record = IdempotencyRecord(
                current.fingerprint if current else "", result, current.attempt if current else {}
            )
            await self.redis.set(self.prefix + key, json.dumps(record.record()), px=int(ttl * 1000))

        await self._call(work, lambda: self.local.idempotency_finish(key, result, ttl, attempt_id))

    async def idempotency_abandon(self, key: str, attempt_id: str | None = None) -> None:
        async def work() -> None:
            await self.redis.eval(IDEMPOTENCY_ABANDON, 1, self.prefix + key, attempt_id or "")

        await self._call(work, lambda: self.local.idempotency_abandon(key, attempt_id))

    async def idempotency_get(self, key: str) -> IdempotencyRecord | None:
        return await self._call(
            lambda: self._idempotency_get(key), lambda: self.local.idempotency_get(key)
        )

    async def _idempotency_get(self, key: str) -> IdempotencyRecord | None:
        raw = await self.redis.get(self.prefix + key)
        return None if raw is None else IdempotencyRecord.of(json.loads(raw))

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
        while not self._closing:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.stop_channel)
                self._pubsub_ready.set()
                async for message in pubsub.listen():
                    if self._closing:
                        return
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

    async def take_lease(self, name: str, holder: str, ttl: float) -> str | None:
        async def work() -> str | None:
            previous = await self.redis.set(
                f"{self.prefix}lease:{name}", holder, px=int(ttl * 1000), get=True
            )
            return None if previous is None else str(previous)

        return await self._call(work, lambda: self.local.take_lease(name, holder, ttl))

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

    async def buffered_events(self, stream: str) -> list[dict[str, Any]]:
        async def work() -> list[dict[str, Any]]:
            entries = cast(
                list[tuple[str, dict[str, str]]],
                await self.redis.xrange(f"{self.prefix}events:{stream}") or [],
            )
            return [json.loads(fields["event"]) for _, fields in entries]

        return await self._call(work, lambda: self.local.buffered_events(stream))

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
            for _, entries in cast(
                list[tuple[str, list[tuple[str, dict[str, str]]]]], batches or []
            ):
                for entry_id, fields in entries:
                    last = entry_id
                    event = json.loads(fields["event"])
                    yield event
                    if event.get("type") in END_EVENTS:
                        return
                deadline = time.monotonic() + timeout


async def _nothing() -> None:
    return None


async def _false() -> bool:
    return False


def _glob_escape(text: str) -> str:
    """`text` as a literal inside a Redis MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
