"""Sampler: penalties and logit bias, greedy, temperature, min-p, top-k, top-p, per-request
seeds; logprobs of chosen tokens.

Random choice is by inversion: one uniform draw per row and step, located in the row's
cumulative distribution (summed in float64, so every token keeps its own probability to
~1e-16). A seeded request consumes exactly one draw of its own generator per step, whatever
else is in the batch, so it reproduces alone or batched. (An exponential race, argmax of
p / E over a noise vector, does the same on an accelerator, but drawing a vocabulary's worth
of noise per row costs the CPU ~1.7 ms a row; the inversion costs ~0.1.)

Constrained rows (structured output) sample from their grammar's allowed tokens only, so a
constrained request's temperature, top-k/p and logprobs are over the allowed tokens. A
grammar's mask over the whole vocabulary can cost far more than a token check (llguidance:
~0.1-1 ms a row for a 100k vocabulary where the lexer state changes, ~3-5 us to check one
token), so a row is checked first where it can be, as llama.cpp's sampler does: its draws
from the unconstrained distribution are checked in order against the grammar, the first
allowed one is taken, and only when all CHECKED_DRAWS are rejected is the mask computed and a
draw made from the allowed tokens. Taking the first allowed of independent draws is a draw
from the distribution restricted to the allowed tokens, and so is the fallback: the result
has exactly the masked distribution (greedy: the argmax if allowed, else the masked argmax).
A checked row consumes CHECKED_DRAWS + 1 uniforms; a row masked first (top-k/p or logprobs
asked for, or the caller's choice: RowGrammars.mask_first) consumes one. Which of the two a
row is must depend on nothing but the request itself (the engine decides by the row's own
past checks), so a seeded request reproduces alone or batched."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .penalties import apply_penalties, apply_penalty_states
from .penalty_state import PenaltyState
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # log p(chosen) under the model (temperature, top-k/p not applied)
    # Per row: the `top_logprobs` most likely (id, logprob) pairs, most likely first; None for
    # rows that asked for none (and None overall when no row asked).
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # Checked constrained rows whose draws were all rejected: they were sampled from the mask.
    fell_back: tuple[int, ...] = ()


CHECKED_DRAWS = 16  # draws a checked constrained row tries before its mask is computed


def masks_first(params: SamplingParams) -> bool:
    """Whether a constrained row with these parameters needs its mask before sampling (top-k/p
    and logprobs are over the allowed tokens); other constrained rows are checked first."""
    return params.needs_filtering or params.logprobs


class RowGrammars(Protocol):
    """The constrained rows of a batch, as the sampler asks about them."""

    @property
    def rows(self) -> Sequence[int]:
        """The constrained rows, indices into the logits, in increasing order."""
        ...

    @property
    def mask_first(self) -> Collection[int]:
        """Rows to mask before sampling even where their parameters would allow checks (their
        draws would mostly be rejected)."""
        ...

    def allows(self, row: int, token: int) -> bool:
        """Whether the row's grammar allows `token` next (exactly the mask's bit)."""
        ...

    def offsets(self, rows: list[int], num_rows: int | None = None) -> torch.Tensor:
        """[len(rows), V] float32 on the logits' device: 0 for the tokens each row's grammar
        allows next, -inf for the rest. With `num_rows`: [num_rows, V], the given rows'
        offsets at their indices and 0 in every other row."""
        ...


def _filter_top_k_top_p(
    logits: torch.Tensor,  # [N, V] already divided by temperature
    top_k: torch.Tensor,  # [N] int64, V where disabled
    top_p: torch.Tensor,  # [N] float, 1.0 where disabled
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """invalid_token_mask: [V] bool, True for ids that must never be chosen (output rows that
    are no token of the tokenizer); they get probability 0, logprobs included."""

    def __init__(
        self, seed: int | None = None, invalid_token_mask: torch.Tensor | None = None
    ) -> None:
        self._generator = torch.Generator()
        if seed is not None:
            self._generator.manual_seed(seed)
        # The few invalid ids, filled column-wise (a boolean mask over the whole vocab is
        # a full pass per step).
        self._invalid_ids = (
            None if invalid_token_mask is None else invalid_token_mask.nonzero().flatten()
        )

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V] float32
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        logit_mask: torch.Tensor | None = None,  # [N, V] float32: 0 allowed, -inf not
        grammar: RowGrammars | None = None,
        token_ids: Sequence[Sequence[int]] | None = None,
        num_prompt_tokens: Sequence[int] | None = None,
        penalties: Sequence[PenaltyState | None] | None = None,
    ) -> SamplerOutput:
        """`logit_mask` restricts rows up front; `grammar`'s rows are checked first where
        their parameters allow (see the module docstring), masked first otherwise. Rows with
        penalties or logit_bias need `penalties` (each row's PenaltyState, up to date with its
        tokens; None for rows without), or else `token_ids` (each row's prompt and output so
        far) and `num_prompt_tokens`, read whole: their logits are changed first
        (inference/model/penalties.py), and everything after, logprobs included, sees the
        changed logits."""
        vocab = logits.shape[1]
        checked: list[int] = []
        first: list[int] = []
        if grammar is not None:
            for r in grammar.rows:
                (first if masks_first(params[r]) or r in grammar.mask_first else checked).append(r)
        # Out of place: the logits may be an inference-mode tensor.
        copied = False
        if logit_mask is not None:  # one pass; rows without a constraint are all 0
            logits, copied = logits + logit_mask, True
        if first:
            assert grammar is not None
            # One pass over every row (index_add over some rows is several times slower).
            logits, copied = logits + grammar.offsets(first, len(logits)), True
        if self._invalid_ids is not None:
            if not copied:
                logits = logits.clone()
            logits.index_fill_(1, self._invalid_ids, float("-inf"))
        if penalties is not None:
            assert [s is not None for s in penalties] == [p.has_penalties for p in params]
            logits = apply_penalty_states(logits, penalties)
        elif any(p.has_penalties for p in params):
            if token_ids is None or num_prompt_tokens is None:
                raise ValueError(
                    "penalties need each row's penalty state, or its token ids and prompt length"
                )
            logits = apply_penalties(logits, params, token_ids, num_prompt_tokens)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(random_rows) < len(params):
            # max(dim).indices: the same first-maximum index as argmax, ~3x faster on the CPU.
            chosen = logits.max(dim=-1).indices
        scaled, drawn = logits, None
        u = torch.empty(0, 1, dtype=torch.float64)
        if random_rows:
            everyone = len(random_rows) == len(params)
            rows = torch.tensor(random_rows, device=logits.device)
            scaled = logits if everyone else logits[rows]
            if any(params[i].temperature != 1.0 for i in random_rows):
                temps = torch.tensor(
                    [params[i].temperature for i in random_rows],
                    device=logits.device,
                    dtype=logits.dtype,
                )
                scaled = scaled / temps.unsqueeze(1)
            if any(params[i].min_p > 0.0 for i in random_rows):
                # p / p_max >= min_p, in logits: scaled >= max + log(min_p) (log 0 = -inf)
                min_p = torch.tensor(
                    [params[i].min_p for i in random_rows], device=logits.device
                ).to(scaled.dtype)
                floor = scaled.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
                scaled = scaled.masked_fill(scaled < floor, float("-inf"))
            if any(params[i].top_k or params[i].top_p < 1.0 for i in random_rows):
                top_k = torch.tensor(
                    [min(params[i].top_k or vocab, vocab) for i in random_rows],
                    device=logits.device,
                )
                top_p = torch.tensor([params[i].top_p for i in random_rows], device=logits.device)
                scaled = _filter_top_k_top_p(scaled, top_k, top_p)
            is_checked = set(checked)
            u = self._uniforms(
                [generators[i] for i in random_rows],
                [CHECKED_DRAWS + 1 if i in is_checked else 1 for i in random_rows],
            ).to(logits.device)
            drawn = _Inversion.of(scaled.softmax(dim=-1))
            picked = drawn.draw(u[:, :1]).squeeze(1)
            if everyone:
                chosen = picked
            else:
                chosen[rows] = picked
        token_ids = chosen.tolist()
        fell_back: list[int] = []
        if checked:
            assert grammar is not None
            fell_back = self._check(
                logits, scaled, drawn, u, random_rows, checked, grammar, token_ids
            )
            if fell_back:
                chosen = torch.tensor(token_ids, device=logits.device)
        logprobs = None
        top: list[list[tuple[int, float]] | None] | None = None
        if any(p.logprobs for p in params):
            log_probs = logits.log_softmax(dim=-1)
            logprobs = log_probs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
            k = max(p.top_logprobs for p in params)
            if k:
                values, ids = log_probs.topk(k, dim=-1)
                # Tokens that cannot be chosen (a grammar allows fewer than k) are left out.
                top = [
                    [
                        (t, v)
                        for t, v in zip(
                            ids[i, : p.top_logprobs].tolist(), values[i, : p.top_logprobs].tolist()
                        )
                        if v != float("-inf")
                    ]
                    if p.top_logprobs
                    else None
                    for i, p in enumerate(params)
                ]
        return SamplerOutput(token_ids, logprobs, top, tuple(fell_back))

    def _check(
        self,
        logits: torch.Tensor,  # [N, V], invalid ids at -inf
        scaled: torch.Tensor,  # [R, V] the random rows' logits, temperature applied
        drawn: _Inversion | None,  # their distributions
        u: torch.Tensor,  # [R, CHECKED_DRAWS + 1] their uniforms (checked rows)
        random_rows: list[int],
        checked: list[int],
        grammar: RowGrammars,
        token_ids: list[int],  # the first draw of every row; replaced where rejected
    ) -> list[int]:
        """The checked rows' tokens: the first draw their grammar allows, else a draw from
        the mask. Returns the rows that fell back to the mask."""
        rejected = [r for r in checked if not grammar.allows(r, token_ids[r])]
        if not rejected:
            return []
        position = {r: j for j, r in enumerate(random_rows)}
        retry = [r for r in rejected if r in position]  # greedy rows have one draw only
        accepted: set[int] = set()
        if retry and CHECKED_DRAWS > 1:
            assert drawn is not None
            at = torch.tensor([position[r] for r in retry], device=logits.device)
            more = drawn.draw(u[at, 1:CHECKED_DRAWS], at).tolist()
            for r, draws in zip(retry, more):
                token = next((t for t in draws if grammar.allows(r, t)), None)
                if token is not None:
                    token_ids[r] = token
                    accepted.add(r)
        fell_back = [r for r in rejected if r not in accepted]
        if not fell_back:
            return []
        offsets = grammar.offsets(fell_back)
        greedy = [j for j, r in enumerate(fell_back) if r not in position]
        if greedy:
            rows = torch.tensor([fell_back[j] for j in greedy], device=logits.device)
            masked = logits[rows] + offsets[torch.tensor(greedy, device=logits.device)]
            for j, t in zip(greedy, masked.max(dim=-1).indices.tolist()):
                token_ids[fell_back[j]] = t
        sampled = [j for j, r in enumerate(fell_back) if r in position]
        if sampled:
            assert drawn is not None
            at = torch.tensor([position[fell_back[j]] for j in sampled], device=logits.device)
            allowed = offsets[torch.tensor(sampled, device=logits.device)] == 0
            picks = (
                drawn.rows(at).restricted(allowed, lambda: scaled[at]).draw(u[at, CHECKED_DRAWS:])
            )
            for j, t in zip(sampled, picks.squeeze(1).tolist()):
                token_ids[fell_back[j]] = t
        return fell_back

    def _uniforms(
        self, generators: Sequence[torch.Generator | None], counts: Sequence[int]
    ) -> torch.Tensor:
        """[N, max(counts)] float64 uniforms on the CPU (where per-request generators live):
        row i's first counts[i] come from its generator (or the sampler's own), the rest are
        unused padding."""
        shared = iter(
            torch.rand(
                sum(c for g, c in zip(generators, counts) if g is None),
                dtype=torch.float64,
                generator=self._generator,
            ).tolist()
        )
        width = max(counts)
        rows = []
        for g, c in zip(generators, counts):
            row = (
                [next(shared) for _ in range(c)]
                if g is None
                else torch.rand(c, dtype=torch.float64, generator=g).tolist()
            )
            rows.append(row + [0.5] * (width - c))
        return torch.tensor(rows, dtype=torch.float64)


class _Inversion:
    """Rows of token weights (probabilities, or the allowed tokens' probabilities: the
    weights need not sum to 1) with the running sums of their vocabulary blocks, to draw
    tokens from by inversion: u ~ U[0, 1) picks a block by the blocks' summed weights, then
    the rest of u picks a token inside the block by its running weights in float64. A token
    of weight 0 is never chosen (its running sum equals its predecessor's), and a token's
    chance is its weight's share to float32 precision (a float32 running sum over the whole
    vocabulary would round away tokens below ~1e-8)."""

    def __init__(self, weights: torch.Tensor, blocks: torch.Tensor) -> None:
        self.weights = weights  # [N, V] float32
        self.blocks = blocks  # [N, ceil(V / _BLOCK)] float64 running sums of block weights

    @classmethod
    def of(cls, weights: torch.Tensor) -> _Inversion:
        rows, vocab = weights.shape
        full = vocab // _BLOCK * _BLOCK
        sums = weights[:, :full].view(rows, -1, _BLOCK).sum(dim=-1)
        if full < vocab:
            sums = torch.cat([sums, weights[:, full:].sum(dim=-1, keepdim=True)], dim=1)
        return cls(weights, sums.double().cumsum(dim=-1))

    def rows(self, at: torch.Tensor) -> _Inversion:
        return _Inversion(self.weights[at], self.blocks[at])

    def restricted(self, allowed: torch.Tensor, logits: Callable[[], torch.Tensor]) -> _Inversion:
        """The same rows with only the `allowed` ([N, V] bool) tokens' weights left. Where a
        row's allowed tokens' probabilities all but vanish in float32 (logits ~70 and more
        below the row's top, temperature applied), its weights are the softmax of its
        `logits()` ([N, V], whence the weights came) over the allowed tokens instead."""
        kept = _Inversion.of(torch.where(allowed, self.weights, 0.0))
        faint = (kept.blocks[:, -1] < _FAINT).nonzero().flatten()
        if len(faint):
            masked = logits()[faint].masked_fill(~allowed[faint], float("-inf"))
            again = _Inversion.of(masked.softmax(dim=-1))
            kept.weights[faint], kept.blocks[faint] = again.weights, again.blocks
        return kept

    def draw(self, u: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
        """[N, k] tokens, one per uniform of u ([N, k] float64 in [0, 1)), for the rows `at`
        (default: all); only the blocks drawn into are read."""
        vocab = self.weights.shape[1]
        rows, k = u.shape
        blocks = self.blocks if at is None else self.blocks[at]
        block, frac = _locate(blocks, u.to(blocks.device))  # [N, k] each
        ids = (
            block.unsqueeze(-1) * _BLOCK + torch.arange(_BLOCK, device=self.weights.device)
        ).view(rows, -1)
        inside = (
            self.weights.gather(1, ids.clamp(max=vocab - 1))
            if at is None
            else self.weights[at.unsqueeze(1), ids.clamp(max=vocab - 1)]
        ).double()
        inside.masked_fill_(ids >= vocab, 0.0)
        offset, _ = _locate(inside.view(rows * k, _BLOCK).cumsum(dim=-1), frac.reshape(rows * k, 1))
        return ids.view(rows * k, _BLOCK).gather(1, offset).view(rows, k).clamp_(max=vocab - 1)


_FAINT = 1e-30  # allowed probability below which a restricted row is renormalized in logits


_BLOCK = 1024  # vocabulary block of the two-level inversion


def _locate(cdf: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cdf [N, K] float64 running sums (non-decreasing, last > 0), u [N, k] in [0, 1): for
    each u, the index i ([N, k]) with cdf[i - 1] <= u * total < cdf[i], and where u * total
    falls inside that step as a fraction in [0, 1)."""
    total = cdf[:, -1:]
    # Strictly below the total, so the search always lands on a step (u * total may round
    # up to the total).
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # The clamp changes nothing for finite inputs (target < total); NaN logits (a broken
    # checkpoint) then still give an index in range rather than an indexing error.
    index = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    low = torch.where(index > 0, cdf.gather(1, (index - 1).clamp(min=0)), 0.0)
    high = cdf.gather(1, index)
    frac = ((target - low) / (high - low)).clamp(0.0, 1.0)
    return index, frac
