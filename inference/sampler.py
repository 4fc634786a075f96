"""Sampler: greedy, temperature, top-k, top-p, per-request seeds; logprobs of chosen tokens.

Random choice is by inversion: one uniform draw per row and step, located in the row's
cumulative distribution (summed in float64, so every token keeps its own probability to
~1e-16). A seeded request consumes exactly one draw of its own generator per step, whatever
else is in the batch, so it reproduces alone or batched. (An exponential race, argmax of
p / E over a noise vector, does the same on an accelerator, but drawing a vocabulary's worth
of noise per row costs the CPU ~1.7 ms a row; the inversion costs ~0.1.)

Constrained rows (structured output) come with an additive logit mask, 0 for the tokens
their grammar allows and -inf for the rest (unconstrained rows: 0 everywhere); it applies
before anything else, so a constrained request's temperature, top-k/p and logprobs are over
the allowed tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # log p(chosen) under the model (temperature, top-k/p not applied)
    # Per row: the `top_logprobs` most likely (id, logprob) pairs, most likely first; None for
    # rows that asked for none (and None overall when no row asked).
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


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
    ) -> SamplerOutput:
        vocab = logits.shape[1]
        # Out of place: the logits may be an inference-mode tensor.
        if logit_mask is not None:  # one pass; rows without a constraint are all 0
            logits = logits + logit_mask
        elif self._invalid_ids is not None:
            logits = logits.clone()
        if self._invalid_ids is not None:
            logits.index_fill_(1, self._invalid_ids, float("-inf"))
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(random_rows) < len(params):
            # max(dim).indices: the same first-maximum index as argmax, ~3x faster on the CPU.
            chosen = logits.max(dim=-1).indices
        if random_rows:
            everyone = len(random_rows) == len(params)
            rows = torch.tensor(random_rows, device=logits.device)
            scaled = logits if everyone else logits[rows]
            if any(params[i].temperature != 1.0 for i in random_rows):
                temps = torch.tensor([params[i].temperature for i in random_rows],
                                     device=logits.device, dtype=logits.dtype)
                scaled = scaled / temps.unsqueeze(1)
            if any(params[i].needs_filtering for i in random_rows):
                top_k = torch.tensor(
                    [min(params[i].top_k or vocab, vocab) for i in random_rows],
                    device=logits.device,
                )
                top_p = torch.tensor(
                    [params[i].top_p for i in random_rows], device=logits.device
                )
                scaled = _filter_top_k_top_p(scaled, top_k, top_p)
            picked = self._invert(scaled, [generators[i] for i in random_rows])
            if everyone:
                chosen = picked
            else:
                chosen[rows] = picked
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
                    [(t, v) for t, v in zip(ids[i, : p.top_logprobs].tolist(),
                                            values[i, : p.top_logprobs].tolist())
                     if v != float("-inf")]
                    if p.top_logprobs else None
                    for i, p in enumerate(params)
                ]
        return SamplerOutput(chosen.tolist(), logprobs, top)

    def _invert(
        self, scaled: torch.Tensor, generators: Sequence[torch.Generator | None]
    ) -> torch.Tensor:
        """[N] a token per row of `scaled` ([N, V] logits, temperature applied), drawn from
        softmax(scaled) by inversion: u ~ U[0, 1) from the row's generator (or the sampler's
        own) picks a block of the vocabulary by the blocks' summed probabilities, then the
        rest of u picks a token inside the block by its cumulative probabilities in float64.
        A token of probability 0 is never chosen (its cumulative value equals its
        predecessor's), and a token's chance is its probability to float32 precision (a
        float32 running sum over the whole vocabulary would round away tokens below ~1e-8)."""
        # Draws on the CPU (per-request generators live there), one per row.
        shared = iter(torch.rand(sum(g is None for g in generators), dtype=torch.float64,
                                 generator=self._generator).tolist())
        u = torch.tensor([
            next(shared) if g is None else float(torch.rand(1, dtype=torch.float64, generator=g))
            for g in generators
        ], dtype=torch.float64, device=scaled.device).unsqueeze(1)
        probs = scaled.softmax(dim=-1)
        rows, vocab = probs.shape
        full = vocab // _BLOCK * _BLOCK
        sums = probs[:, :full].view(rows, -1, _BLOCK).sum(dim=-1)
        if full < vocab:
            sums = torch.cat([sums, probs[:, full:].sum(dim=-1, keepdim=True)], dim=1)
        block, frac = _locate(sums.double().cumsum(dim=-1), u)
        ids = block * _BLOCK + torch.arange(_BLOCK, device=probs.device)  # [N, _BLOCK]
        inside = probs.gather(1, ids.clamp(max=vocab - 1)).double()
        inside.masked_fill_(ids >= vocab, 0.0)
        offset, _ = _locate(inside.cumsum(dim=-1), frac)
        return ids.gather(1, offset).squeeze(1).clamp_(max=vocab - 1)


_BLOCK = 1024  # vocabulary block of the two-level inversion


def _locate(cdf: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cdf [N, K] float64 running sums (non-decreasing, last > 0), u [N, 1] in [0, 1): the
    index i [N, 1] with cdf[i - 1] <= u * total < cdf[i], and where u * total falls inside
    that step as a fraction in [0, 1)."""
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
