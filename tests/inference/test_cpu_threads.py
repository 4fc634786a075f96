"""Adaptive CPU threads: each step runs on the thread count its shape was faster on lately,
found again within a few probes when another process takes a core or gives it back; and the
tokens never depend on the count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvchat.inference.engine.cpu_threads import CpuThreads, step_shape
from kvchat.inference.engine.engine import Engine
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat_testing.engines import make_engine, random_prompt

DECODE = step_shape(num_tokens=4, num_decode=4, num_seqs=4)


def test_shapes_round_up_to_powers_of_two() -> None:
    assert step_shape(1, 1, 1) == ("decode", 1)
    assert step_shape(3, 3, 3) == ("decode", 4)
    assert step_shape(16, 16, 16) == ("decode", 16)
    assert step_shape(300, 0, 1) == ("prefill", 512)
    assert step_shape(513, 1, 2) == ("prefill", 1024)  # a decode beside a prefill: a prefill


def drive(threads: CpuThreads, seconds: dict[int, float], steps: int) -> list[int]:
    """`steps` steps of one shape on a machine where a step takes `seconds[threads]`."""
    chosen = []
    for _ in range(steps):
        n = threads.choose(DECODE)
        threads.record(DECODE, n, seconds[n])
        chosen.append(n)
    return chosen


def test_the_faster_count_runs_and_a_taken_core_is_followed_both_ways() -> None:
    applied: list[int] = []
    threads = CpuThreads((1, 2), probe_every=16, set_threads=applied.append)
    quiet, contended = {1: 1.3, 2: 1.0}, {1: 1.35, 2: 3.0}

    chosen = drive(threads, quiet, 160)
    # Two threads first; one thread as probes, twice as far apart each time it stays slower.
    assert [i for i, n in enumerate(chosen) if n == 1] == [15, 31, 63, 127]
    assert threads.preferred(DECODE) == 2
    changes = [n for before, n in zip([2, *chosen], chosen, strict=False) if n != before]
    assert applied == changes  # a count is applied only when it changes

    # A core taken: two threads' own next step is slow, and one thread runs from the next
    # step on; two threads come back only as probes (16 steps on, then 32).
    chosen = drive(threads, contended, 64)
    assert [i for i, n in enumerate(chosen) if n == 2] == [0, 16, 48]
    assert threads.preferred(DECODE) == 1

    # The core given back: the next probe of two threads finds it faster and it stays.
    chosen = drive(threads, quiet, 96)
    first = chosen.index(2)
    assert first == 48
    assert [i for i, n in enumerate(chosen[first:]) if n == 1] == [16]  # a probe of one
    assert threads.preferred(DECODE) == 2 == threads.verdict


def test_a_new_shape_runs_on_the_count_the_machine_prefers_now() -> None:
    threads = CpuThreads((1, 2), probe_every=4, set_threads=lambda n: None)
    drive(threads, {1: 1.0, 2: 3.0}, 8)  # contended, as decode steps show
    assert threads.verdict == 1
    prefill = step_shape(512, 0, 1)
    assert [threads.choose(prefill) for _ in range(3)] == [1, 1, 1]  # no slow first prefill


def test_shapes_are_timed_apart() -> None:
    threads = CpuThreads((1, 2), probe_every=2, set_threads=lambda n: None)
    prefill = step_shape(512, 0, 1)
    for _ in range(8):
        for shape, seconds in ((DECODE, {1: 1.0, 2: 2.0}), (prefill, {1: 3.0, 2: 2.0})):
            n = threads.choose(shape)
            threads.record(shape, n, seconds[n])
    assert threads.preferred(DECODE) == 1 and threads.preferred(prefill) == 2


def test_bad_choices_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        CpuThreads((0, 2))


def run(engine: Engine, prompts: list[list[int]]) -> list[tuple[Any, ...]]:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=True, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps += [(o.request_id, o.new_token_ids, o.new_logprobs) for o in engine.step()]
    return steps


def test_tokens_and_logprobs_do_not_depend_on_the_thread_count(
    tiny_llama: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = tiny_llama
    prompts = [random_prompt(40 + 9 * i, seed=i) for i in range(3)]
    original = torch.get_num_threads()
    try:
        fixed = make_engine(path)
        fixed.cpu_threads = None
        torch.set_num_threads(2)
        expected = run(fixed, prompts)
        switching = make_engine(path)
        # a probe every other step, whatever the times: the count changes at nearly every step
        chooser = switching.cpu_threads = CpuThreads((1, 2), probe_every=2, max_probe_every=2)
        # Steps timed as two threads the faster, whatever the machine measured: every probe of
        # one thread is followed by a step back on two (a real time could make one thread the
        # choice of a shape, and its steps would stop switching).
        record = chooser.record
        monkeypatch.setattr(
            chooser, "record", lambda shape, n, seconds: record(shape, n, {1: 2.0, 2: 1.0}[n])
        )
        got = run(switching, prompts)
        assert chooser.num_switches >= 6
        assert got == expected
        assert switching.published_stats.num_cpu_thread_switches == (
            switching.cpu_threads.num_switches
        )
    finally:
        torch.set_num_threads(original)
