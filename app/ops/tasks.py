"""Work that outlives the request that started it (summaries, the token count of a turn whose
client left): kept referenced so it is not collected mid-way, and awaited at shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the tasks running now."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
