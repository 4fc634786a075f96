"""The sampling knobs every transport takes (logit_bias, min_p, presence, frequency and
repetition penalties), checked through one transport's `reply(fields) -> text` and
`refused(fields) -> (status, param)`: each knob reaches the engine and does what it must."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Reply = Callable[[dict[str, Any]], str]
Refused = Callable[[dict[str, Any]], tuple[int, str | None]]


def check_sampling_knobs(tokenizer: Any, reply: Reply, refused: Refused) -> None:
    greedy = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    plain = reply(greedy)

    # logit_bias +100 on one token: greedy decoding writes nothing else
    (cat,) = tokenizer.encode(" cat")
    forced = reply({**greedy, "max_tokens": 4, "logit_bias": {str(cat): 100}})
    assert forced == tokenizer.decode([cat]) * 4, forced

    # min_p 1.0 keeps only the most likely token: sampling at temperature 1 is greedy
    assert reply({**greedy, "temperature": 1.0, "seed": 3, "min_p": 1.0}) == plain
    # top_k -1 is vLLM's "off": the same seeded sample as without it
    seeded = {**greedy, "temperature": 1.0, "seed": 3}
    assert reply({**seeded, "top_k": -1}) == reply(seeded)

    # the penalties change a greedy reply that repeats itself
    tokens = tokenizer.encode(plain)
    assert len(set(tokens)) < len(tokens), plain  # the dev model repeats under greedy decoding
    for knob in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 2.0},
    ):
        penalized = reply({**greedy, **knob})
        assert penalized != plain, knob
        penalized_tokens = tokenizer.encode(penalized)
        assert len(set(penalized_tokens)) > len(set(tokens)), (knob, penalized)

    for fields, param in (
        ({"logit_bias": {"cat": 1}}, "logit_bias"),
        ({"logit_bias": {str(cat): 101}}, "logit_bias"),
        ({"logit_bias": {"999999999": 1}}, "logit_bias"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"),
    ):
        assert refused({**greedy, **fields}) == (400, param), fields
