"""A float32 CPU engine with a small pool, and random prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.scheduler import SchedulerConfig
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.memory.config import CacheConfig

BLOCK = 16


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_engine(path: Path, **scheduler: Any) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(block_size=BLOCK, num_blocks_override=128),
            scheduler=SchedulerConfig(**scheduler),
        )
    )


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
