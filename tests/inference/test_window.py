"""Long single turns: a generation that would outgrow its session's max_kv_tokens runs with
sink + window attention and holds a flat amount of KV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.request_output import RequestOutput
from kvchat.inference.engine.scheduler import SchedulerConfig
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.memory.config import CacheConfig, SessionBudget
from kvchat.memory.kv_cache_manager import cdiv
from kvchat_testing.engines import random_prompt
from kvchat_testing.hf_models import build_hf_model

BLOCK = 16
BUDGET = 64  # max_kv_tokens: 4 blocks


def make_engine(path: Path, backend: str = "torch") -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cpu",
            attention_backend=backend,
            cache=CacheConfig(block_size=BLOCK, num_blocks_override=64),
            scheduler=SchedulerConfig(max_num_batched_tokens=64),
        )
    )


def run(
    engine: Engine,
    requests: dict[str, tuple[list[int], SamplingParams, str | None]],
    watch: str | None = None,
) -> tuple[dict[str, RequestOutput], int]:
    """Run requests together; returns finals and the most blocks `watch` ever held."""
    for rid, (prompt, params, session) in requests.items():
        engine.add_request(rid, prompt, params, session_id=session)
    finals: dict[str, RequestOutput] = {}
    most = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        for seq in engine.scheduler.running:
            if seq.request_id == watch:
                most = max(most, len(seq.kv.held_block_ids))
    return finals, most


LONG = SamplingParams(max_tokens=4 * BUDGET, temperature=0.0, ignore_eos=True)


def test_a_generation_four_times_the_budget_holds_at_most_the_budget(
    tiny_llama: tuple[Path, Any],
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    engine.set_session_budget("conv", SessionBudget(max_kv_tokens=BUDGET))
    prompt = random_prompt(20, seed=3)
    finals, most = run(engine, {"long": (prompt, LONG, "conv")}, watch="long")
    out = finals["long"]
    assert out.finish_reason == "length" and out.num_output_tokens == 4 * BUDGET
    assert out.window_applied
    assert 0 < most <= cdiv(BUDGET, BLOCK)
    info = engine.session_info("conv")
    assert info is not None and info.num_tokens <= BUDGET  # only KV full attention computed
    # Until the budget is reached attention is full: the tokens equal an unbudgeted run's.
    plain, _ = run(make_engine(path), {"plain": (prompt, LONG, None)})
    full = plain["plain"].output_token_ids or []
    windowed = out.output_token_ids or []
    same = BUDGET - len(prompt)
    assert windowed[:same] == full[:same]
    assert windowed != full  # past it, the window changes what the model sees
    assert engine.block_pool.num_used_blocks <= cdiv(BUDGET, BLOCK)


def test_the_window_runs_beside_other_requests_without_changing_them(
    tiny_llama: tuple[Path, Any],
) -> None:
    path, _ = tiny_llama
    prompt = random_prompt(20, seed=3)
    short = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = make_engine(path)
    alone.set_session_budget("conv", SessionBudget(max_kv_tokens=BUDGET))
    solo, _ = run(alone, {"long": (prompt, LONG, "conv")})
    others = {f"o{i}": (random_prompt(9 + 7 * i, seed=40 + i), short, None) for i in range(3)}
    reference, _ = run(make_engine(path), others)
    together = make_engine(path)
    together.set_session_budget("conv", SessionBudget(max_kv_tokens=BUDGET))
    finals, most = run(together, {"long": (prompt, LONG, "conv"), **others}, watch="long")
    assert finals["long"].output_token_ids == solo["long"].output_token_ids
    for rid in others:
        assert finals[rid].output_token_ids == reference[rid].output_token_ids
    assert most <= cdiv(BUDGET, BLOCK)


def test_triton_kernels_agree_on_the_window(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    prompt = random_prompt(20, seed=5)
    params = SamplingParams(max_tokens=2 * BUDGET, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        engine = make_engine(path, backend)
        engine.set_session_budget("conv", SessionBudget(max_kv_tokens=BUDGET))
        finals, _ = run(engine, {"w": (prompt, params, "conv")})
        assert finals["w"].window_applied
        outs[backend] = finals["w"].output_token_ids
    assert outs["torch"] == outs["triton"]


def test_a_model_with_its_own_sliding_window_keeps_it(tmp_path: Path) -> None:
    build_hf_model(
        tmp_path,
        "mistral",
        seed=2,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=24,
    )
    prompt = random_prompt(20, seed=6)
    budgeted = make_engine(tmp_path)
    budgeted.set_session_budget("conv", SessionBudget(max_kv_tokens=BUDGET))
    finals, _ = run(budgeted, {"m": (prompt, LONG, "conv")})
    plain, _ = run(make_engine(tmp_path), {"m": (prompt, LONG, None)})
    assert not finals["m"].window_applied
    assert finals["m"].output_token_ids == plain["m"].output_token_ids


@pytest.mark.parametrize("prompt_tokens", [BUDGET, BUDGET + 10])
def test_a_prompt_over_the_budget_is_computed_whole(
    tiny_llama: tuple[Path, Any], prompt_tokens: int
) -> None:
    path, _ = tiny_llama
    prompt = random_prompt(prompt_tokens, seed=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = make_engine(path)
    engine.set_session_budget("conv", SessionBudget(max_kv_tokens=BUDGET))
    finals, _ = run(engine, {"p": (prompt, params, "conv")})
    plain, _ = run(make_engine(path), {"p": (prompt, params, None)})
    assert not finals["p"].window_applied
    assert finals["p"].output_token_ids == plain["p"].output_token_ids
