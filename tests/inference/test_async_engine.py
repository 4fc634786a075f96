"""Streaming through the engine thread to asyncio consumers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from inference.async_engine import AsyncEngine
from inference.errors import InvalidRequestError
from inference.sampling_params import SamplingParams
from tests.inference.test_engine import GREEDY, make_engine, random_prompt


@pytest.fixture
def async_engine(tiny_llama: tuple[Path, Any]) -> Any:
    path, _ = tiny_llama
    engine = AsyncEngine(make_engine(path))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
    tokens = []
    async for out in engine.generate(rid, prompt, GREEDY):
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
        async for _ in async_engine.generate("leaver", random_prompt(8, seed=1), params):
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
        async for _ in async_engine.generate("bad", [], GREEDY):
            pass

    with pytest.raises(InvalidRequestError):
        asyncio.run(main())
    assert async_engine.is_running
