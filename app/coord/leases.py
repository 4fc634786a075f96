"""Session ownership leases: which process holds a conversation's pinned KV. A lease is taken
when a turn leaves its session pinned, renewed while the session holds KV (on the device or
the host), and released when the session is dropped or evicted, and at shutdown. The base
for routing a conversation to the replica that holds it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from inference import EngineDeadError

from app.coord import Coordinator
from app.runtime import Runtime

log = logging.getLogger(__name__)


def lease_name(conversation_id: str) -> str:
    return f"session:{conversation_id}"


def default_replica_id(port: int) -> str:
    return f"{socket.gethostname()}:{port}:{os.getpid()}"


class LeaseKeeper:
    def __init__(self, coord: Coordinator, runtime: Runtime, holder: str, ttl: float) -> None:
        self.coord = coord
        self.runtime = runtime
        self.holder = holder
        self.ttl = ttl
        self.held: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._renew_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for conversation_id in list(self.held):
            await self.release(conversation_id)

    async def _holds_kv(self, conversation_id: str) -> bool:
        """Whether the session holds KV (on the device, the host, or in its running turn), as
        the engine thread answers; an engine that stopped holds none."""
        try:
            info = await self.runtime.async_engine.session_info(conversation_id)
        except EngineDeadError:
            return False
        return info is not None and info.holds_kv

    async def hold(self, conversation_id: str) -> None:
        """After a turn: lease the session if it pinned KV."""
        if await self._holds_kv(conversation_id):
            if await self.coord.acquire_lease(lease_name(conversation_id), self.holder,
                                              self.ttl):
                self.held.add(conversation_id)
            else:
                log.warning("session %s is leased to another process", conversation_id)
        else:
            await self.release(conversation_id)

    async def release(self, conversation_id: str) -> None:
        self.held.discard(conversation_id)
        await self.coord.release_lease(lease_name(conversation_id), self.holder)

    async def sync(self) -> None:
        """Renew the leases of sessions that still hold KV; release the others."""
        for conversation_id in list(self.held):
            if await self._holds_kv(conversation_id):
                await self.coord.acquire_lease(lease_name(conversation_id), self.holder,
                                               self.ttl)
            else:
                await self.release(conversation_id)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self.sync()
            except Exception:
                log.exception("renewing session leases failed")
