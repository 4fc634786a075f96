"""Locks this process holds: owned (a token per acquisition, the process named in the record),
fenced (each acquisition gets a fence above every earlier one; the store refuses a turn whose
fence is older than the last one it saw) and short-lived (a few seconds), renewed while the
work runs, released on every exit path, and taken over when the holder is known dead (an
earlier incarnation of this replica, or a process of this host that is gone) or its lease ran
out. The lease pattern Redis' own documentation recommends over long TTLs: a crashed holder
frees what it held within one TTL, a live one never loses it while it renews."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any

from kvchat.app.coord.base import Coordinator, LockHolder, ProcessIdentity

log = logging.getLogger(__name__)

RENEWER_EXIT_S = 10.0  # the most release() waits for the renewer to stop


class HeldLock:
    """A lock held by this process, renewed every `ttl / 3` until `release()`. When a renewal
    finds the lock gone (it expired or was broken while this process could not renew it),
    `lost` is set and `on_lost` is called once: the work it guarded must stop."""

    def __init__(self, locks: Locks, key: str, holder: LockHolder) -> None:
        self.locks = locks
        self.key = key
        self.holder = holder
        self.lost = asyncio.Event()
        self.on_lost: Callable[[], None] | None = None
        self._released = False
        self._renewer = asyncio.ensure_future(self._renew())

    @property
    def token(self) -> str:
        return self.holder.token

    @property
    def fence(self) -> int:
        return self.holder.fence

    async def _renew(self) -> None:
        # It also stops at `_released`: a cancellation that lands as a command's own timeout
        # fires is turned into that TimeoutError (asyncio.timeout's race), which the loop
        # below would take for a failed renewal and go on.
        coord, ttl = self.locks.coord, self.locks.ttl
        while not self._released:
            await asyncio.sleep(ttl / 3)
            if self._released:
                return
            try:
                renewed = await coord.lock_renew(self.key, self.token, ttl)
            except Exception:
                if not self._released:
                    log.exception("renewing lock %s failed", self.key)
                continue
            if not renewed and await coord.healthy():
                log.warning("lock %s was lost (expired or taken over)", self.key)
                self.lost.set()
                if self.on_lost is not None:
                    self.on_lost()
                return

    async def release(self) -> None:
        """Stop renewing and release the lock (idempotent; never raises)."""
        if self._released:
            return
        self._released = True
        self._renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            # bounded: a renewal in flight ends by its command's timeout at the latest
            await asyncio.wait_for(asyncio.shield(self._renewer), RENEWER_EXIT_S)
        try:
            await self.locks.coord.lock_release(self.key, self.token)
        except Exception:
            log.exception(
                "releasing lock %s failed; it expires in %.0f s", self.key, self.locks.ttl
            )


class Locks:
    """The locks of one process: `acquire` takes a key (or says who holds it), breaking the
    lock of a holder known dead; `reclaim_dead` does that for every lock at start-up."""

    def __init__(self, coord: Coordinator, identity: ProcessIdentity, ttl: float) -> None:
        if ttl <= 0:
            raise ValueError(f"lock ttl must be > 0, got {ttl}")
        self.coord = coord
        self.identity = identity
        self.ttl = ttl

    async def acquire(
        self,
        key: str,
        *,
        purpose: str,
        fence_floor: int = 0,
        data: dict[str, Any] | None = None,
    ) -> HeldLock | LockHolder:
        """The lock, held and renewed from now on; or, when a live holder has it, that
        holder."""
        token = uuid.uuid4().hex
        for _ in range(2):
            taken, holder = await self.coord.lock_acquire(
                key,
                self.identity,
                token,
                self.ttl,
                purpose=purpose,
                fence_floor=fence_floor,
                data=data,
            )
            if taken:
                return HeldLock(self, key, holder)
            if not self.identity.is_dead(holder):
                return holder
            log.warning(
                "taking over lock %s from %s (pid %d), which is gone", key, holder.owner, holder.pid
            )
            await self.coord.lock_release(key, holder.token)
        return holder

    async def reclaim_dead(self, prefix: str = "") -> list[tuple[str, LockHolder]]:
        """Break every lock (under `prefix`) whose holder is known dead; returns them."""
        broken = []
        for key, holder in await self.coord.lock_scan(prefix):
            if self.identity.is_dead(holder) and await self.coord.lock_release(key, holder.token):
                broken.append((key, holder))
        return broken
