"""Faults injected into a real engine."""

from __future__ import annotations

from typing import Any


class StepFault:
    """An injected engine bug: the model runner raises from the n-th step on (`times` steps,
    default every step from then on)."""

    def __init__(self, engine: Any, after: int, times: int | None = None) -> None:
        self.execute = engine.runner.execute
        engine.runner.execute = self
        self.calls = 0
        self.after = after
        self.times = times
        self.raised = 0

    def __call__(self, batch: Any) -> Any:
        self.calls += 1
        if self.calls > self.after and (self.times is None or self.raised < self.times):
            self.raised += 1
            raise RuntimeError("injected fault")
        return self.execute(batch)
