"""Logits tolerances and a recorder of the logits the real sampler sees."""

from __future__ import annotations

from typing import Any

import torch

LOGITS_ATOL = 1e-4


class LogitsRecorder:
    """Wraps the engine's real sampler and keeps a copy of every logits batch it sees."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, params: Any, generators: Any, **kwargs: Any) -> Any:
        self.logits.append(logits.detach().clone())
        return self.sampler(logits, params, generators, **kwargs)
