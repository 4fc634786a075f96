"""Engine behaviour: continuous batching must not change any request's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.request_output import RequestOutput
from kvchat.inference.errors import InvalidRequestError
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat_testing.engines import BLOCK, GREEDY, make_engine, random_prompt


def run_until_done(engine: Engine) -> dict[str, RequestOutput]:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5]


@pytest.fixture(scope="module")
def solo_tokens(tiny_llama: tuple[Path, Any]) -> dict[int, list[int]]:
    path, _ = tiny_llama
    engine = make_engine(path)
    return {
        n: engine.generate([random_prompt(n, seed=n)], GREEDY)[0].output_token_ids or []
        for n in LENGTHS
    }


def test_batch_of_mixed_lengths_gives_each_request_its_solo_tokens(
    tiny_llama: tuple[Path, Any], solo_tokens: dict[int, list[int]]
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    outs = engine.generate([random_prompt(n, seed=n) for n in LENGTHS], GREEDY)
    for n, out in zip(LENGTHS, outs):
        assert out.output_token_ids == solo_tokens[n], f"prompt length {n}"
        assert out.finish_reason == "length"


def test_small_token_budget_chunks_prefill_without_changing_tokens(
    tiny_llama: tuple[Path, Any], solo_tokens: dict[int, list[int]]
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path, max_num_batched_tokens=7)
    outs = engine.generate([random_prompt(n, seed=n) for n in LENGTHS], GREEDY)
    for n, out in zip(LENGTHS, outs):
        assert out.output_token_ids == solo_tokens[n], f"prompt length {n}"


def test_a_prompt_alone_takes_the_solo_budget_and_a_generating_request_the_small_one(
    tiny_llama: tuple[Path, Any], solo_tokens: dict[int, list[int]]
) -> None:
    """No request generating: a step prefills up to max_solo_prefill_tokens. Once one is
    generating, every step keeps to max_num_batched_tokens, its decode included."""
    path, _ = tiny_llama
    engine = make_engine(path, max_num_batched_tokens=7, max_solo_prefill_tokens=40)
    long = 3 * BLOCK + 5
    engine.add_request("alone", random_prompt(long, seed=long), GREEDY)

    def computed(request_id: str) -> int:
        return next(
            s for s in engine.scheduler.running if s.request_id == request_id
        ).kv.num_computed_tokens

    engine.step()
    assert computed("alone") == 40
    first = engine.step()  # the rest of the prompt, and its first token
    assert computed("alone") == long and first[0].new_token_ids
    engine.add_request("joins", random_prompt(BLOCK + 1, seed=BLOCK + 1), GREEDY)
    engine.step()
    assert computed("alone") == long + 1  # its decode
    assert computed("joins") == 6  # the 7-token budget's rest
    finals = run_until_done(engine)
    assert finals["alone"].output_token_ids == solo_tokens[long]
    assert finals["joins"].output_token_ids == solo_tokens[BLOCK + 1]


def test_request_joining_mid_batch_changes_no_other_tokens(
    tiny_llama: tuple[Path, Any], solo_tokens: dict[int, list[int]]
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    engine.add_request("a", random_prompt(BLOCK, seed=BLOCK), GREEDY)
    engine.add_request("b", random_prompt(1, seed=1), GREEDY)
    finals: dict[str, RequestOutput] = {}
    for step in range(200):
        if step == 5:
            engine.add_request("late", random_prompt(3 * BLOCK + 5, seed=3 * BLOCK + 5), GREEDY)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert finals["a"].output_token_ids == solo_tokens[BLOCK]
    assert finals["b"].output_token_ids == solo_tokens[1]
    assert finals["late"].output_token_ids == solo_tokens[3 * BLOCK + 5]


def test_abort_mid_batch_stops_that_request_only(
    tiny_llama: tuple[Path, Any], solo_tokens: dict[int, list[int]]
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    engine.add_request("keep", random_prompt(BLOCK + 1, seed=BLOCK + 1), GREEDY)
    engine.add_request("drop", random_prompt(BLOCK - 1, seed=BLOCK - 1), GREEDY)
    streamed: dict[str, list[int]] = {"keep": [], "drop": []}
    finals: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 4:
            engine.abort_request("drop")
        for out in engine.step():
            streamed[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        steps += 1
    assert finals["drop"].finish_reason == "abort"
    # Aborted within one step: 4 steps ran before the abort, each gave it one token.
    assert len(streamed["drop"]) == 4
    assert streamed["drop"] == solo_tokens[BLOCK - 1][:4]
    assert finals["keep"].output_token_ids == solo_tokens[BLOCK + 1]
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_seeded_sampling_is_reproducible_and_batch_independent(
    tiny_llama: tuple[Path, Any],
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    prompt = random_prompt(20, seed=99)
    alone = engine.generate([prompt], seeded)[0].output_token_ids
    again = engine.generate([prompt], seeded)[0].output_token_ids
    others = [random_prompt(9, seed=5), random_prompt(33, seed=6)]
    batched = engine.generate(
        [others[0], prompt, others[1]],
        [SamplingParams(max_tokens=20, temperature=1.0), seeded, SamplingParams(max_tokens=5)],
    )[1].output_token_ids
    assert alone == again == batched
    other_seed = engine.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=4321)
    )[0].output_token_ids
    assert other_seed != alone


def test_logprobs_are_the_chosen_tokens_log_probabilities(tiny_llama: tuple[Path, Any]) -> None:
    path, hf_model = tiny_llama
    engine = make_engine(path)
    prompt = random_prompt(10, seed=3)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    streamed: list[float] = []
    engine.add_request("lp", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.extend(out.new_logprobs or [])
            final = out
    assert final is not None and final.output_token_ids is not None
    with torch.no_grad():
        full = torch.tensor([prompt + final.output_token_ids])
        logp = hf_model(full).logits[0].float().log_softmax(-1)
    expected = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(final.output_token_ids)]
    assert streamed == pytest.approx(expected, abs=1e-4)


def test_stop_token_ids_end_generation_and_are_reported(
    tiny_llama: tuple[Path, Any], solo_tokens: dict[int, list[int]]
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    expected = solo_tokens[BLOCK]
    stop_at = expected[5]
    first = expected.index(stop_at)
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_at,))
    out = engine.generate([random_prompt(BLOCK, seed=BLOCK)], params)[0]
    assert out.finish_reason == "stop"
    assert out.output_token_ids == expected[: first + 1]


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(max_tokens=4), "prompt"),
        ([1, 2, 512], SamplingParams(max_tokens=4), "prompt"),
        ([-1], SamplingParams(max_tokens=4), "prompt"),
        (list(range(100)) * 11, SamplingParams(max_tokens=4), "prompt"),  # 1100 > 1024 context
        (list(range(100)) * 10, SamplingParams(max_tokens=100), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=4, stop=("x",)), "stop"),  # no tokenizer
    ],
)
def test_bad_requests_are_rejected_with_the_field_named(
    tiny_llama: tuple[Path, Any], prompt: list[int], params: SamplingParams, field: str
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompt, params)
    assert err.value.field == field
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=2.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),  # -1 is vLLM's "off"
        (dict(stop=("a", "b", "c", "d", "e")), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_duplicate_request_id_is_rejected(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    engine.add_request("same", [1, 2, 3], GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request("same", [4, 5], GREEDY)
    run_until_done(engine)
    engine.add_request("same", [4, 5], SamplingParams(max_tokens=2))  # free again once finished
    assert run_until_done(engine)["same"].num_output_tokens == 2


def test_generate_with_one_bad_prompt_queues_none_of_them(
    tiny_llama: tuple[Path, Any], solo_tokens: dict[int, list[int]]
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    with pytest.raises(InvalidRequestError):
        engine.generate([random_prompt(BLOCK, seed=BLOCK), [1, 2, 99999]], GREEDY)
    assert not engine.has_unfinished_requests()
    # The next call runs exactly its own prompt, nothing left over from the failed one.
    outs = engine.generate([random_prompt(1, seed=1)], GREEDY)
    assert len(outs) == 1 and outs[0].output_token_ids == solo_tokens[1]
    assert not engine.has_unfinished_requests()


def test_no_salt_and_the_empty_salt_are_different_tenants(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    prompt = random_prompt(3 * BLOCK + 1, seed=7)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def cached(salt: str | None) -> int:
        rid = f"r{engine.stats.prompt_tokens}"
        engine.add_request(rid, prompt, params, cache_salt=salt)
        return run_until_done(engine)[rid].num_cached_tokens

    assert cached(None) == 0
    assert cached("") == 0  # same tokens, other tenant
    assert cached("") == 3 * BLOCK
    assert cached(None) == 3 * BLOCK


def test_session_context_budget_is_enforced(tiny_llama: tuple[Path, Any]) -> None:
    from kvchat.memory.config import SessionBudget

    path, _ = tiny_llama
    engine = make_engine(path)
    engine.set_session_budget("conv", SessionBudget(max_context_tokens=40))
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("over", random_prompt(40, seed=1), GREEDY, session_id="conv")
    assert err.value.code == "context_length_exceeded" and "40" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(
            "reserve", random_prompt(30, seed=1), SamplingParams(max_tokens=11), session_id="conv"
        )
    assert err.value.field == "max_tokens"
    # Without max_tokens, generation stops at the budget.
    unbounded = SamplingParams(temperature=0.0, ignore_eos=True)
    engine.add_request("fits", random_prompt(30, seed=1), unbounded, session_id="conv")
    out = run_until_done(engine)["fits"]
    assert out.finish_reason == "length" and out.num_output_tokens == 10
    # Other sessions and requests outside a session keep the model's context.
    engine.add_request("free", random_prompt(30, seed=1), SamplingParams(max_tokens=20))
    assert run_until_done(engine)["free"].num_output_tokens == 20


def test_top_logprobs_are_the_most_likely_tokens(tiny_llama: tuple[Path, Any]) -> None:
    path, hf_model = tiny_llama
    engine = make_engine(path)
    prompt = random_prompt(9, seed=4)
    params = SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    engine.add_request("top", prompt, params)
    tops, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tops.extend(out.new_top_logprobs or [])
            final = out
    assert final is not None and final.output_token_ids is not None and len(tops) == 3
    with torch.no_grad():
        full = torch.tensor([prompt + final.output_token_ids])
        logp = hf_model(full).logits[0].float().log_softmax(-1)
    for step, top in enumerate(tops):
        values, ids = logp[len(prompt) - 1 + step].topk(5)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
        assert top[0][0] == final.output_token_ids[step]  # greedy picks the first


def test_each_step_publishes_its_stats_for_other_threads(tiny_llama: tuple[Path, Any]) -> None:
    engine = make_engine(tiny_llama[0], max_num_seqs=2)
    for i in range(3):
        engine.add_request(f"r{i}", random_prompt(8, seed=i), GREEDY)
    before = engine.published_stats
    assert (before.num_running, before.num_waiting, before.cache.prompt_tokens) == (0, 0, 0)
    engine.step()
    stats = engine.published_stats
    assert before.num_waiting == 0  # a published snapshot never changes
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (2, 1, 0)
    assert stats.num_used_blocks == engine.block_pool.num_used_blocks > 0
    assert stats.kv_cache_usage == stats.num_used_blocks / stats.num_blocks
    assert stats.cache.prompt_tokens == 16 and stats.cache is not engine.stats
    run_until_done(engine)
    after = engine.published_stats
    assert (after.num_running, after.num_waiting, after.num_used_blocks) == (0, 0, 0)
    assert after.cache.prompt_tokens == 24
    assert stats.cache.prompt_tokens == 16


def test_prefill_steps_measure_what_recomputing_a_session_costs(
    tiny_llama: tuple[Path, Any],
) -> None:
    """The retention policy prices a dropped session's KV at the engine's own prefill rate:
    a prefill step moves it off the configured figure, decode steps do not."""
    engine = make_engine(tiny_llama[0])
    policy = engine.sessions.retention
    configured = policy.prefill_s_per_token
    engine.generate([random_prompt(8, seed=3)], SamplingParams(max_tokens=4, temperature=0))
    assert policy.prefill_s_per_token == configured  # 8 prompt tokens: too few to go by
    engine.generate([random_prompt(200, seed=4)], SamplingParams(max_tokens=1, temperature=0))
    assert policy.prefill_s_per_token != configured and policy.prefill_s_per_token > 0


def test_a_step_that_runs_nothing_says_so(tiny_llama: tuple[Path, Any]) -> None:
    """The stepping thread waits (instead of spinning) after a step that ran nothing and
    gave nothing, as when every waiting request waits on a held session."""
    engine = make_engine(tiny_llama[0])
    engine.step()
    assert engine.stepped_nothing
    engine.add_request("r", random_prompt(8, seed=1), GREEDY)
    engine.step()
    assert not engine.stepped_nothing
    run_until_done(engine)
