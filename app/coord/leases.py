"""Session ownership leases: which process holds a conversation's newest pinned KV. A lease is
taken when a turn leaves its session pinned — taken over from another replica if that one
held it (the turn ran under the conversation's fenced turn lock, so this replica's copy is now
the newest) — renewed while the session holds KV (on the device, the host, or only in this
replica's KV store, token ids kept to load it back), and released when it holds none (dropped
for good, closed), and at shutdown. A replica whose lease was taken over
stops renewing it and keeps its copy for the LRU to age out.

Why a replica's copy that another replica's turns made stale is harmless: KV is a function of
token ids and their positions only (causal attention: the K and V of token i depend on tokens
0..i and nothing after). The engine reuses a session's pinned KV only over the longest common
prefix of its pinned token ids and the new prompt (memory/sessions.py, `claim`), and the
prompt is rendered from the stored history, including what other replicas added. Whatever
those turns changed — new messages, an edit, a regenerated reply, a trim or a summary — makes
the token ids diverge at the first changed token, and the KV past that point is released, never
read; the KV before it is exactly what a recompute would produce. Windowed turns pin only KV
that full attention would have computed (inference/engine/scheduler.py, `remove`). So a stale
copy is reused as far as it is right and no further, with no epoch to compare; the lease only says
where the newest copy is, and a turn that finds another replica held it counts in
`kvchat:session_moves`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable

from kvchat.app.coord import Coordinator
from kvchat.app.coord.locks import RENEWER_EXIT_S
from kvchat.app.engine_client import EngineClient
from kvchat.inference import EngineDeadError

log = logging.getLogger(__name__)


def lease_name(conversation_id: str) -> str:
    return f"session:{conversation_id}"


def default_replica_id(port: int) -> str:
    return f"{socket.gethostname()}:{port}:{os.getpid()}"


class LeaseKeeper:
    def __init__(
        self,
        coord: Coordinator,
        engine: EngineClient,
        holder: str,
        ttl: float,
        on_move: Callable[[], None] = lambda: None,
    ) -> None:
        self.coord = coord
        self.engine_client = engine
        self.on_move = on_move  # a session came here from another replica (a metric counts)
        self.holder = holder
        self.ttl = ttl
        self.held: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._renew_forever())

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                # bounded: a cancellation lost in a command's timeout still ends the loop at
                # `_closing` (see HeldLock._renew)
                await asyncio.wait_for(asyncio.shield(self._task), RENEWER_EXIT_S)
        for conversation_id in list(self.held):
            await self.release(conversation_id)

    async def _holds_kv(self, conversation_id: str) -> bool:
        """Whether the session holds KV (on the device, the host, or in its running turn), as
        the engine thread answers; an engine that stopped holds none."""
        try:
            info = await self.engine_client.session_info(conversation_id)
        except EngineDeadError:
            return False
        return info is not None and info.holds_kv

    async def hold(self, conversation_id: str) -> None:
        """After a turn (which held the conversation's turn lock): lease the session if it
        pinned KV, from whichever replica held it before."""
        if await self._holds_kv(conversation_id):
            previous = await self.coord.take_lease(
                lease_name(conversation_id), self.holder, self.ttl
            )
            self.held.add(conversation_id)
            if previous is not None and previous != self.holder:
                self.on_move()
                log.info("session %s moved here from %s", conversation_id, previous)
        else:
            await self.release(conversation_id)

    async def release(self, conversation_id: str) -> None:
        self.held.discard(conversation_id)
        await self.coord.release_lease(lease_name(conversation_id), self.holder)

    async def sync(self) -> None:
        """Renew the leases of sessions that still hold KV; release the others; forget those
        another replica took over (its turns made this copy stale)."""
        for conversation_id in list(self.held):
            if not await self._holds_kv(conversation_id):
                await self.release(conversation_id)
            elif not await self.coord.acquire_lease(
                lease_name(conversation_id), self.holder, self.ttl
            ):
                self.held.discard(conversation_id)

    async def _renew_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.ttl / 3)
            if self._closing:
                return
            try:
                await self.sync()
            except Exception:
                if not self._closing:
                    log.exception("renewing session leases failed")
