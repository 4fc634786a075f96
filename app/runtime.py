"""Runtime: the engine side of the service, built once at start-up: the async engine (its
thread owned by the app's lifespan), the tokenizer, the chat template, the context builder,
the history counters, the metrics, and the worker threads that run a turn's CPU-bound work
(templates, tokenizing, planning, schema compiles) off the event loop. The service reaches
the engine only through `engine_client` (app/engine_client.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import ParamSpec, TypeVar

from kvchat.app.engine_client import EngineClient, ThreadEngineClient
from kvchat.app.ops.history_counters import HistoryCounters
from kvchat.app.ops.metrics import Metrics
from kvchat.app.settings import Settings
from kvchat.inference import (
    AsyncEngine,
    ChatTemplate,
    ContextBuilder,
    GrammarCompiler,
    ModelLoadError,
    Tokenizer,
    branch_key,
    load_chat_template,
    prompt_key,
)
from kvchat.memory import KVStoreStats

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")
CPU_WORKERS = 2  # a long job (a huge message) leaves the other worker to the next turns


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Built on the engine's own thread, which then runs its loop (inference/engine/thread.py)
        self._client = ThreadEngineClient(AsyncEngine.build(settings.engine_config()))
        self.engine_client: EngineClient = self._client
        tokenizer = self._client.tokenizer
        if tokenizer is None:
            raise ModelLoadError(
                f"{settings.model} has no tokenizer files; the chat service needs one "
                "(tokenizer.json, tokenizer.model or a tokenizer_config.json)"
            )
        self.tokenizer: Tokenizer = tokenizer
        self.template: ChatTemplate = load_chat_template(settings.model, self.tokenizer)
        self.builder = ContextBuilder(self.template, self.tokenizer)
        # Built now, not on a first structured request.
        self.grammars: GrammarCompiler = self._client.grammars
        self.model_name = settings.model_name
        self.history = HistoryCounters()
        self.metrics = Metrics(lambda: self._client.stats, self.history)
        self._cpu = ThreadPoolExecutor(CPU_WORKERS, thread_name_prefix="kvchat-cpu")

    def start(self) -> None:
        self._client.start()

    async def run_cpu(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a worker thread: CPU-bound work of a request (templates,
        tokenizing, planning, schema compiles), so one big conversation never stalls the
        event loop and everyone else's streams."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._cpu, functools.partial(fn, *args, **kwargs))

    async def shutdown(self, drain_timeout: float) -> None:
        """Finish or abort in-flight requests (their callers store them), stop the thread."""
        await self._client.shutdown(drain_timeout)

    def close(self) -> None:
        """Stop the worker threads: last, once every turn has stored its reply (storing one
        measures it on a worker)."""
        self._cpu.shutdown(wait=False, cancel_futures=True)
        self._client.close_kv_store()

    async def forget_session(self, session_id: str) -> None:
        """A conversation was deleted: its KV freed, its history counters and rendered
        segments forgotten."""
        await self.engine_client.close_session(session_id)
        self.history.forget(session_id)
        self.builder.renderer.forget(branch_key(session_id))
        self.builder.renderer.forget(prompt_key(session_id))

    @property
    def is_running(self) -> bool:
        return self._client.is_running

    @property
    def kv_store(self) -> KVStoreStats | None:
        """The KV store as the engine thread last published it (None: no store)."""
        return self._client.stats.kv_store

    @property
    def max_model_len(self) -> int:
        return self._client.max_model_len

    @property
    def num_waiting(self) -> int:
        """Requests queued in the engine, not yet running, as of its latest step (the stats it
        publishes: good enough for admission control, and what the metrics show)."""
        return self._client.stats.num_waiting

    @cached_property
    def generation_prompt_tokens(self) -> int:
        return self.builder.generation_prompt_tokens()
