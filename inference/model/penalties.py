"""Penalties and logit bias: the logits a request's sampling starts from, with vLLM's
semantics, for a whole batch at once (tensor ops over each row that asks; none per token).

In the order vLLM's sampler applies them, before temperature, min-p, top-k and top-p (and
before a greedy row's argmax):
1. logit_bias: each (token id, bias) pair is added to the token's logit (OpenAI's -100..100).
2. repetition_penalty r over every token of the prompt and the output so far: a positive
   logit is divided by r, a negative one multiplied by it (r > 1 discourages repeats).
3. frequency_penalty f and presence_penalty p over the output so far: a token generated
   c times loses f * c + p * (c > 0) from its logit.
Rows that ask for none of them are copied unchanged (and cost nothing when no row asks).

A step reads each row's PenaltyState (inference/model/penalty_state.py: the repetition
penalty and the frequency and presence offsets as vectors over the vocabulary, kept up to date
one token a step), so its cost is a few elementwise passes over the penalized rows' logits,
whatever the length of their histories and however many distinct ids those hold.
`apply_penalties_reference` is the computation it replaced, over each row's whole history every
step: the reference the tests and bench/sampling.py compare against. The two agree exactly
except where a token was generated: the reference subtracts p once and f once per occurrence,
the state f * c + p at once, so they may differ by float rounding (a few ulps)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from .penalty_state import PenaltyState
from .sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor,  # [N, V] float32; not modified
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],  # per row: the prompt's tokens then the output's
    num_prompt_tokens: Sequence[int],
) -> torch.Tensor:
    """The penalized logits (the same tensor when no row asks for a penalty), from each row's
    whole history: for callers that keep no PenaltyState (the engine keeps one per sequence
    and calls apply_penalty_states)."""
    if not any(p.has_penalties for p in params):
        return logits
    vocab, device = logits.shape[1], logits.device
    states = [
        PenaltyState.of(p, ids, n, vocab, device) if p.has_penalties else None
        for p, ids, n in zip(params, token_ids, num_prompt_tokens, strict=True)
    ]
    return apply_penalty_states(logits, states)


def apply_penalty_states(
    logits: torch.Tensor,  # [N, V] float32; not modified
    states: Sequence[PenaltyState | None],  # per row; None where the row asks for no penalty
) -> torch.Tensor:
    """The penalized logits (the same tensor when no row has a state), written row by row into
    a new tensor: a row without a state is copied; a penalized row is computed from its logits
    and its state's [V] vectors in at most five elementwise passes (bias: a copy and the biased
    ids; repetition: a division, a multiplication and a minimum or maximum; frequency and
    presence: an addition). Row by row, not batched: a row's operands (a few x 4V bytes) stay
    in the CPU's caches from one pass to the next, where [N, V] ones would not, and stacking
    the states' vectors would be two more passes (16 rows of 49,152 on one thread: ~0.85 ms row
    by row, ~1.1 ms over stacked vectors). On an accelerator that is a few kernel launches a
    row. Nothing reads a history or loops over ids: a step costs the same whatever the
    histories hold."""
    if all(s is None for s in states):
        return logits
    assert len(states) == len(logits)
    assert logits.dtype == torch.float32, "the sampler's logits are float32"
    vocab = logits.shape[1]
    for s in states:
        assert s is None or (s.vocab_size == vocab and s.device == logits.device), (
            "states built for another vocabulary or device"
        )
    out = torch.empty_like(logits)
    scratch = None  # [V] the division's result, reused row to row
    for x, o, s in zip(logits, out, states):
        if s is None:
            o.copy_(x)
            continue
        if s.has_bias:
            o.copy_(x)
            o.index_add_(0, s.bias_ids, s.bias_values)
            x = o
        if s.repetition is not None:
            # Positive logits divided by r, negative ones multiplied, exactly as the reference
            # computes them (torch.where of the two would cost a pass more): for r >= 1,
            # v / r <= v <= v * r holds after rounding too, so the smaller of the two is what
            # the sign picks (for r < 1 the larger); where the vector holds 1 both are v.
            if scratch is None:
                scratch = torch.empty_like(x)
            torch.div(x, s.repetition, out=scratch)
            torch.mul(x, s.repetition, out=o)
            pick = torch.minimum if s.repetition_penalty >= 1.0 else torch.maximum
            pick(o, scratch, out=o)
            x = o
        if s.offsets is not None:
            torch.add(x, s.offsets, out=o)  # 0 where the id was not generated
            x = o
        assert x is o, "a state with nothing to apply"
    return out


def apply_penalties_reference(
    logits: torch.Tensor,  # [N, V] float32; not modified
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],  # per row: the prompt's tokens then the output's
    num_prompt_tokens: Sequence[int],
) -> torch.Tensor:
    """apply_penalties as it was computed before PenaltyState, kept as the reference: every
    step it lays each row's whole history (prompt and output) end to end as flat indices into
    the [N * V] logits, so its cost grows with the histories' length."""
    if not any(p.has_penalties for p in params):
        return logits
    logits = logits.clone()
    flat = logits.view(-1)
    device, dtype, vocab = logits.device, logits.dtype, logits.shape[1]
    bias = [(i * vocab + t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if bias:
        at = torch.tensor([i for i, _ in bias], device=device)
        flat.index_add_(0, at, torch.tensor([b for _, b in bias], device=device, dtype=dtype))
    # A token seen several times is written several times with the same value (each write is
    # computed from the logits read before any): once-per-token changes need no unique().
    repeated = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeated:
        at = _flat_ids([token_ids[i] for i in repeated], repeated, vocab, device)
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
        penalty = penalty.to(dtype)[at // vocab]
        values = flat[at]
        # positive logits divided by the penalty, negative ones multiplied
        flat[at] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if counted:
        output = [token_ids[i][num_prompt_tokens[i] :] for i in counted]
        at = _flat_ids(output, counted, vocab, device)
        row = at // vocab
        presence = torch.tensor([p.presence_penalty for p in params], device=device)
        flat[at] = flat[at] - presence.to(dtype)[row]  # once per token
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
        flat.index_add_(0, at, frequency.to(dtype)[row].neg_())  # once per occurrence
    return logits


def _flat_ids(
    token_ids: Sequence[Sequence[int]], rows: Sequence[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """The rows' token ids as indices into the flattened [N * V] logits (row * V + id), laid
    end to end; ids outside the vocabulary are clamped into it."""
    lengths = torch.tensor([len(x) for x in token_ids], dtype=torch.int64)
    count = int(lengths.sum())
    # numpy reads the ints ~4x faster than torch.tensor of a list
    ids = torch.from_numpy(np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=count))
    base = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.int64) * vocab, lengths)
    return (base + ids.clamp_(0, vocab - 1)).to(device)
