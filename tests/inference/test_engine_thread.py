"""The engine built and stepped on one thread (inference/engine/thread.py): EngineThread's calls,
and AsyncEngine.build, whose engine is constructed on the thread that then runs every step."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

import kvchat.inference.engine.async_engine as async_engine_module
from kvchat.inference.engine.async_engine import AsyncEngine
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.thread import EngineThread
from kvchat.inference.errors import ModelLoadError
from kvchat.memory.config import CacheConfig
from kvchat_testing.engines import BLOCK, GREEDY, make_engine, random_prompt


def test_calls_run_on_the_thread_in_order_and_raise_here() -> None:
    thread = EngineThread(name="probe-engine")
    seen: list[str] = []
    assert thread.call(lambda: seen.append(threading.current_thread().name) or 41 + 1) == 42
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 // 0)
    done = threading.Event()
    thread.run_last(lambda: (seen.append(threading.current_thread().name), done.set()))
    assert done.wait(30)
    thread.thread.join(30)
    assert seen == ["probe-engine", "probe-engine"] and not thread.thread.is_alive()
    with pytest.raises(RuntimeError, match="no more calls"):
        thread.call(lambda: None)


def config(path: Path) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype="float32",
        device="cpu",
        attention_backend="torch",
        cache=CacheConfig(block_size=BLOCK, num_blocks_override=128),
    )


def test_build_constructs_and_steps_the_engine_on_one_thread(
    tiny_llama: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    built_on: list[threading.Thread] = []
    stepped_on: set[threading.Thread] = set()

    class Recorded(Engine):  # the real engine, recording where it runs
        def __init__(self, cfg: EngineConfig) -> None:
            built_on.append(threading.current_thread())
            super().__init__(cfg)

        def step(self) -> Any:
            stepped_on.add(threading.current_thread())
            return super().step()

    monkeypatch.setattr(async_engine_module, "Engine", Recorded)
    path = tiny_llama[0]
    runner = AsyncEngine.build(config(path))
    prompt = random_prompt(9, seed=3)
    runner.start()
    try:

        async def stream() -> list[int]:
            tokens: list[int] = []
            async for out in runner.generate("r", runner.engine.check_request(prompt, GREEDY)):
                tokens.extend(out.new_token_ids)
            return tokens

        tokens = asyncio.run(stream())
    finally:
        runner.shutdown()
    assert tokens == make_engine(path).generate([prompt], GREEDY)[0].output_token_ids
    assert built_on and built_on[0] is not threading.current_thread()
    assert stepped_on == {built_on[0]}
    assert not built_on[0].is_alive()  # the loop ended with the shutdown, and the thread too


def test_a_built_engine_never_started_shuts_down_at_once(tiny_llama: tuple[Path, Any]) -> None:
    runner = AsyncEngine.build(config(tiny_llama[0]))
    owner = runner._owner
    assert owner is not None and owner.thread.is_alive()
    runner.shutdown(join_timeout=30)
    owner.thread.join(30)
    assert not owner.thread.is_alive() and not runner.is_running


def test_a_failed_build_raises_here_and_ends_its_thread(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    with pytest.raises(ModelLoadError, match="no-model-here"):
        AsyncEngine.build(config(tmp_path / "no-model-here"))
    for thread in set(threading.enumerate()) - before:
        thread.join(30)
        assert not thread.is_alive()
