"""ends_in_loop: whether an output ends in a short cycle repeated long enough."""

from __future__ import annotations

import random

from kvchat.inference.text.loops import MAX_LOOP_PERIOD, MIN_LOOP_TOKENS, ends_in_loop


def test_a_cycle_is_caught_once_it_spans_enough_tokens() -> None:
    rng = random.Random(0)
    for period in range(1, MAX_LOOP_PERIOD + 1):
        cycle = rng.sample(range(1000, 2000), period)  # distinct: no shorter period
        span = max(MIN_LOOP_TOKENS, 3 * period)
        head = [rng.randrange(1000) for _ in range(7)]
        tokens = head + (cycle * (span // period + 2))[:span]
        assert ends_in_loop(tokens), period
        assert not ends_in_loop(tokens[:-1]), period  # one token short of the span
        assert not ends_in_loop([*tokens, 5]), period  # the cycle broken at the end


def test_no_cycle_no_loop() -> None:
    rng = random.Random(1)
    assert not ends_in_loop([])
    assert not ends_in_loop([5] * (MIN_LOOP_TOKENS - 1))
    assert ends_in_loop([5] * MIN_LOOP_TOKENS)
    assert not ends_in_loop(list(range(300)))  # a sequence that grows is no cycle
    assert not ends_in_loop([rng.randrange(50) for _ in range(300)])
    longer = list(range(MAX_LOOP_PERIOD + 1)) * 10  # a period past the longest looked for
    assert not ends_in_loop(longer)
