"""AsyncEngine: runs the engine loop on its own thread and streams each request's outputs to
an asyncio consumer. Cancelling the consumer (client gone, stop pressed) aborts the request
within one engine step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .engine import Engine
from .request_output import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an internal error; no further requests are served."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvchat-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them; the last is finished.
        Validation errors raise before anything is yielded."""
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error!r}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._streams[request_id] = stream
        try:
            self.engine.add_request(
                request_id, prompt_token_ids, params, session_id=session_id, cache_salt=cache_salt
            )
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item!r}") from item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stopped:
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as e:  # an engine bug: fail every open stream, loudly
            log.exception("engine loop stopped")
            self._error = e
            with self._lock:
                streams = list(self._streams.items())
            for request_id, _ in streams:
                self._deliver(request_id, e)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:  # the consumer left; its abort is already queued
            return
        with contextlib.suppress(RuntimeError):  # the consumer's event loop may be closed
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
