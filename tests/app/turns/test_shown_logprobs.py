"""ShownLogprobs: each text delta gets the logprobs of the tokens that came with it and of
those before it that came without text; a closing end-of-sequence token goes with none."""

from __future__ import annotations

import random

from kvchat.app.turns.generation import ShownLogprobs, TextDelta, TokenLogprob

EOS = 7


def entry(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -random.random(), None)


def test_a_token_without_text_goes_with_the_next_text() -> None:
    shown = ShownLogprobs(frozenset({EOS}))
    a, b, c, d = (entry(i) for i in (1, 2, 3, 4))
    assert shown.of(TextDelta("x", [a])) == (a,)
    assert shown.of(TextDelta("", [b])) == ()  # part of a character
    assert shown.of(TextDelta("", [c])) == ()
    assert shown.of(TextDelta("é", [d])) == (b, c, d)
    assert shown.of(TextDelta("y", [])) == ()  # a delta of text from tokens already given


def test_a_closing_end_of_sequence_token_is_not_the_texts() -> None:
    shown = ShownLogprobs(frozenset({EOS}))
    a, held, eos = entry(1), entry(2), entry(EOS)
    assert shown.of(TextDelta("a", [a])) == (a,)
    assert shown.of(TextDelta("", [held])) == ()
    # The last output: the held text flushed, with the end-of-sequence token.
    assert shown.of(TextDelta("b", [eos])) == (held,)
    assert shown.of(TextDelta("", [eos])) == ()


def test_nothing_is_closing_when_the_request_ignores_eos() -> None:
    shown = ShownLogprobs(frozenset())
    eos = entry(EOS)
    assert shown.of(TextDelta("<|im_end|>", [eos])) == (eos,)


def test_every_token_with_text_is_given_once_in_order() -> None:
    shown = ShownLogprobs(frozenset({EOS}))
    deltas = [
        TextDelta(random.choice(["", "t"]), [entry(random.randrange(8, 100))])
        for _ in range(random.randrange(1, 40))
    ]
    deltas.append(TextDelta("end", [entry(8)]))
    given = [e for delta in deltas for e in shown.of(delta)]
    assert given == [e for delta in deltas for e in delta.logprobs]
