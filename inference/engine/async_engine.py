"""AsyncEngine: runs the engine loop on its own thread and streams each request's outputs to
an asyncio consumer. Cancelling the consumer (client gone, stop pressed) aborts the request
within one engine step.

Life cycle: `AsyncEngine.build(config)` builds the engine on the thread that will run its loop
(inference/engine/thread.py says why that matters on the CPU); `start()` starts the loop;
`shutdown(drain_timeout)` stops taking new requests, lets running ones finish for up to
`drain_timeout` seconds, aborts the rest (their final output says finish_reason "abort",
abort_reason "shutdown", so the caller can store them as interrupted) and stops the thread. A
consumer whose request can no longer finish (the engine stopped or died) gets
`EngineDeadError`; it never waits forever.

Each request id has at most one stream; a stream only ever removes itself, so a rejected
duplicate or a quick reuse of a finished id never disturbs another request's stream.

Operator commands and reports are awaitable: `evict_session`, `set_session_budget`,
`close_session`, `session_info`, `memory_report` run on the engine thread at its next step
(the thread is woken for them) and answer with what that step found, through a
`concurrent.futures.Future` that `asyncio.wrap_future` hands to the caller's event loop. They
raise `EngineDeadError` when the engine is not running or stops before answering. `stats` is
the engine's latest published EngineStats, for any thread. Nothing here reads the engine's
queues, pools or sessions from another thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from kvchat.memory.config import SessionBudget

from ..errors import EngineDeadError, InvalidRequestError, RequestFailedError
from .checks import CheckedRequest
from .config import EngineConfig
from .engine import Engine
from .host_memory import HeapTrimmer
from .priority import PRIORITY_NORMAL
from .reports import EngineStats, MemoryReport, SessionEviction, SessionInfo
from .request_output import RequestOutput
from .thread import EngineThread

log = logging.getLogger(__name__)

# How often a stepping thread whose requests all wait (nothing to run) looks again.
WAITING_POLL_S = 0.01

T = TypeVar("T")

__all__ = ["AsyncEngine", "EngineDeadError"]


@dataclass(eq=False)
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, engine: Engine, *, thread: EngineThread | None = None) -> None:
        """`thread`: the thread the engine was built on (`build`), which then runs its loop;
        None starts a thread of its own."""
        self.engine = engine
        self._owner = thread
        self._streams: dict[str, _Stream] = {}
        # Guards _streams, _accepting and _dead together: a request (or a call) is either
        # queued before the engine stops (and then answered, or failed by _fail_all) or
        # refused.
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._accepting = False
        self._dead: BaseException | None = None
        self._stop = threading.Event()  # stop after the current step
        self._stop_when_idle = threading.Event()  # stop once nothing is left to step
        self._thread: threading.Thread | None = None

    # -- life cycle --------------------------------------------------------------------------------

    @classmethod
    def build(cls, config: EngineConfig) -> AsyncEngine:
        """The engine built on its own thread, the one its loop will run on: all of its torch
        work then happens on one thread."""
        thread = EngineThread()
        try:
            engine = thread.call(lambda: Engine(config))
        except BaseException:
            thread.close()
            raise
        return cls(engine, thread=thread)

    def start(self) -> None:
        """Start the engine loop (once)."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("the engine was already started")
            self._accepting = True
            if self._owner is not None:
                self._thread = self._owner.thread
                self._owner.run_last(self._run)
                return
            self._thread = threading.Thread(target=self._run, name="kvchat-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self._accepting
            and self._dead is None
        )

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine loop, if it died."""
        return self._dead

    def shutdown(self, drain_timeout: float = 10.0, join_timeout: float = 10.0) -> None:
        """Stop taking requests; give running ones `drain_timeout` seconds to finish, abort the
        rest with abort_reason "shutdown", then stop the thread once it has delivered their
        final outputs (at most `join_timeout` later). Idempotent."""
        with self._lock:
            self._accepting = False
            if self._thread is None and self._owner is not None:
                self._owner.close()  # built, never started: the thread ends now
        thread = self._thread
        if thread is not None and thread.is_alive():
            deadline = time.monotonic() + drain_timeout
            while self.engine.unfinished_request_ids and time.monotonic() < deadline:
                if not thread.is_alive():
                    break
                time.sleep(0.01)
            for request_id in self.engine.unfinished_request_ids:
                self.engine.abort_request(request_id, reason="shutdown")
            # The thread processes the aborts (delivering their final outputs) and whatever
            # else is queued, then stops by itself.
            self._stop_when_idle.set()
            self._wake.set()
            thread.join(join_timeout)
            self._stop.set()
            self._wake.set()
            thread.join(join_timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))

    # -- requests --------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        request: CheckedRequest,
        *,
        cache_salt: str | None = None,
        priority: int = PRIORITY_NORMAL,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them; the last is finished.
        `request` comes from `engine.check_request` (whose errors are the caller's to answer);
        a request id in use raises before anything is yielded; `EngineDeadError` when the
        engine is not running or stops before the request ends; `RequestFailedError` when a
        step it was in failed (the engine goes on)."""
        stream = _Stream(request_id, asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine stopped: {self._dead!r}")
            if not self._accepting:
                raise EngineDeadError("the engine is not running (not started or shut down)")
            if request_id in self._streams:
                raise InvalidRequestError(
                    f"request id {request_id!r} is already in use", field="request_id"
                )
            self._streams[request_id] = stream
        try:
            self.engine.add_checked_request(
                request_id, request, cache_salt=cache_salt, priority=priority
            )
        except BaseException:
            self._remove(stream)
            raise
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, EngineDeadError | RequestFailedError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item!r}") from item
                finished = item.finished
                yield item
        finally:
            self._remove(stream)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        self.engine.abort_request(request_id, reason)
        self._wake.set()

    # -- operator commands and reports (answered by the engine thread) --------------------------

    @property
    def stats(self) -> EngineStats:
        """The stats the engine thread published after its latest step (any thread)."""
        return self.engine.published_stats

    async def evict_session(self, session_id: str, *, offload: bool = True) -> SessionEviction:
        """Offload (or drop) an idle session's KV; answers with the session just before and
        just after."""
        return await self._on_engine_thread(
            lambda: self.engine.evict_session(session_id, offload=offload)
        )

    async def set_session_budget(
        self, session_id: str, budget: SessionBudget
    ) -> SessionInfo | None:
        """Change a session's budget (from its next turn on); answers with the session."""
        return await self._on_engine_thread(
            lambda: self.engine.set_session_budget(session_id, budget)
        )

    async def note_session(
        self,
        session_id: str,
        *,
        end: str | None = None,
        typing: bool = False,
        present: bool | None = None,
    ) -> None:
        """What the service knows of a session's next turn (Engine.note_session)."""
        await self._on_engine_thread(
            lambda: self.engine.note_session(session_id, end=end, typing=typing, present=present)
        )

    async def close_session(self, session_id: str) -> None:
        """Forget a session and free its KV."""
        await self._on_engine_thread(lambda: self.engine.close_session(session_id))

    async def session_info(self, session_id: str) -> SessionInfo | None:
        return await self._on_engine_thread(
            lambda: self.engine.submit(lambda: self.engine.session_info(session_id))
        )

    async def memory_report(self) -> MemoryReport:
        return await self._on_engine_thread(lambda: self.engine.submit(self.engine.memory_report))

    async def _on_engine_thread(self, submit: Callable[[], Future[T]]) -> T:
        """Queue a call (refused when the engine is not running: it would never be answered),
        wake the thread, await its answer."""
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine stopped: {self._dead!r}")
            if not self._accepting:
                raise EngineDeadError("the engine is not running (not started or shut down)")
            future = submit()
        self._wake.set()
        return await asyncio.wrap_future(future)

    # -- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        trimmer = HeapTrimmer() if self.engine.device.type == "cpu" else None
        try:
            while not self._stop.is_set():
                if trimmer is not None:
                    trimmer.maybe_trim()
                if not self.engine.has_unfinished_requests():
                    if self._stop_when_idle.is_set():
                        return
                    self.engine.maintain_sessions()  # prefetches come due while idle too
                    self._wake.wait(timeout=self.engine.idle_wait_s)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out)
                if self.engine.stepped_nothing:
                    # Requests wait and nothing runs (a held session's hold, say): no spinning;
                    # a new request or command wakes the loop at once.
                    self._wake.wait(timeout=WAITING_POLL_S)
                    self._wake.clear()
        except BaseException as e:  # an engine bug: fail every open stream, loudly
            log.exception("engine loop stopped")
            with self._lock:
                self._dead = e
                self._accepting = False
            self._fail_all(e)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if stream is not None and out.finished:
                # Its last output: the id is free for reuse from now on.
                del self._streams[out.request_id]
        if stream is None:  # the consumer left; its abort is already queued
            return
        self._put(stream, out if out.error is None else RequestFailedError(out.error))

    def _fail_all(self, error: BaseException) -> None:
        """Fail every open stream and every queued command: nothing will answer them. Called
        once no further call can be queued (`_accepting` is off)."""
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            self._put(stream, error)
        dead = (
            error
            if isinstance(error, EngineDeadError)
            else EngineDeadError(f"the engine stopped: {error!r}")
        )
        self.engine.inbox.fail_calls(dead)

    def _remove(self, stream: _Stream) -> None:
        """A stream only ever removes itself, never another registered under the same id."""
        with self._lock:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]

    @staticmethod
    def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the consumer's event loop may be closed
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
