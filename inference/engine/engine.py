"""Engine: the synchronous core, one step at a time. Each `step()` reads schedule -> run ->
postprocess (as nano-vllm's): the scheduler decides what runs and where its KV lives, the model
runner computes logits, the sampler picks tokens (the structured-output manager masks or
checks constrained rows), and the output processor turns them into text and stop decisions.

Other modules hold the other jobs: start-up and KV sizing (engine.setup, memory.kv_layout),
request checks (engine.checks), grammar masks (structured.output), reports
(engine.reports), the inbox other threads write to (engine.inbox).

Threads: requests, aborts and operator commands may come from any thread; they are queued and
taken in at the start of the next step, so an abort takes effect within one step; commands
run at the end of that step (after its outputs are made) and their futures resolve there.
Everything else (the sequences, the scheduler's queues, the pools, the sessions) is touched
by the stepping thread only; other threads read `published_stats`, which each step replaces
whole.

Kept from before the split, on purpose: the measured pool sizes are a frozen KVCacheLayout,
never written back into the config; prefix-cache hits are salted per tenant and confirmed by
token ids (memory.prefix_cache); prompts arrive as ids the service spliced token-exact from
stored replies (inference.text.context_builder), so a session's pinned KV is a prefix of its next
turn; asserts state invariants and carry no behaviour (the suite also runs under python -O)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvchat.kernels import get_attention_ops
from kvchat.memory.block_pool import BlockPool
from kvchat.memory.config import SessionBudget
from kvchat.memory.kv_cache import KVCache
from kvchat.memory.kv_cache_manager import KVCacheManager, KVState, KVWindow
from kvchat.memory.sessions import SessionStore
from kvchat.memory.stats import CacheStats

from ..errors import EngineDeadError, InvalidRequestError
from ..model.config import ModelConfig
from ..model.linear_plan_cache import LinearPlanCache
from ..model.model import LlamaModel
from ..model.runner import ModelRunner
from ..model.sampler import Sampler
from ..model.sampling_params import SamplingParams
from ..model.weights import load_weights
from ..structured.compiler import GrammarCompiler
from ..structured.output import StructuredOutputManager
from ..text.tokenizer import Tokenizer
from ..text.tokenizer_files import load_tokenizer
from . import reports
from .checks import CheckedRequest, RequestChecker
from .config import EngineConfig
from .cpu_threads import CpuThreads, step_shape
from .host_memory import keep_freed_memory, release_freed_memory
from .inbox import AbortRequest, AddRequest, Call, EngineInbox
from .output_processor import OutputProcessor
from .priority import PRIORITY_NORMAL
from .reports import (
    EngineStats,
    KVSlotUsage,
    MemoryReport,
    SessionEviction,
    SessionInfo,
)
from .request_output import RequestOutput
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus
from .setup import invalid_token_mask, kv_spec_for, open_kv_store, size_kv_pools

log = logging.getLogger(__name__)

# Steps in a row that may raise before the engine counts itself broken and stops (its loop
# then dies, /healthz fails, a supervisor restarts the process).
MAX_FAILED_STEPS = 3
# A step with at least this many prompt tokens times the per-token prefill (retention).
MEASURED_PREFILL_TOKENS = 64

T = TypeVar("T")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        if self.device.type == "cpu":
            keep_freed_memory()  # each step's large tensors reuse freed heap, not fresh pages
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer: Tokenizer | None = load_tokenizer(config.model)
        mc = self.model_config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        weights = load_weights(config.model, mc, self.dtype, self.device)
        plan_cache = (
            LinearPlanCache(
                Path(config.linear_plan_dir),
                refresh=config.linear_plan_refresh,
                busy_cpus=config.linear_plan_busy_cpus,
            )
            if config.linear_plan_dir is not None
            else None
        )
        self.model = LlamaModel(
            mc,
            weights,
            self.max_model_len,
            self.dtype,
            self.device,
            config.linear_path,
            plan_cache,
        )
        del weights  # what the model did not keep (q, k, v, gate, up before fusing) is freed
        self.ops = get_attention_ops(config.attention_backend, self.device)

        cache = config.cache
        self.kv_spec = kv_spec_for(mc, cache, self.dtype)
        self.layout = size_kv_pools(
            cache,
            self.kv_spec,
            self.model,
            self.ops,
            min(config.scheduler.max_step_tokens, self.max_model_len),
            self.device,
        )
        self.kv_cache = KVCache(
            self.kv_spec, self.layout.num_blocks, self.device, self.layout.num_host_blocks
        )
        self.block_pool = BlockPool(self.layout.num_blocks)
        self.host_pool = BlockPool(self.layout.num_host_blocks)
        self.stats = CacheStats()
        self.kv_store = open_kv_store(cache, config.model, self.kv_spec, self.kv_cache)
        self.kv_manager = KVCacheManager(
            self.block_pool,
            self.kv_cache,
            cache.block_size,
            cache.enable_prefix_caching,
            host_pool=self.host_pool,
            stats=self.stats,
            store=self.kv_store,
        )
        self.sessions = SessionStore(
            cache, self.kv_manager, self.stats, bytes_per_block=self.layout.bytes_per_block
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.sessions, self.stats)
        self.runner = ModelRunner(self.model, self.kv_cache, self.ops, cache.block_size)
        self.cpu_threads = CpuThreads.for_device(self.device, config.adaptive_cpu_threads)
        self.sampler = Sampler(
            config.seed, invalid_token_mask(self.tokenizer, mc.vocab_size, self.device)
        )
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (
            self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.structured_output = StructuredOutputManager(
            self.tokenizer,
            mc.vocab_size,
            self.eos_token_ids,
            self.device,
            checks_first=config.grammar_checks_first,
        )
        self.checker = RequestChecker(
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            kv_capacity_tokens=self.layout.num_blocks * cache.block_size,
            has_tokenizer=self.tokenizer is not None,
            structured=self.structured_output,
            budget_of=self.sessions.budget,
        )
        self.inbox = EngineInbox()
        self._seqs: dict[str, Sequence] = {}
        # Ids of requests added and not yet finished; guarded because add_request may be
        # called from other threads than the one stepping.
        self._live_ids: set[str] = set()
        self._ids_lock = threading.Lock()
        self._consecutive_failed_steps = 0
        self.num_failed_steps = 0  # steps that raised (their requests failed, the engine went on)
        self.num_failed_requests = 0
        self.published_stats: EngineStats = self._stats()
        self.stepped_nothing = False  # the last step ran nothing (see step)
        if self.device.type == "cpu":
            release_freed_memory()  # what loading and the linear probe left behind

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (built on first use, any thread)."""
        return self.structured_output.grammars

    # -- requests ---------------------------------------------------------------------------------

    def check_request(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        session_id: str | None = None,
        budget: SessionBudget | None = None,
    ) -> CheckedRequest:
        """The one check of a request (any thread; see inference.engine.checks): errors go to
        the caller as InvalidRequestError. A request in a session is held to the session's
        `max_context_tokens` (`budget` when the caller owns it, else the engine's): prompt
        plus `max_tokens` must fit (an over-budget prompt is a `context_length_exceeded`
        error; the history planner trims to the budget before it gets here), and without
        `max_tokens` generation stops at the budget."""
        return self.checker.check(prompt_token_ids, params, session_id, budget)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        session_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = PRIORITY_NORMAL,
    ) -> None:
        """Check now (errors go to the caller) and enqueue for the next step (any thread)."""
        request = self.check_request(prompt_token_ids, params, session_id=session_id)
        self.add_checked_request(request_id, request, cache_salt=cache_salt, priority=priority)

    def add_checked_request(
        self,
        request_id: str,
        request: CheckedRequest,
        *,
        cache_salt: str | None = None,
        priority: int = PRIORITY_NORMAL,
    ) -> None:
        """Enqueue a request checked before (by check_request) for the next step (any thread);
        only its id can still be refused (in use). `priority` above PRIORITY_NORMAL makes it
        background work (see the scheduler)."""
        seq = self._make_sequence(request_id, request, cache_salt)
        seq.priority = priority
        if request.session_id is not None and request.session_budget is not None:
            self.sessions.set_budget(request.session_id, request.session_budget)
        self._enqueue([seq])

    def _make_sequence(
        self, request_id: str, request: CheckedRequest, cache_salt: str | None
    ) -> Sequence:
        params = request.params
        window = self._window_for(request)
        if window is not None and request.num_prompt_tokens >= window.start:
            window = None  # the prompt alone is over the budget: computed whole, pinned in part
        return Sequence(
            request_id=request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            params=params,
            max_total_tokens=request.max_total_tokens,
            session_id=request.session_id,
            kv=KVState(salt=cache_salt),
            window=window,
            matcher=(
                None
                if params.grammar is None
                else self.structured_output.new_matcher(params.grammar)
            ),
        )

    def _window_for(self, request: CheckedRequest) -> KVWindow | None:
        """Sink + window attention for a turn whose own generation could take it past its
        session's max_kv_tokens (the prompt fits), so its KV stays within that budget; models
        with their own sliding window keep it."""
        if request.session_id is None or any(
            w is not None for w in self.model_config.sliding_windows
        ):
            return None
        budget = request.max_kv_tokens
        if budget is None or request.max_total_tokens <= budget:
            return None
        return KVWindow.for_budget(
            budget, self.config.cache.block_size, self.config.cache.window_sink_tokens
        )

    def _enqueue(self, seqs: list[Sequence]) -> None:
        """Take the ids (all or none) and queue the sequences for the next step."""
        ids = [seq.request_id for seq in seqs]
        with self._ids_lock:
            taken = [rid for rid in ids if rid in self._live_ids]
            if taken or len(set(ids)) != len(ids):
                raise InvalidRequestError(
                    f"request id {(taken or ids)[0]!r} is already in use", field="request_id"
                )
            self._live_ids.update(ids)
        for seq in seqs:
            self.inbox.add(seq)

    def abort_request(self, request_id: str, reason: str = "cancelled") -> None:
        """End a request at the next step; its final output has finish_reason "abort" and
        `abort_reason` = reason."""
        self.inbox.abort(request_id, reason)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, finished ones whose last step is still to run, or queued
        work (stepping thread only)."""
        return bool(self._seqs) or not self.inbox.empty() or bool(self.scheduler.finishing)

    @property
    def unfinished_request_ids(self) -> list[str]:
        """Requests added and not finished (any thread)."""
        with self._ids_lock:
            return list(self._live_ids)

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Take in what was queued; schedule -> run -> postprocess; run the queued calls, which
        so see what the step left (a finished turn's last token pinned); publish the stats."""
        outputs, calls = self._take_inbox()
        batch = self.scheduler.schedule()
        if self.kv_store is not None:  # the write-behind waits out prefills (memory/kv_store.py)
            self.kv_store.set_prefilling(batch.num_decode < len(batch.seqs))
        for seq in batch.out_of_memory:
            self._release(seq)
            outputs.append(self.output_processor.finish(seq, "length"))
        if not batch.is_empty:
            try:
                logits, sampled, ready = self._run(batch)
                outputs += self._postprocess(batch, logits, sampled, ready)
                self._consecutive_failed_steps = 0
            except Exception as e:
                outputs += self._fail_batch(batch, e)
        for call in calls:
            call.run()
        self.published_stats = self._stats()
        # Nothing ran and nothing came out: the waiting requests wait (on a held session, or
        # for blocks), and the next step would do the same unless something arrives.
        self.stepped_nothing = batch.is_empty and not outputs and not calls
        return outputs

    def _take_inbox(self) -> tuple[list[RequestOutput], list[Call[Any]]]:
        """New requests and aborts, applied in the order they were queued; the calls queued
        with them, to run at the end of the step."""
        outputs: list[RequestOutput] = []
        calls: list[Call[Any]] = []
        for item in self.inbox.take():
            if isinstance(item, AddRequest):
                seq = item.seq
                self._seqs[seq.request_id] = seq
                self.output_processor.add(seq)
                self.scheduler.add(seq)
            elif isinstance(item, AbortRequest):
                aborted = self._seqs.get(item.request_id)
                if aborted is not None:
                    self._release(aborted)
                    outputs.append(
                        self.output_processor.finish(aborted, "abort", abort_reason=item.reason)
                    )
            else:
                calls.append(item)
        return outputs, calls

    def _run(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, list[int], dict[int, torch.Tensor]]:
        """The forward, with the masks taken first computed beside it. Returns the logits
        [num_sampled, vocab], the batch rows they belong to, and the ready masks by batch
        row."""
        masks = self.structured_output.start_masks(batch)
        try:
            logits, sampled = self._forward(batch)
        finally:
            # Waited for even when the forward fails: a worker may be using the matchers.
            ready = masks() if masks is not None else {}
        return logits, sampled, ready

    def _forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """The model's forward over the batch, on the thread count CpuThreads picks for its
        shape (on the CPU), timed for the next pick."""
        if self.cpu_threads is None:
            return self.runner.execute(batch)
        shape = step_shape(batch.num_tokens, batch.num_decode, len(batch.seqs))
        threads = self.cpu_threads.choose(shape)
        start = time.perf_counter()
        result = self.runner.execute(batch)
        seconds = time.perf_counter() - start
        self.cpu_threads.record(shape, threads, seconds)
        if batch.num_tokens - batch.num_decode >= MEASURED_PREFILL_TOKENS:
            # what recomputing a session's KV costs, for the retention policy
            self.sessions.retention.observe_prefill(seconds, batch.num_tokens)
        return result

    def _postprocess(
        self,
        batch: ScheduledBatch,
        logits: torch.Tensor,
        sampled: list[int],
        ready: dict[int, torch.Tensor],
    ) -> list[RequestOutput]:
        """Commit the step's KV, pin finished session turns, sample and append the tokens."""
        finishing = [s.status is SequenceStatus.FINISHING for s in batch.seqs]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            self.kv_manager.commit(
                seq.kv,
                seq.token_ids,
                seq.num_computed_tokens + n,
                shareable_tokens=None if seq.window is None else seq.window.exact_tokens,
            )
            if seq.status is SequenceStatus.FINISHING:  # its last token's KV is in: pin it
                self.scheduler.remove(seq)
        if any(finishing[i] for i in sampled):  # they sample nothing
            rows = [j for j, i in enumerate(sampled) if not finishing[i]]
            logits, sampled = logits[rows], [sampled[j] for j in rows]
        if not sampled:
            return []
        outputs = []
        sampling_seqs = [batch.seqs[i] for i in sampled]
        grammar = self.structured_output.step_grammars(sampling_seqs, sampled, ready)
        result = self.sampler(
            logits,
            [s.params for s in sampling_seqs],
            [s.generator for s in sampling_seqs],
            grammar=grammar,
            penalties=[s.current_penalties(logits.shape[1], logits.device) for s in sampling_seqs],
        )
        if grammar is not None:
            self.structured_output.note_checks(sampling_seqs, grammar, result.fell_back)
        for j, seq in enumerate(sampling_seqs):
            token_id = result.token_ids[j]
            logprob = result.logprobs[j] if result.logprobs is not None else None
            top = result.top_logprobs[j] if result.top_logprobs is not None else None
            grammar_done = seq.matcher is not None and self.structured_output.advance(seq, token_id)
            out = self.output_processor.append_token(
                seq, token_id, logprob, top, grammar_done=grammar_done
            )
            if out.finished:
                self._release(seq)
            outputs.append(out)
        return outputs

    def _fail_batch(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        """A step raised: what one request (or one bad block) can do must not stop the engine.
        The batch's requests end with an error and their KV is dropped (a half-written step
        must never be pinned or stored for reuse); the others go on. A step that fails
        MAX_FAILED_STEPS times in a row is the engine broken, not a request: it raises."""
        self._consecutive_failed_steps += 1
        self.num_failed_steps += 1
        if self._consecutive_failed_steps >= MAX_FAILED_STEPS:
            raise EngineDeadError(
                f"{self._consecutive_failed_steps} steps in a row failed; the last: {error!r}"
            ) from error
        log.exception("a step failed; its %d requests end with an error", len(batch.seqs))
        outputs = []
        for seq in batch.seqs:
            if seq.status is SequenceStatus.FINISHING:  # its reply is out; its KV is not kept
                self.scheduler.discard(seq)
                continue
            if self._seqs.get(seq.request_id) is not seq:
                continue  # already finished in this step, before the failure
            self.scheduler.discard(seq)
            del self._seqs[seq.request_id]
            with self._ids_lock:
                self._live_ids.discard(seq.request_id)
            self.num_failed_requests += 1
            outputs.append(
                self.output_processor.finish(
                    seq, "abort", abort_reason="error", error=f"{type(error).__name__}: {error}"
                )
            )
        return outputs

    def _release(self, seq: Sequence) -> None:
        """A request ends: its KV goes to its session (or is freed), its id is free again."""
        self.scheduler.finish(seq)
        del self._seqs[seq.request_id]
        with self._ids_lock:
            self._live_ids.discard(seq.request_id)

    # -- commands (any thread): applied by the next step, answered by a future ------------------

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the stepping thread at the end of the next step; the future gives its
        result (or its exception) once it has run."""
        return self.inbox.call(fn)

    def evict_session(self, session_id: str, *, offload: bool = True) -> Future[SessionEviction]:
        """Move an idle session's KV out of the device pool: to the host pool when `offload`
        and there is room, else drop it (its next turn restores or recomputes it; a running
        turn's session is left alone). The future gives the session just before and just
        after."""

        def evict() -> SessionEviction:
            before = self.session_info(session_id)
            self.sessions.evict(session_id, offload=offload, operator=True)
            return SessionEviction(before, self.session_info(session_id))

        return self.submit(evict)

    def set_session_budget(
        self, session_id: str, budget: SessionBudget
    ) -> Future[SessionInfo | None]:
        """Change a session's budget. It is recorded at once (the session store's budgets are
        thread-safe), so a request checked from now on is held to it; the session's KV is
        held to it from its next turn on. A caller that queues a turn of the session next
        need not wait. The future gives the session as the next step finds it."""
        self.sessions.set_budget(session_id, budget)
        return self.submit(lambda: self.session_info(session_id))

    @property
    def idle_wait_s(self) -> float:
        """How long an idle stepping thread may sleep: the retention policy's prefetch
        interval when it prefetches."""
        retention = self.config.cache.retention
        return retention.prefetch_interval_s if retention.mode == "predictive" else 0.5

    def maintain_sessions(self) -> None:
        """Between steps while idle (stepping thread only): the session store's upkeep."""
        self.sessions.maintain()

    def note_session(
        self,
        session_id: str,
        *,
        end: str | None = None,
        typing: bool = False,
        present: bool | None = None,
    ) -> Future[None]:
        """What the service knows of a session's next turn (SessionStore.note): how its last
        turn ended, its user typing, its WebSocket open or closed."""
        return self.submit(
            lambda: self.sessions.note(session_id, end=end, typing=typing, present=present)
        )

    def close_session(self, session_id: str) -> Future[None]:
        """Forget a session and free its KV (a running turn of it keeps running; its KV is
        freed when it ends)."""
        return self.submit(lambda: self.sessions.close(session_id))

    def persist_sessions(self, timeout: float | None = 30.0) -> int:
        """Queue every pinned session's blocks the KV store lacks and wait (up to `timeout`)
        until they are written. Called with the stepping thread stopped (a drain's exit hook):
        every finished turn already queued its blocks, so this is mostly the wait. Returns the
        blocks queued here."""
        if self.kv_store is None:
            return 0
        queued = 0
        for session in list(self.sessions.sessions.values()):
            if session.kv.block_hashes:
                queued += self.kv_manager.persist(session.kv, session.token_ids)
        self.kv_store.flush(timeout)
        return queued

    def close_kv_store(self) -> None:
        """Write what is queued, then stop the store's writer (the process is exiting)."""
        if self.kv_store is not None:
            self.kv_store.close()

    # -- reports (stepping thread; other threads submit them, or read published_stats) --------

    def session_info(self, session_id: str) -> SessionInfo | None:
        return reports.session_info(self.sessions, session_id)

    def kv_slot_usage(self) -> KVSlotUsage:
        return reports.kv_slot_usage(
            self.scheduler, self.sessions, self.block_pool, self.config.cache.block_size
        )

    def memory_report(self) -> MemoryReport:
        return MemoryReport(
            block_size=self.config.cache.block_size,
            kv_cache_dtype=self.config.cache.kv_cache_dtype,
            bytes_per_token=self.kv_spec.bytes_per_token,
            bytes_per_block=self.layout.bytes_per_block,
            stats=self._stats(),
            slots=self.kv_slot_usage(),
            sessions=reports.session_infos(self.sessions),
        )

    def _stats(self) -> EngineStats:
        return reports.engine_stats(
            self.scheduler,
            self.sessions,
            self.block_pool,
            self.host_pool,
            self.stats,
            self.kv_store.snapshot() if self.kv_store is not None else None,
            num_failed_steps=self.num_failed_steps,
            num_failed_requests=self.num_failed_requests,
            cpu_threads=self.cpu_threads.current if self.cpu_threads is not None else None,
            num_cpu_thread_switches=(
                self.cpu_threads.num_switches if self.cpu_threads is not None else 0
            ),
            bytes_per_block=self.layout.bytes_per_block,
        )

    # -- convenience ------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion together; final outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        # Check every prompt before queueing any: a bad one leaves nothing behind.
        seqs = [
            self._make_sequence(rid, self.check_request(p, sp), None)
            for rid, p, sp in zip(ids, prompts, plist)
        ]
        self._enqueue(seqs)
        finals: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[rid] for rid in ids]
