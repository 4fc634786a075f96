"""EngineThread: the one thread that does an engine's torch work, from building the model (its
weights, the linear paths' start-up measurements, the KV pool) to every step.

On the CPU, torch's intra-op parallelism is OpenMP, and libgomp keeps a pool of worker threads
for each thread that starts parallel work. Once it manages more threads than there are CPUs it
stops letting its idle workers spin between parallel regions: they sleep, and every region
(a decode step runs about fifty) pays for waking them. An engine built on the main thread and
stepped on another made two pools: on two cores (Zen 4) a decode step of the bench model then
took 22 ms in `kvchat serve` against 13 ms built and stepped on one thread. Built and
stepped on this thread, the process has one pool, the engine's."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread that runs calls one after another: setup calls, answered as they finish,
    then a last one (the engine loop), after which the thread ends."""

    def __init__(self, name: str = "kvchat-engine") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._closed = False
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on the thread; its result or its exception, here."""
        future: Future[T] = Future()

        def job() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:  # the caller gets it, whatever it is
                future.set_exception(e)

        self._submit(job)
        return future.result()

    def run_last(self, fn: Callable[[], None]) -> None:
        """fn() as the thread's final call, without waiting for it; the thread ends after it."""
        self._submit(fn)
        self.close()

    def close(self) -> None:
        """No more calls: the thread ends once the queued ones have run. Idempotent."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    def _submit(self, job: Callable[[], None]) -> None:
        if self._closed:
            raise RuntimeError("the engine thread takes no more calls")
        self._jobs.put(job)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
