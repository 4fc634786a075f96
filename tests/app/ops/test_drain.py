"""The drain's state, on an injected clock: when the grace ends (the balancer has seen the
replica draining, or time is up) and how exit hooks run."""

from __future__ import annotations

from typing import Any

import pytest

from kvchat.app.ops.drain import Drain


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

    async def first() -> None:
        ran.append("first")
        raise RuntimeError("the store is gone")

    async def second() -> None:
        ran.append("second")

    drain = Drain(exit_hooks=[first, second])
    await drain.before_exit()
    assert ran == ["first", "second"]


@pytest.mark.anyio
async def test_a_close_that_never_finishes_is_cancelled_and_logged_with_what_it_awaited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import asyncio

    from kvchat.app.ops.drain import bounded_close

    cancelled = asyncio.Event()

    async def stuck_reply() -> None:
        try:
            await asyncio.Event().wait()  # a server that never answers
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def close_the_coordinator() -> None:
        await stuck_reply()

    async def quick() -> None:
        await asyncio.sleep(0)

    assert await bounded_close("a quick close", quick(), timeout=5.0)
    assert not await bounded_close("closing the coordinator", close_the_coordinator(), timeout=0.05)
    assert cancelled.is_set()
    [record] = [r for r in caplog.records if "did not finish" in r.getMessage()]
    message = record.getMessage()
    assert message.startswith("exit: closing the coordinator did not finish within 0 s")
    # The await chain names the coroutine the close was stuck in, innermost last.
    chain = message.split("close_the_coordinator", 1)[1]
    assert "in stuck_reply" in chain and "in wait" in chain.split("in stuck_reply", 1)[1]


@pytest.mark.anyio
async def test_a_close_that_fails_is_logged_and_the_exit_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvchat.app.ops.drain import bounded_close

    async def broken() -> None:
        raise ConnectionError("Redis went away")

    assert await bounded_close("closing the coordinator", broken())
    assert any(
        "exit: closing the coordinator failed" in r.getMessage()
        and r.exc_info
        and "Redis went away" in str(r.exc_info[1])
        for r in caplog.records
    )
