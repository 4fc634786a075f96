"""Runtime: the engine side of the service, built once at start-up: the async engine (its
thread owned by the app's lifespan), the tokenizer, the chat template and the context builder,
and the worker threads that run a turn's CPU-bound work (templates, tokenizing, planning,
schema compiles) off the event loop. The service reaches the model only through this object."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import ParamSpec, TypeVar

from inference.async_engine import AsyncEngine
from inference.chat_template import ChatTemplate, load_chat_template
from inference.context_builder import ContextBuilder
from inference.engine import Engine
from inference.errors import ModelLoadError
from inference.tokenizer import Tokenizer

from app.ops.metrics import Metrics
from app.settings import Settings

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")
CPU_WORKERS = 2  # a long job (a huge message) leaves the other worker to the next turns


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = Engine(settings.engine_config())
        if self.engine.tokenizer is None:
            raise ModelLoadError(
                f"{settings.model} has no tokenizer files; the chat service needs one "
                "(tokenizer.json, tokenizer.model or a tokenizer_config.json)"
            )
        self.tokenizer: Tokenizer = self.engine.tokenizer
        self.template: ChatTemplate = load_chat_template(settings.model, self.tokenizer)
        self.builder = ContextBuilder(self.template, self.tokenizer)
        self.grammars = self.engine.grammars  # built now, not on a first structured request
        self.async_engine = AsyncEngine(self.engine)
        self.model_name = settings.model_name
        self.metrics = Metrics(self.engine)
        self._cpu = ThreadPoolExecutor(CPU_WORKERS, thread_name_prefix="kvchat-cpu")

    def start(self) -> None:
        self.async_engine.start()

    async def run_cpu(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a worker thread: CPU-bound work of a request (templates,
        tokenizing, planning, schema compiles), so one big conversation never stalls the
        event loop and everyone else's streams."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._cpu, functools.partial(fn, *args, **kwargs))

    async def shutdown(self, drain_timeout: float) -> None:
        """Finish or abort in-flight requests (their callers store them), stop the thread."""
        await asyncio.to_thread(self.async_engine.shutdown, drain_timeout)
        self._cpu.shutdown(wait=False, cancel_futures=True)

    def notify(self) -> None:
        """Wake the engine thread for queued operator work (an eviction) when it is idle."""
        self.async_engine.notify()

    @property
    def is_running(self) -> bool:
        return self.async_engine.is_running

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_waiting(self) -> int:
        """Requests queued in the engine, not yet running (read from another thread: a
        snapshot, good enough for admission control)."""
        return len(self.engine.scheduler.waiting)

    @cached_property
    def generation_prompt_tokens(self) -> int:
        return self.builder.generation_prompt_tokens()
