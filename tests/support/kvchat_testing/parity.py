"""Logits tolerances and a recorder of the logits the real sampler sees."""

from __future__ import annotations

from typing import Any

import torch

LOGITS_ATOL = 1e-4


class LogitsRecorder:
    """Wraps the engine's real sampler and keeps a copy of every logits batch it sees; with
    `forced`, its one sequence takes those tokens instead of the sampled ones."""

    def __init__(self, sampler: Any, forced: list[int] | None = None) -> None:
        self.sampler = sampler
        self.forced = forced  # teacher forcing: answer with these tokens (one sequence)
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, params: Any, generators: Any, **kwargs: Any) -> Any:
        self.logits.append(logits.detach().clone())
        out = self.sampler(logits, params, generators, **kwargs)
        if self.forced is not None:
            out.token_ids[0] = self.forced[len(self.logits) - 1]
        return out
