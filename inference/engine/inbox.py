"""EngineInbox: what other threads hand the engine thread, taken in at the start of each step
in the order it was given: new requests and aborts (applied then), and calls (operator
commands and queries: evict a session, set its budget, close it, report on it), which the
engine runs at the end of that step.

A call returns a `concurrent.futures.Future` that the engine thread resolves once the call has
run there, so the caller learns the outcome (the session's state after an eviction) instead of
polling for it; asyncio callers await it through `asyncio.wrap_future`, which hands the result
to their event loop with `call_soon_threadsafe`. A call whose future was cancelled before the
engine took it does not run. When the engine thread stops, whoever stops it fails the calls
still queued (`fail_calls`), so no caller waits forever; each item is taken from the queue by
exactly one thread, so no future is resolved twice."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .sequence import Sequence

T = TypeVar("T")


@dataclass(frozen=True)
class AddRequest:
    seq: Sequence


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    reason: str


@dataclass(frozen=True)
class Call(Generic[T]):
    fn: Callable[[], T]
    future: Future[T]

    def run(self) -> None:
        """Run on the engine thread and resolve the future. An exception is the caller's answer
        and is raised again: a command that fails is an engine bug, and the engine thread's
        rule for those is to stop (failing every open stream) rather than go on in an
        unknown state."""
        if not self.future.set_running_or_notify_cancel():
            return  # cancelled by its caller before it ran
        try:
            result = self.fn()
        except BaseException as e:
            self.future.set_exception(e)
            raise
        self.future.set_result(result)


InboxItem = AddRequest | AbortRequest | Call[Any]


class EngineInbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()

    def add(self, seq: Sequence) -> None:
        self._queue.put(AddRequest(seq))

    def abort(self, request_id: str, reason: str) -> None:
        self._queue.put(AbortRequest(request_id, reason))

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn` for the engine thread; the future gives its result once it has run."""
        future: Future[T] = Future()
        self._queue.put(Call(fn, future))
        return future

    def empty(self) -> bool:
        return self._queue.empty()

    def take(self) -> Iterator[InboxItem]:
        """The items queued, oldest first, until none is left (items queued meanwhile
        included)."""
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def fail_calls(self, error: BaseException) -> None:
        """The engine thread is gone: answer every queued call with `error`; requests and
        aborts queued with them are dropped (their streams are failed by whoever stopped the
        engine)."""
        for item in self.take():
            if isinstance(item, Call) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(error)
