"""Faults injected into a real engine."""

from __future__ import annotations

from typing import Any


class StepFault:
    """An injected engine bug: the model runner raises from the n-th step on."""

    def __init__(self, engine: Any, after: int) -> None:
        self.execute = engine.runner.execute
        engine.runner.execute = self
        self.calls = 0
        self.after = after

    def __call__(self, batch: Any) -> Any:
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("injected fault")
        return self.execute(batch)
