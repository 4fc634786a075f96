"""The sampler's draws: by inversion over vocabulary blocks, each token's chance is its
probability (temperature, top-k, logit masks and invalid ids applied), a token of
probability 0 is never drawn (even at the ends of u's range), and a seeded row draws the same
tokens alone or beside others."""

from __future__ import annotations

import math

import pytest
import torch

from kvchat.inference.model.sampler import _BLOCK, CHECKED_DRAWS, Sampler, _locate
from kvchat.inference.model.sampling_params import SamplingParams

# Vocabulary of two full blocks and a tail, so blocks, block edges and the tail all count.
VOCAB = 2 * _BLOCK + 300
ROWS = 20_000  # draws per check, as rows of one batch


def logits_with_mass_on(tokens: dict[int, float]) -> torch.Tensor:
    """[VOCAB] logits: the given tokens at the given logits, the rest at -2."""
    logits = torch.full((VOCAB,), -2.0)
    for t, v in tokens.items():
        logits[t] = v
    return logits


def draw(
    sampler: Sampler,
    logits: torch.Tensor,
    params: SamplingParams,
    mask: torch.Tensor | None = None,
    rows: int = ROWS,
) -> torch.Tensor:
    """Token counts [VOCAB] over `rows` draws of the shared generator."""
    batch = logits.expand(rows, -1).contiguous()
    out = sampler(
        batch,
        [params] * rows,
        [None] * rows,
        logit_mask=None if mask is None else mask.expand(rows, -1).contiguous(),
    )
    return torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB)


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """No draw of a token of probability 0; every token expected at least 20 times within 5
    standard deviations of its binomial expectation, and the rarer ones together too."""
    assert int(counts[probs == 0].sum()) == 0
    n = int(counts.sum())
    common = probs * n >= 20
    pairs = [(counts[t], probs[t]) for t in common.nonzero().flatten()]
    pairs.append((counts[~common].sum(), probs[~common].sum()))
    for count, p in pairs:
        sd = math.sqrt(n * p * (1 - p)) or 1e-9
        assert abs(float(count) - n * float(p)) < 5 * sd, (float(count), n * float(p))


# Mass on the first token, both sides of each block edge, inside blocks and the last token.
HEAVY = {0: 3.0, _BLOCK - 1: 2.0, _BLOCK: 2.5, 1500: 1.0, 2 * _BLOCK: 2.0, VOCAB - 1: 3.0}


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_draws_follow_the_softmax_at_each_temperature(temperature: float) -> None:
    logits = logits_with_mass_on(HEAVY)
    counts = draw(Sampler(seed=1), logits, SamplingParams(temperature=temperature))
    probs = (logits.double() / temperature).softmax(-1)
    assert_matches(counts.double(), probs)


def test_a_logit_mask_and_top_k_leave_only_their_tokens() -> None:
    logits = logits_with_mass_on(HEAVY)
    mask = torch.zeros(VOCAB)
    mask[[0, _BLOCK]] = float("-inf")  # two of the heaviest forbidden
    counts = draw(Sampler(seed=2), logits, SamplingParams(temperature=1.0), mask=mask)
    assert_matches(counts.double(), (logits.double() + mask.double()).softmax(-1))
    counts = draw(Sampler(seed=3), logits, SamplingParams(temperature=1.0, top_k=3))
    top3 = torch.full((VOCAB,), float("-inf"), dtype=torch.float64)
    top3[[0, _BLOCK, VOCAB - 1]] = logits[[0, _BLOCK, VOCAB - 1]].double()
    assert_matches(counts.double(), top3.softmax(-1))


def test_invalid_ids_are_never_drawn_even_when_they_would_dominate() -> None:
    invalid = torch.zeros(VOCAB, dtype=torch.bool)
    invalid[VOCAB - 50 :] = True
    logits = logits_with_mass_on({VOCAB - 1: 20.0, VOCAB - 30: 20.0, 7: 0.0})
    counts = draw(
        Sampler(seed=4, invalid_token_mask=invalid),
        logits,
        SamplingParams(temperature=1.0),
        rows=2_000,
    )
    assert int(counts[VOCAB - 50 :].sum()) == 0
    greedy = Sampler(invalid_token_mask=invalid)(
        logits.unsqueeze(0), [SamplingParams(temperature=0.0)], [None]
    )
    assert greedy.token_ids == [7]


def test_the_ends_of_u_land_on_tokens_of_positive_probability() -> None:
    # Rows whose allowed tokens sit in the middle: zero mass before and after them.
    cdf = torch.tensor([[0.0, 0.0, 0.25, 0.25, 1.0, 1.0, 1.0]], dtype=torch.float64)
    below_one = math.nextafter(1.0, 0.0)
    for u, token in [(0.0, 2), (0.2499, 2), (0.25, 4), (below_one, 4)]:
        index, frac = _locate(cdf, torch.tensor([[u]], dtype=torch.float64))
        assert int(index) == token and 0.0 <= float(frac) < 1.0
    # A total that u * total rounds up to: still strictly inside the last step.
    total = 3.0000000000000004
    cdf = torch.tensor([[1.0, total]], dtype=torch.float64)
    index, _ = _locate(cdf, torch.tensor([[below_one]], dtype=torch.float64))
    assert int(index) == 1


def test_one_allowed_token_in_the_tail_is_always_drawn() -> None:
    logits = torch.randn(VOCAB)
    mask = torch.full((VOCAB,), float("-inf"))
    mask[VOCAB - 3] = 0.0
    counts = draw(Sampler(seed=5), logits, SamplingParams(temperature=1.3), mask=mask, rows=500)
    assert int(counts[VOCAB - 3]) == 500


def test_a_seeded_row_draws_the_same_alone_and_batched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    seeded = SamplingParams(temperature=0.8, seed=11)
    others = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=1.2)]
    sampler = Sampler(seed=6)
    alone, batched = [], []
    g_alone, g_batched = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    for step in range(30):
        row = logits[step % 4]
        alone.append(sampler(row.unsqueeze(0), [seeded], [g_alone]).token_ids[0])
        batch = torch.stack(
            [logits[(step + 1) % 4], row, logits[(step + 2) % 4], logits[(step + 3) % 4]]
        )
        out = sampler(
            batch, [others[0], seeded, others[1], others[2]], [None, g_batched, None, None]
        )
        batched.append(out.token_ids[1])
    assert alone == batched
    assert len(set(alone)) > 10  # really random draws, not one token


def test_nan_logits_give_ids_in_range_not_an_indexing_error() -> None:
    # A broken checkpoint's NaNs must not take the engine thread down with an index error.
    out = Sampler(seed=7)(
        torch.full((3, VOCAB), float("nan")), [SamplingParams(temperature=1.0)] * 3, [None] * 3
    )
    assert all(0 <= t < VOCAB for t in out.token_ids)


class AllowedSets:
    """Each constrained row's grammar as a fixed set of allowed tokens (the sampler's
    RowGrammars), recording the rows whose masks the sampler asked for."""

    def __init__(
        self, allowed: list[set[int] | None], mask_first: frozenset[int] = frozenset()
    ) -> None:
        self.allowed = allowed
        self.rows = [i for i, a in enumerate(allowed) if a is not None]
        self.mask_first = mask_first
        self.masked: list[int] = []

    def allows(self, row: int, token: int) -> bool:
        allowed = self.allowed[row]
        assert allowed is not None
        return token in allowed

    def offsets(self, rows: list[int], num_rows: int | None = None) -> torch.Tensor:
        self.masked += rows
        out = torch.full((len(rows), VOCAB), float("-inf"))
        for j, row in enumerate(rows):
            out[j, sorted(self.allowed[row] or ())] = 0.0
        if num_rows is None:
            return out
        full = torch.zeros(num_rows, VOCAB)
        full[rows] = out
        return full


def mask_of(allowed: set[int]) -> torch.Tensor:
    mask = torch.full((VOCAB,), float("-inf"), dtype=torch.float64)
    mask[sorted(allowed)] = 0.0
    return mask


# Allowed sets holding most of the mass, about a fifth of it (some rows' 16 checked draws
# all miss) and about a thousandth (nearly every row falls back to its mask).
CHECKED_CASES = {
    "most": set(range(VOCAB)) - {0, _BLOCK},
    "a fifth": set(range(1, 600)),
    "a thousandth": {5, 1501, VOCAB - 2},
}


@pytest.mark.parametrize("case", list(CHECKED_CASES))
def test_checked_draws_follow_the_masked_softmax(case: str) -> None:
    allowed = CHECKED_CASES[case]
    logits = logits_with_mass_on(HEAVY)
    grammar = AllowedSets([allowed] * ROWS)
    out = Sampler(seed=8)(
        logits.expand(ROWS, -1).contiguous(),
        [SamplingParams(temperature=0.7)] * ROWS,
        [None] * ROWS,
        grammar=grammar,
    )
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB)
    assert_matches(counts.double(), (logits.double() / 0.7 + mask_of(allowed)).softmax(-1))
    # Masks were computed for exactly the rows reported as fallen back, and how many did
    # follows how much of the mass the grammar allows.
    assert sorted(grammar.masked) == sorted(out.fell_back)
    allowed_mass = float((logits.double() / 0.7).softmax(-1)[sorted(allowed)].sum())
    expected = ROWS * (1 - allowed_mass) ** CHECKED_DRAWS
    assert abs(len(out.fell_back) - expected) < 5 * math.sqrt(expected) + 1


def test_checked_greedy_rows_take_the_argmax_or_the_masked_argmax() -> None:
    logits = logits_with_mass_on(HEAVY)  # argmax 0 (VOCAB - 1 ties it, later)
    grammar = AllowedSets([None, {0, 1500}, {1500, 7}])
    out = Sampler()(
        logits.expand(3, -1).contiguous(),
        [SamplingParams(temperature=0.0)] * 3,
        [None] * 3,
        grammar=grammar,
    )
    assert out.token_ids == [0, 0, 1500]
    assert out.fell_back == (2,) and grammar.masked == [2]


def test_top_k_logprobs_and_chosen_rows_get_their_mask_first() -> None:
    logits = logits_with_mass_on(HEAVY)
    allowed = {0, _BLOCK - 1, 1500, 9}
    grammar = AllowedSets([allowed, allowed, None, {7}], mask_first=frozenset({3}))
    params = [
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(logprobs=True, seed=3),
        SamplingParams(temperature=1.0, logprobs=True),
        SamplingParams(seed=4),
    ]
    generators = [None, torch.Generator().manual_seed(3), None, torch.Generator().manual_seed(4)]
    batch = logits.expand(4, -1).contiguous()
    sampler = Sampler(seed=9)
    seen: set[int] = set()
    for _ in range(40):
        grammar.masked = []
        out = sampler(batch, params, generators, grammar=grammar)
        assert grammar.masked == [0, 1, 3] and out.fell_back == ()
        assert out.token_ids[3] == 7
        seen.add(out.token_ids[0])
        assert out.logprobs is not None
        masked = (logits.double() + mask_of(allowed)).log_softmax(-1)
        assert out.logprobs[1] == pytest.approx(float(masked[out.token_ids[1]]), abs=1e-5)
    assert seen == {0, _BLOCK - 1}  # the allowed tokens' top 2, both drawn
    # A row masked first draws one uniform a step (a checked row: CHECKED_DRAWS + 1).
    g = torch.Generator().manual_seed(4)
    torch.rand(40, dtype=torch.float64, generator=g)
    assert torch.equal(generators[3].get_state(), g.get_state())


def test_a_checked_row_draws_its_uniforms_whether_or_not_it_falls_back() -> None:
    logits = logits_with_mass_on(HEAVY).unsqueeze(0)
    for allowed in (set(range(VOCAB)) - {3}, {5}):  # the checks pass / all fail
        g = torch.Generator().manual_seed(5)
        out = Sampler()(logits, [SamplingParams(seed=5)], [g], grammar=AllowedSets([allowed]))
        assert out.token_ids[0] in allowed and len(out.fell_back) == (allowed == {5})
        expected = torch.Generator().manual_seed(5)
        torch.rand(CHECKED_DRAWS + 1, dtype=torch.float64, generator=expected)
        assert torch.equal(g.get_state(), expected.get_state())
