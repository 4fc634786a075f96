"""Engines with exact device and host pools, a counter of the tokens the model runs, one
turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.request_output import RequestOutput
from kvchat.inference.engine.scheduler import ScheduledBatch, SchedulerConfig
from kvchat.inference.model.config import ModelConfig
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.memory.config import CacheConfig
from kvchat.memory.kv_spec import KVCacheSpec

BLOCK = 16


NEW = 12


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def make_engine(path: Path, num_blocks: int = 256, host_blocks: int = 0, **cache: Any) -> Engine:
    """An engine with exactly `num_blocks` device blocks and `host_blocks` host blocks."""
    config = ModelConfig.from_dir(path)
    spec = KVCacheSpec(
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        BLOCK,
        torch.float32,
        cache.get("kv_cache_dtype", "auto"),
    )  # type: ignore[arg-type]
    engine = Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(
                block_size=BLOCK,
                num_blocks_override=num_blocks,
                host_cache_bytes=host_blocks * spec.bytes_per_block,
                **cache,
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=256),
        )
    )
    assert engine.host_pool.num_blocks == host_blocks
    return engine


class ForwardCounter:
    """Counts the tokens the model really runs (wraps the real runner)."""

    def __init__(self, engine: Engine) -> None:
        self.execute = engine.runner.execute
        engine.runner.execute = self  # type: ignore[method-assign]
        self.tokens = 0

    def __call__(self, batch: ScheduledBatch) -> Any:
        self.tokens += batch.num_tokens
        return self.execute(batch)


def turn(
    engine: Engine,
    rid: str,
    prompt: list[int],
    session: str | None = None,
    params: SamplingParams = GREEDY,
    salt: str | None = None,
) -> RequestOutput:
    engine.add_request(rid, prompt, params, session_id=session, cache_salt=salt)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                final = out
    assert final is not None and final.output_token_ids is not None
    return final


def cold(path: Path, prompt: list[int], kv_cache_dtype: str = "auto") -> list[int]:
    engine = make_engine(path, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    out = turn(engine, "cold", prompt)
    assert out.num_cached_tokens == 0
    return out.output_token_ids or []
