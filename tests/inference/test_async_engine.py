"""Streaming through the engine thread to asyncio consumers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvchat.inference.engine.async_engine import AsyncEngine, EngineDeadError
from kvchat.inference.engine.engine import MAX_FAILED_STEPS
from kvchat.inference.engine.request_output import RequestOutput
from kvchat.inference.errors import InvalidRequestError, RequestFailedError
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.memory.sessions import SessionState
from kvchat_testing.engines import GREEDY, make_engine, random_prompt
from kvchat_testing.faults import StepFault


@pytest.fixture
def async_engine(tiny_llama: tuple[Path, Any]) -> Any:
    path, _ = tiny_llama
    engine = AsyncEngine(make_engine(path))
    engine.start()
    yield engine
    engine.shutdown()


def checked_stream(
    engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams
) -> AsyncIterator[RequestOutput]:
    """The request checked (errors raise here, before streaming), then streamed."""
    return engine.generate(rid, engine.engine.check_request(prompt, params))


async def collect(engine: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
    tokens = []
    async for out in checked_stream(engine, rid, prompt, GREEDY):
        tokens.extend(out.new_token_ids)
    return tokens


def test_concurrent_streams_get_their_solo_tokens(
    async_engine: AsyncEngine, tiny_llama: tuple[Path, Any]
) -> None:
    prompts = {f"r{i}": random_prompt(5 + 7 * i, seed=i) for i in range(4)}
    reference = make_engine(tiny_llama[0])  # the async engine's thread owns its own engine
    solo = {rid: reference.generate([p], GREEDY)[0].output_token_ids for rid, p in prompts.items()}

    async def main() -> dict[str, list[int]]:
        results = await asyncio.gather(*(collect(async_engine, r, p) for r, p in prompts.items()))
        return dict(zip(prompts, results))

    streamed = asyncio.run(main())
    assert streamed == solo


def test_consumer_leaving_aborts_the_request(async_engine: AsyncEngine) -> None:
    engine = async_engine.engine

    async def main() -> int:
        received = 0
        params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        async for _ in checked_stream(async_engine, "leaver", random_prompt(8, seed=1), params):
            received += 1
            if received == 3:
                break  # closes the generator: the request must be aborted
        return received

    assert asyncio.run(main()) == 3
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        asyncio.run(asyncio.sleep(0.01))
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_validation_errors_raise_before_streaming(async_engine: AsyncEngine) -> None:
    async def main() -> None:
        async for _ in checked_stream(async_engine, "bad", [], GREEDY):
            pass

    with pytest.raises(InvalidRequestError):
        asyncio.run(main())
    assert async_engine.is_running


# --- ids, shutdown and a dying engine: every consumer ends, none waits forever ---------------

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


async def drain(stream: Any) -> list[Any]:
    return [out async for out in stream]


@pytest.mark.timeout(60)
def test_duplicate_id_is_rejected_without_touching_the_first_stream(
    async_engine: AsyncEngine,
) -> None:
    async def main() -> tuple[list[Any], type[BaseException] | None]:
        first = checked_stream(async_engine, "dup", random_prompt(8, seed=2), GREEDY)
        head = await first.__anext__()
        error = None
        try:
            await drain(checked_stream(async_engine, "dup", random_prompt(5, seed=3), GREEDY))
        except InvalidRequestError as e:
            error = type(e)
        return [head, *await drain(first)], error

    outs, error = asyncio.run(main())
    assert error is InvalidRequestError
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == GREEDY.max_tokens


@pytest.mark.timeout(60)
def test_an_id_reused_right_after_it_finished_streams_to_its_new_consumer(
    async_engine: AsyncEngine,
) -> None:
    async def main() -> list[Any]:
        old = checked_stream(async_engine, "retry", random_prompt(8, seed=4), GREEDY)
        async for out in old:
            if out.finished:
                break  # leaves the old generator suspended, not closed
        new = checked_stream(async_engine, "retry", random_prompt(8, seed=4), GREEDY)
        head = await new.__anext__()
        await old.aclose()  # the old stream's cleanup runs now, after the new one registered
        return [head, *await drain(new)]

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "length"


@pytest.mark.timeout(60)
def test_shutdown_ends_open_streams_and_refuses_new_requests(
    tiny_llama: tuple[Path, Any],
) -> None:
    engine = AsyncEngine(make_engine(tiny_llama[0]))
    engine.start()

    async def main() -> tuple[list[Any], BaseException | None]:
        stream = checked_stream(engine, "long", random_prompt(8, seed=5), LONG)
        outs = [await stream.__anext__()]
        await asyncio.to_thread(engine.shutdown, 0.0)
        error: BaseException | None = None
        try:
            outs += await drain(stream)
        except EngineDeadError as e:
            error = e
        return outs, error

    outs, error = asyncio.run(main())
    # Aborted for the shutdown, with the reason a caller stores; nothing left hanging.
    assert error is None
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert outs[-1].abort_reason == "shutdown"
    assert sum(len(o.new_token_ids) for o in outs) < LONG.max_tokens  # type: ignore[operator]

    async def after() -> None:
        await drain(checked_stream(engine, "late", random_prompt(4, seed=6), GREEDY))

    with pytest.raises(EngineDeadError):
        asyncio.run(after())
    assert not engine.is_running


@pytest.mark.timeout(60)
def test_shutdown_lets_running_requests_finish_within_the_drain_time(
    tiny_llama: tuple[Path, Any],
) -> None:
    engine = AsyncEngine(make_engine(tiny_llama[0]))
    engine.start()

    async def main() -> list[Any]:
        stream = checked_stream(engine, "short", random_prompt(8, seed=7), GREEDY)
        head = await stream.__anext__()
        await asyncio.to_thread(engine.shutdown, 30.0)
        return [head, *await drain(stream)]

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "length"


@pytest.mark.timeout(60)
def test_generate_before_start_is_refused(tiny_llama: tuple[Path, Any]) -> None:
    engine = AsyncEngine(make_engine(tiny_llama[0]))

    async def main() -> None:
        await drain(checked_stream(engine, "early", random_prompt(4, seed=8), GREEDY))

    with pytest.raises(EngineDeadError):
        asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_dying_engine_fails_open_and_racing_requests(tiny_llama: tuple[Path, Any]) -> None:
    core = make_engine(tiny_llama[0])
    StepFault(core, after=3)
    engine = AsyncEngine(core)
    engine.start()

    async def one(i: int) -> str:
        try:
            await drain(checked_stream(engine, f"r{i}", random_prompt(6, seed=i), LONG))
        except EngineDeadError:
            return "dead"
        except RequestFailedError:
            return "failed"
        return "finished"

    async def main() -> list[str]:
        # Requests keep arriving while the engine dies under them.
        tasks = []
        for i in range(12):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.01)
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    # The first failing steps fail their own requests (the engine goes on); once
    # MAX_FAILED_STEPS in a row have failed, the engine stops and fails everyone else.
    assert set(results) == {"failed", "dead"}
    assert isinstance(engine.error, EngineDeadError)
    assert isinstance(engine.error.__cause__, RuntimeError)
    assert core.num_failed_steps == MAX_FAILED_STEPS
    assert not engine.is_running
    engine.shutdown(0.0)


@pytest.mark.timeout(60)
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(
    tiny_llama: tuple[Path, Any],
) -> None:
    """What one request can do to a step (here an injected fault in its forward) ends that
    step's requests with an error and drops their KV; the engine serves the next ones, token
    for token as a fresh engine does, and a session's next turn recomputes."""
    from kvchat_testing.session_engines import make_engine as make_session_engine

    core = make_session_engine(tiny_llama[0])
    fault = StepFault(core, after=2, times=1)
    engine = AsyncEngine(core)
    engine.start()
    prompt = random_prompt(40, seed=4)
    reference = make_session_engine(tiny_llama[0]).generate([prompt], GREEDY)[0]

    async def main() -> tuple[BaseException | None, list[Any], Any]:
        failed: BaseException | None = None
        try:
            request = core.check_request(prompt, LONG, session_id="conv")
            await drain(engine.generate("poisoned", request))
        except RequestFailedError as e:
            failed = e
        info = await engine.session_info("conv")
        again = core.check_request(prompt, GREEDY, session_id="conv")
        return failed, await drain(engine.generate("next", again)), info

    try:
        failed, outs, info = asyncio.run(main())
        assert engine.is_running
    finally:
        engine.shutdown()
    assert fault.raised == 1
    assert failed is not None and "injected fault" in str(failed)
    # The failed turn left its session nothing (what the prefix cache holds came from the
    # steps that succeeded); the next turn answered exactly as an engine that never failed.
    assert info is not None and info.state is SessionState.EMPTY and info.num_tokens == 0
    assert outs[-1].output_token_ids == reference.output_token_ids
    stats = engine.stats
    assert (stats.num_failed_steps, stats.num_failed_requests) == (1, 1)
    # Only the session's pinned reply holds blocks.
    assert stats.num_used_blocks == stats.num_pinned_blocks


# --- operator commands: awaited, answered by the engine thread --------------------------------


@pytest.mark.timeout(60)
def test_evict_answers_with_the_session_right_after_the_eviction(
    tiny_llama: tuple[Path, Any],
) -> None:
    from kvchat_testing.session_engines import make_engine as make_session_engine

    core = make_session_engine(tiny_llama[0], host_blocks=16)
    engine = AsyncEngine(core)
    engine.start()

    async def main() -> tuple[Any, ...]:
        request = core.check_request(random_prompt(40, seed=9), GREEDY, session_id="conv")
        outs = await drain(engine.generate("turn", request))
        # Right after the reply: the call runs after the step that pins its last token.
        offloaded = await engine.evict_session("conv")
        dropped = await engine.evict_session("conv", offload=False)
        info = await engine.session_info("conv")
        report = await engine.memory_report()
        return outs[-1], offloaded, dropped, info, report

    try:
        final, offloaded, dropped, info, report = asyncio.run(main())
    finally:
        engine.shutdown()
    pinned = final.num_prompt_tokens + final.num_output_tokens
    assert offloaded.before.state is SessionState.RESIDENT
    assert offloaded.before.num_tokens == pinned
    assert offloaded.after.state is SessionState.OFFLOADED
    assert offloaded.after.num_device_blocks == 0
    assert offloaded.after.num_host_blocks == offloaded.before.num_device_blocks == -(-pinned // 16)
    # Each answer is the session at its own step (what moves with time aside: its idle time,
    # and the retention policy's prediction).

    def at_rest(session: Any) -> Any:
        return replace(session, idle_seconds=0, value=0.0, next_turn_s=None)

    assert at_rest(dropped.before) == at_rest(offloaded.after)
    assert dropped.after.state is SessionState.EMPTY and dropped.after.num_host_blocks == 0
    assert at_rest(info) == at_rest(dropped.after)
    assert (report.stats.cache.session_offloads, report.stats.cache.session_drops) == (1, 1)
    assert [s.session_id for s in report.sessions] == ["conv"]
    assert report.stats.num_used_blocks == report.stats.num_used_host_blocks == 0
    # What other threads read: the stats the engine published after its last step.
    assert engine.stats.cache.session_drops == 1 and engine.stats.num_waiting == 0


@pytest.mark.timeout(60)
def test_commands_to_an_engine_that_is_not_running_raise_instead_of_waiting(
    tiny_llama: tuple[Path, Any],
) -> None:
    engine = AsyncEngine(make_engine(tiny_llama[0]))

    async def ask() -> Any:
        return await engine.session_info("conv")

    with pytest.raises(EngineDeadError):
        asyncio.run(ask())  # not started
    engine.start()
    assert asyncio.run(ask()) is None  # running: the engine knows no such session
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(ask())


def test_a_call_queued_when_the_engine_stops_is_failed_not_left_waiting(
    tiny_llama: tuple[Path, Any],
) -> None:
    core = make_engine(tiny_llama[0])
    queued = core.submit(lambda: "never run")
    AsyncEngine(core).shutdown()  # never started: nothing will step it
    with pytest.raises(EngineDeadError):
        queued.result(timeout=0)
