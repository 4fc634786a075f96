"""Engine: the synchronous core. Each `step()` reads schedule -> run -> postprocess.

Requests and aborts may come from any thread: they are queued and taken in at the start of
the next step, so an abort takes effect within one step."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from kernels import get_attention_ops
from memory.block_pool import BlockPool
from memory.config import SessionBudget
from memory.kv_cache import KVCache, KVCacheSpec
from memory.kv_cache_manager import KVCacheManager, KVState
from memory.sessions import SessionStore
from memory.stats import CacheStats

from .engine_config import EngineConfig
from .errors import InvalidRequestError, ModelLoadError
from .model import LlamaModel
from .model_config import ModelConfig
from .model_runner import ModelRunner
from .request_output import RequestOutput
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence
from .tokenizer import IncrementalDetokenizer, Tokenizer
from .tokenizer_files import load_tokenizer
from .weights import load_weights

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 512 * 1024**2


@dataclass
class _TextState:
    """Detokenized output of one sequence; text inside a possible stop string is held back."""

    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted: int = 0


@dataclass(frozen=True)
class KVCacheLayout:
    """What start-up measured: how many blocks the pools got."""

    num_blocks: int
    num_host_blocks: int
    bytes_per_block: int


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer: Tokenizer | None = load_tokenizer(config.model)
        mc = self.model_config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        weights = load_weights(config.model, mc, self.dtype, self.device)
        self.model = LlamaModel(mc, weights, self.max_model_len, self.dtype, self.device)
        self.ops = get_attention_ops(config.attention_backend, self.device)

        cache = config.cache
        self.kv_spec = KVCacheSpec(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=cache.block_size,
            model_dtype=self.dtype,
            kv_cache_dtype=cache.kv_cache_dtype,
        )
        self.layout = self._plan_kv_cache()
        self.kv_cache = KVCache(
            self.kv_spec, self.layout.num_blocks, self.device, self.layout.num_host_blocks
        )
        self.block_pool = BlockPool(self.layout.num_blocks)
        self.host_pool = BlockPool(self.layout.num_host_blocks)
        self.kv_manager = KVCacheManager(
            self.block_pool, self.kv_cache, cache.block_size, cache.enable_prefix_caching
        )
        self.stats = CacheStats()
        self.sessions = SessionStore(cache, self.kv_manager, self.host_pool, self.stats)
        self.scheduler = Scheduler(
            config.scheduler, self.kv_manager, self.sessions, self.host_pool, self.stats
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.ops, cache.block_size)
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (
            self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        )
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._seqs: dict[str, Sequence] = {}
        # Ids of requests added and not yet finished; guarded because add_request may be
        # called from other threads than the one stepping.
        self._live_ids: set[str] = set()
        self._ids_lock = threading.Lock()
        self._text: dict[str, _TextState] = {}

    # -- start-up --------------------------------------------------------------------------------

    def _plan_kv_cache(self) -> KVCacheLayout:
        cache = self.config.cache
        per_block = self.kv_spec.bytes_per_block
        if cache.num_blocks_override is not None:
            num_blocks = cache.num_blocks_override
        elif cache.kv_cache_bytes is not None:
            num_blocks = cache.kv_cache_bytes // per_block
        elif self.device.type == "cuda":
            num_blocks = self._profile_cuda_blocks(per_block)
        else:
            num_blocks = CPU_DEFAULT_KV_CACHE_BYTES // per_block
        if num_blocks < 1:
            raise ModelLoadError(
                f"the KV cache budget holds no block of {per_block} bytes; raise kv_cache_bytes"
            )
        return KVCacheLayout(num_blocks, cache.host_cache_bytes // per_block, per_block)

    def _profile_cuda_blocks(self, per_block: int) -> int:
        """As vLLM does: run the largest step once, then give the KV pool what is left of
        `gpu_memory_utilization x total` after the peak."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free_before, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free_before) - torch.cuda.memory_reserved(self.device)
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        scratch_blocks = -(-n // self.config.cache.block_size)
        scratch = KVCache(self.kv_spec, scratch_blocks, self.device)
        runner = ModelRunner(self.model, scratch, self.ops, self.config.cache.block_size)
        seq = Sequence("profile", [0] * n, SamplingParams(max_tokens=1), n + 1)
        seq.kv = KVState(block_ids=list(range(scratch_blocks)))
        runner.execute(ScheduledBatch(seqs=[seq], num_new_tokens=[n], num_decode=0))
        torch.cuda.synchronize(self.device)
        scratch_bytes = scratch.kv.numel() * scratch.kv.element_size()
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_bytes
        del scratch, runner
        torch.cuda.empty_cache()
        budget = self.config.cache.gpu_memory_utilization * total - peak - non_torch
        return int(budget // per_block)

    # -- requests ---------------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt against the model; returns the cap on prompt + generated tokens."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", field="prompt")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
            raise InvalidRequestError(
                f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})",
                field="prompt",
            )
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but the model's context is {self.max_model_len} "
                "tokens, leaving no room to generate",
                field="prompt",
                code="context_length_exceeded",
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens",
                field="max_tokens",
                code="context_length_exceeded",
            )
        capacity = self.layout.num_blocks * self.config.cache.block_size
        if n + 1 > capacity:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but the KV cache holds only {capacity}",
                field="prompt",
                code="context_length_exceeded",
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer; this model directory has none", field="stop"
            )
        for t in params.stop_token_ids:
            if t >= vocab:
                raise InvalidRequestError(
                    f"stop token id {t} is outside the vocabulary", field="stop_token_ids"
                )
        limit = self.max_model_len
        if params.max_tokens is not None:
            limit = min(limit, n + params.max_tokens)
        return limit

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Validate now (errors go to the caller), enqueue for the next step (any thread)."""
        limit = self.validate_prompt(prompt_token_ids, params)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_total_tokens=limit,
            session_id=session_id,
            kv=KVState(salt=cache_salt),
        )
        with self._ids_lock:
            if request_id in self._live_ids:
                raise InvalidRequestError(
                    f"request id {request_id!r} is already in use", field="request_id"
                )
            self._live_ids.add(request_id)
        self._inbox.put(("add", seq))

    def abort_request(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs) or not self._inbox.empty()

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                assert isinstance(item, Sequence)
                self._seqs[item.request_id] = item
                if self.tokenizer is not None:
                    self._text[item.request_id] = _TextState(self.tokenizer.new_detokenizer())
                self.scheduler.add(item)
            elif kind == "abort":
                seq = self._seqs.get(str(item))
                if seq is not None:
                    outputs.append(self._finish(seq, "abort"))
            elif kind == "evict":
                session_id, offload = item  # type: ignore[misc]
                self.sessions.evict(session_id, offload=offload)
            elif kind == "close":
                self.sessions.close(str(item))

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        batch = self.scheduler.schedule()
        for seq in batch.out_of_memory:
            outputs.append(self._finish(seq, "length"))
        if batch.is_empty:
            return outputs
        logits, sampled = self.runner.execute(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            self.kv_manager.commit(seq.kv, seq.token_ids, seq.num_computed_tokens + n)
        if sampled:
            sampling_seqs = [batch.seqs[i] for i in sampled]
            vocab_limit = self.tokenizer.vocab_size if self.tokenizer else None
            if vocab_limit is not None and vocab_limit < logits.shape[1]:
                logits[:, vocab_limit:] = float("-inf")
            result = self.sampler(
                logits, [s.params for s in sampling_seqs], [s.generator for s in sampling_seqs]
            )
            for j, seq in enumerate(sampling_seqs):
                logprob = result.logprobs[j] if result.logprobs is not None else None
                outputs.append(self._append_token(seq, result.token_ids[j], logprob))
        return outputs

    def _append_token(self, seq: Sequence, token_id: int, logprob: float | None) -> RequestOutput:
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_ids.append(token_id)
        if logprob is not None and seq.params.logprobs:
            seq.output_logprobs.append(logprob)
        params = seq.params
        is_stop_token = token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        )
        reason: str | None = None
        new_text = ""
        text = self._text.get(seq.request_id)
        if is_stop_token:
            reason = "stop"
        elif text is not None:
            text.text += text.detokenizer.push(token_id)
            if params.stop:
                cut = _find_stop(text.text, params.stop, text.num_emitted)
                if cut is not None:
                    text.text = text.text[:cut]
                    reason = "stop"
        if reason is None and seq.num_tokens >= seq.max_total_tokens:
            reason = "length"
        if reason is not None:
            return self._finish(seq, reason, new_token_id=token_id, new_logprob=logprob)
        if text is not None:
            hold = max((len(s) - 1 for s in params.stop), default=0)
            upto = max(text.num_emitted, len(text.text) - hold)
            new_text = text.text[text.num_emitted : upto]
            text.num_emitted = upto
        return self._output(seq, token_id, logprob, new_text)

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        new_token_id: int | None = None,
        new_logprob: float | None = None,
    ) -> RequestOutput:
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self.scheduler.remove(seq)
        del self._seqs[seq.request_id]
        with self._ids_lock:
            self._live_ids.discard(seq.request_id)
        text = self._text.pop(seq.request_id, None)
        full_text = None
        new_text = ""
        if text is not None:
            if reason != "stop" or not seq.params.stop:
                text.text += text.detokenizer.flush()
            full_text = text.text
            new_text = text.text[text.num_emitted :]
        return self._output(seq, new_token_id, new_logprob, new_text, reason, full_text)

    @staticmethod
    def _output(
        seq: Sequence,
        token_id: int | None,
        logprob: float | None,
        new_text: str,
        finish_reason: str | None = None,
        full_text: str | None = None,
    ) -> RequestOutput:
        finished = finish_reason is not None
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[] if token_id is None else [token_id],
            new_text=new_text,
            finished=finished,
            finish_reason=finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.accounting.cached,
            new_logprobs=[logprob] if logprob is not None and seq.params.logprobs else None,
            output_token_ids=list(seq.output_token_ids) if finished else None,
            text=full_text,
            time_to_first_token=ttft,
        )

    # -- sessions and memory (operator API) ------------------------------------------------------

    def set_session_budget(self, session_id: str, budget: SessionBudget) -> None:
        """Change a session's budget; it takes effect at the session's next turn."""
        self.sessions.set_budget(session_id, budget)

    def evict_session(self, session_id: str, *, offload: bool = True) -> None:
        """Move an idle session's KV out of the pool (to host, or dropped), at the next step."""
        self._inbox.put(("evict", (session_id, offload)))

    def close_session(self, session_id: str) -> None:
        """Forget a session and free its KV, at the next step."""
        self._inbox.put(("close", session_id))

    def session_info(self, session_id: str) -> dict[str, object] | None:
        session = self.sessions.get(session_id)
        if session is None:
            return None
        budget = self.sessions.budget(session_id)
        return {
            "session_id": session_id,
            "state": session.state.value,
            "tokens": session.num_tokens,
            "device_blocks": len(session.kv.block_ids),
            "host_blocks": len(session.host_block_ids),
            "turns": session.num_turns,
            "max_kv_tokens": budget.max_kv_tokens,
            "max_context_tokens": budget.max_context_tokens,
        }

    def kv_slot_usage(self) -> tuple[int, int]:
        """(allocated, filled) KV slots: allocated = slots of every block in use; filled = slots
        holding a token's KV for some holder (running or waiting sequence, pinned session),
        each physical block counted once. allocated - filled is the waste of paging."""
        bs = self.config.cache.block_size
        holders = [(s.kv.block_ids, s.num_computed_tokens) for s in list(self.scheduler.running)]
        holders += [(s.kv.block_ids, s.num_computed_tokens) for s in list(self.scheduler.waiting)]
        holders += [
            (s.kv.block_ids, s.kv.num_computed_tokens)
            for s in list(self.sessions.sessions.values())
        ]
        filled: dict[int, int] = {}
        for blocks, num_tokens in holders:
            for i, block_id in enumerate(blocks):
                n = min(bs, max(0, num_tokens - i * bs))
                filled[block_id] = max(filled.get(block_id, 0), n)
        return self.block_pool.num_used_blocks * bs, sum(filled.values())

    def memory_report(self) -> dict[str, object]:
        pool = self.block_pool
        return {
            "block_size": self.config.cache.block_size,
            "kv_cache_dtype": self.config.cache.kv_cache_dtype,
            "bytes_per_token": self.kv_spec.bytes_per_token,
            "num_blocks": pool.num_blocks,
            "used_blocks": pool.num_used_blocks,
            "free_blocks": pool.num_free_blocks,
            "cached_blocks": pool.num_cached_blocks,
            "kv_cache_usage": pool.num_used_blocks / pool.num_blocks,
            "num_host_blocks": self.host_pool.num_blocks,
            "used_host_blocks": self.host_pool.num_used_blocks,
            "pinned_sessions": self.sessions.num_resident,
            "pinned_blocks": self.sessions.num_pinned_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "stats": self.stats.snapshot(),
        }

    # -- convenience ------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion together; final outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        finals: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[rid] for rid in ids]


def _find_stop(text: str, stops: tuple[str, ...], emitted: int) -> int | None:
    """Index where the earliest stop string starts in text (searching from what may still be
    withheld), or None."""
    start = max(0, emitted - max(len(s) for s in stops))
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
