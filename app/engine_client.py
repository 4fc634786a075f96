"""EngineClient: the engine as the service sees it, and the one name for it in app/ (vLLM v1
puts one `EngineClient` in front of every entrypoint, likewise).

The engine runs on a thread of its own (inference/engine/thread.py); everything here is safe
from the event loop. What changes or reads the engine's state is async and answered by the
engine thread. Four calls return at once, on any thread, and are not awaited:
- `check` is a pure check of a request against the model and the session's budget (it runs
  inside a turn's planning, on a worker thread);
- `session_budget` reads the budget a session is held to (likewise);
- `abort` sets a flag the engine reads at its next step (a stop can come from a callback);
- `stats` reads what the engine thread published after its latest step.

`ThreadEngineClient` below is the implementation and the only code in app/ that holds the
synchronous `Engine`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from kvchat.inference import (
    PRIORITY_NORMAL,
    AsyncEngine,
    CheckedRequest,
    Engine,
    EngineStats,
    GrammarCompiler,
    MemoryReport,
    RequestOutput,
    SamplingParams,
    SessionEviction,
    SessionInfo,
    Tokenizer,
    cpu_description,
)
from kvchat.memory import SessionBudget


class EngineClient(Protocol):
    """What the service may ask of the engine."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def grammars(self) -> GrammarCompiler: ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a generation (the model's and the tokenizer's); its text is
        never part of a reply."""

    @property
    def stats(self) -> EngineStats: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def has_kv_store(self) -> bool: ...

    def describe(self) -> dict[str, Any]:
        """What was fixed at start-up: the model, its size, dtype, device, kernels, CPU and
        linear-layer plan (read here, without a trip to the engine thread)."""

    def check(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        session_id: str | None = None,
        budget: SessionBudget | None = None,
    ) -> CheckedRequest:
        """Check a request (errors: InvalidRequestError naming the field). A `budget` given
        here is the session's: the engine records it when the request is added."""

    def session_budget(self, session_id: str) -> SessionBudget:
        """The budget the engine holds the session to (its own, else the default), read on
        any thread: a request that changes part of it (a client's retention hint) sends the
        rest back as it is."""

    def generate(
        self,
        request_id: str,
        request: CheckedRequest,
        *,
        cache_salt: str | None = None,
        priority: int = PRIORITY_NORMAL,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them; the last one is finished."""

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        """End a request at the engine's next step (idempotent; unknown ids are ignored); its
        last output says `reason` (its abort_reason)."""

    async def set_session_budget(
        self, session_id: str, budget: SessionBudget
    ) -> SessionInfo | None: ...

    async def evict_session(self, session_id: str, *, offload: bool) -> SessionEviction: ...

    async def note_session(
        self,
        session_id: str,
        *,
        end: str | None = None,
        typing: bool = False,
        present: bool | None = None,
    ) -> None:
        """What the service knows of a session's next turn: how its last turn ended (the
        engine cannot tell tool calls), its user typing, its WebSocket open or closed."""

    async def close_session(self, session_id: str) -> None: ...

    async def session_info(self, session_id: str) -> SessionInfo | None: ...

    async def memory_report(self) -> MemoryReport:
        """The pool, its slots and every session (read directly once the engine stopped)."""

    async def persist_sessions(self, timeout: float) -> int:
        """With the engine stopped: write every pinned session's blocks the KV store lacks,
        wait up to `timeout` s for the writer; the blocks queued here."""


class ThreadEngineClient:
    """The EngineClient of an engine stepping on its own thread (an AsyncEngine)."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self._async = async_engine
        self._engine = async_engine.engine

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._engine.tokenizer

    @property
    def grammars(self) -> GrammarCompiler:
        return self._engine.grammars

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._engine.eos_token_ids

    @property
    def stats(self) -> EngineStats:
        return self._async.stats

    @property
    def is_running(self) -> bool:
        return self._async.is_running

    @property
    def has_kv_store(self) -> bool:
        return self._engine.kv_store is not None

    def describe(self) -> dict[str, Any]:
        engine = self._engine
        return {
            "model": engine.config.model,
            "num_parameters": engine.model_config.num_parameters,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device),
            "attention_backend": engine.ops.name,
            "cpu": cpu_description(),
            "linear": engine.model.linear_plan.as_dict(),
        }

    def check(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        session_id: str | None = None,
        budget: SessionBudget | None = None,
    ) -> CheckedRequest:
        return self._engine.check_request(
            prompt_token_ids, params, session_id=session_id, budget=budget
        )

    def session_budget(self, session_id: str) -> SessionBudget:
        return self._engine.sessions.budget(session_id)

    def generate(
        self,
        request_id: str,
        request: CheckedRequest,
        *,
        cache_salt: str | None = None,
        priority: int = PRIORITY_NORMAL,
    ) -> AsyncIterator[RequestOutput]:
        return self._async.generate(request_id, request, cache_salt=cache_salt, priority=priority)

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        self._async.abort(request_id, reason)

    async def set_session_budget(
        self, session_id: str, budget: SessionBudget
    ) -> SessionInfo | None:
        return await self._async.set_session_budget(session_id, budget)

    async def evict_session(self, session_id: str, *, offload: bool) -> SessionEviction:
        return await self._async.evict_session(session_id, offload=offload)

    async def note_session(
        self,
        session_id: str,
        *,
        end: str | None = None,
        typing: bool = False,
        present: bool | None = None,
    ) -> None:
        await self._async.note_session(session_id, end=end, typing=typing, present=present)

    async def close_session(self, session_id: str) -> None:
        await self._async.close_session(session_id)

    async def session_info(self, session_id: str) -> SessionInfo | None:
        return await self._async.session_info(session_id)

    async def memory_report(self) -> MemoryReport:
        if self._async.is_running:
            return await self._async.memory_report()
        # Stopped (a drain's exit hook): nothing steps, the engine is read from here.
        return await asyncio.to_thread(self._engine.memory_report)

    async def persist_sessions(self, timeout: float) -> int:
        return await asyncio.to_thread(self._engine.persist_sessions, timeout)

    # -- not on the protocol: the lifespan's start and stop, and the engine itself for tests
    # that inject faults or read its internals ---------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def async_engine(self) -> AsyncEngine:
        return self._async

    def start(self) -> None:
        self._async.start()

    async def shutdown(self, drain_timeout: float) -> None:
        await asyncio.to_thread(self._async.shutdown, drain_timeout)

    def close_kv_store(self) -> None:
        self._engine.close_kv_store()
