"""Penalties, logit bias and min-p against references computed by hand (vLLM's semantics:
inference/model/penalties.py), batched rows with different knobs, and rows without knobs left
exactly as they were."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvchat.inference.errors import InvalidRequestError
from kvchat.inference.model.penalties import apply_penalties
from kvchat.inference.model.sampler import Sampler
from kvchat.inference.model.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from kvchat_testing.engines import make_engine, random_prompt


def test_each_penalty_by_hand_in_one_batch() -> None:
    logits = torch.tensor(
        [
            [1.0, 2.0, -2.0, 4.0, 0.5, -1.0],
            [1.0, 2.0, -2.0, 4.0, 0.5, -1.0],
            [1.0, 2.0, -2.0, 4.0, 0.5, -1.0],
            [0.3, -0.7, 1.1, 2.9, -4.0, 0.0],
        ]
    )
    params = [
        # repetition over the prompt (1, 2) and the output (3): 2.0 / 2, -2.0 * 2, 4.0 / 2
        SamplingParams(repetition_penalty=2.0),
        # frequency and presence over the output only (4, 4, 5), never the prompt (0, 4)
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        # bias on 0 and 5, then a presence penalty on 5 (generated once)
        SamplingParams(logit_bias={0: 10.0, 5: -3.0}, presence_penalty=1.0),
        SamplingParams(),  # no knobs
    ]
    token_ids = [[1, 2, 3], [0, 4, 4, 4, 5], [0, 1, 5], [3, 3, 3]]
    num_prompt = [2, 2, 2, 1]
    got = apply_penalties(logits, params, token_ids, num_prompt)
    expected = torch.tensor(
        [
            [1.0, 1.0, -4.0, 2.0, 0.5, -1.0],
            [1.0, 2.0, -2.0, 4.0, 0.5 - 0.5 * 2 - 0.25, -1.0 - 0.5 - 0.25],
            [11.0, 2.0, -2.0, 4.0, 0.5, -1.0 - 3.0 - 1.0],
            [0.3, -0.7, 1.1, 2.9, -4.0, 0.0],
        ]
    )
    assert torch.equal(got, expected)
    assert torch.equal(got[3], logits[3])  # a row without knobs: exactly as it was
    assert torch.equal(logits[0], torch.tensor([1.0, 2.0, -2.0, 4.0, 0.5, -1.0]))  # not in place


def test_no_knobs_is_the_same_tensor() -> None:
    logits = torch.randn(3, 10)
    assert apply_penalties(logits, [SamplingParams()] * 3, [[1]] * 3, [1] * 3) is logits


def test_greedy_rows_take_the_penalized_argmax() -> None:
    sampler = Sampler(seed=0)
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={2: 4.5}),  # 1.0 + 4.5 > 5.0
        SamplingParams(temperature=0.0, frequency_penalty=2.0),  # 5 - 2 * 3 < 1
    ]
    out = sampler(
        logits, params, [None] * 3, token_ids=[[0, 1, 1, 1]] * 3, num_prompt_tokens=[1] * 3
    )
    assert out.token_ids == [1, 2, 2]


def test_min_p_keeps_exactly_the_tokens_at_or_above_its_share() -> None:
    # probabilities 0.5, 0.25, 0.125, 0.125: shares of the top 1, 1/2, 1/4, 1/4
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log().repeat(2, 1)
    sampler = Sampler(seed=0)
    seen: dict[float, set[int]] = {0.25: set(), 0.3: set()}
    for draw in range(300):
        params = [SamplingParams(min_p=0.25), SamplingParams(min_p=0.3)]
        gens = [torch.Generator().manual_seed(draw), torch.Generator().manual_seed(10_000 + draw)]
        out = sampler(logits, params, gens)
        seen[0.25].add(out.token_ids[0])
        seen[0.3].add(out.token_ids[1])
    assert seen[0.25] == {0, 1, 2, 3}  # a share of exactly min_p stays
    assert seen[0.3] == {0, 1}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ],
)
def test_out_of_range_knobs_name_their_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**fields)
    assert e.value.field == field


def test_top_k_minus_one_is_off() -> None:
    assert SamplingParams(top_k=-1).top_k is None
    assert not SamplingParams(top_k=-1).needs_filtering


def test_the_engine_applies_them_per_request(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    prompt = random_prompt(24, seed=7)
    plain, biased, penalized, outside = engine.generate(
        [prompt] * 4,
        [
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={17: 100}),
            SamplingParams(
                temperature=0.0,
                max_tokens=8,
                ignore_eos=True,
                frequency_penalty=2.0,
                presence_penalty=2.0,
                repetition_penalty=2.0,
            ),
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        ],
    )
    assert biased.output_token_ids == [17] * 8
    assert plain.output_token_ids == outside.output_token_ids  # batched beside knobs: unchanged
    # The strongest penalties: on this model (seeded weights), no token of the prompt comes
    # back and none of the reply twice (without them greedy decoding repeats itself).
    reply = penalized.output_token_ids
    assert len(set(reply)) == len(reply) and not set(reply) & set(prompt)
    with pytest.raises(InvalidRequestError) as e:
        engine.check_request(prompt, SamplingParams(logit_bias={10**6: 1.0}))
    assert e.value.field == "logit_bias"
