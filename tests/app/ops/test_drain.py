"""The drain's state, on an injected clock: when the grace ends (the balancer has seen the
replica draining, or time is up) and how exit hooks run."""

from __future__ import annotations

from typing import Any

import pytest

from app.ops.drain import Drain


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_grace_ends_after_its_seconds() -> None:
    clock = Clock()
    drain = Drain(grace=5.0, clock=clock)
    assert drain.is_graceful and not drain.is_draining and not drain.is_grace_over()
    drain.begin()
    assert drain.is_draining and not drain.is_grace_over()
    clock.now += 4.999
    drain.begin()  # a second signal keeps the first start
    assert not drain.is_grace_over()
    clock.now += 0.001
    assert drain.is_grace_over()


def test_the_grace_ends_early_once_the_balancer_saw_the_replica_draining() -> None:
    clock = Clock()
    drain = Drain(grace=60.0, probes=3, clock=clock)
    drain.probed()  # before the drain: not counted
    drain.begin()
    for _ in range(2):
        drain.probed()
        assert not drain.is_grace_over()
    drain.probed()
    assert drain.is_grace_over() and drain.probes_answered == 3
    assert clock.now == 100.0  # no time passed: the probes decided


def test_without_a_grace_a_signal_stops_at_once() -> None:
    drain = Drain()
    assert not drain.is_graceful


@pytest.mark.parametrize("fields", [{"grace": -1.0}, {"probes": -1}])
def test_negative_settings_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        Drain(**fields)


@pytest.mark.anyio
async def test_exit_hooks_run_in_order_and_a_failing_one_does_not_stop_the_next() -> None:
    ran: list[str] = []

    async def first(state: Any) -> None:
        ran.append("first")
        raise RuntimeError("the store is gone")

    async def second(state: Any) -> None:
        ran.append(f"second:{state}")

    drain = Drain(exit_hooks=[first, second])
    await drain.before_exit("state")  # type: ignore[arg-type]
    assert ran == ["first", "second:state"]
