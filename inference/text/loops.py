"""A reply caught in a loop: a small model under a grammar repeats a few tokens without end
(`[1, 1, 1, ...` in an array argument, `_mems_mems_mems` in a string) where the grammar gives
it no way to stop, so without a check it writes to max_tokens, or to the end of its context
when a client sets none (Open WebUI's page), and the call is lost anyway. A reply whose newest
tokens are one short cycle turned at least three times over MIN_LOOP_TOKENS tokens is caught."""

from __future__ import annotations

from collections.abc import Sequence

MAX_LOOP_PERIOD = 32  # tokens in one turn of a cycle
MIN_LOOP_TOKENS = 32  # tokens the repetition must span


def ends_in_loop(token_ids: Sequence[int]) -> bool:
    """Whether `token_ids` ends in a cycle of at most MAX_LOOP_PERIOD tokens repeated over at
    least max(MIN_LOOP_TOKENS, 3 periods) tokens."""
    n = len(token_ids)
    for period in range(1, MAX_LOOP_PERIOD + 1):
        span = max(MIN_LOOP_TOKENS, 3 * period)
        if span > n:
            return False
        if all(token_ids[i] == token_ids[i + period] for i in range(n - span, n - period)):
            return True
    return False
