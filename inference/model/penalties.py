"""Penalties and logit bias: the logits a request's sampling starts from, with vLLM's
semantics, for a whole batch at once (tensor ops over the rows that ask; none per token).

In the order vLLM's sampler applies them, before temperature, min-p, top-k and top-p (and
before a greedy row's argmax):
1. logit_bias: each (token id, bias) pair is added to the token's logit (OpenAI's -100..100).
2. repetition_penalty r over every token of the prompt and the output so far: a positive
   logit is divided by r, a negative one multiplied by it (r > 1 discourages repeats).
3. frequency_penalty f and presence_penalty p over the output so far: a token generated
   c times loses f * c + p * (c > 0) from its logit.
Rows that ask for none of them are not touched (and cost nothing when no row asks)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from .sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor,  # [N, V] float32; not modified
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],  # per row: the prompt's tokens then the output's
    num_prompt_tokens: Sequence[int],
) -> torch.Tensor:
    """The penalized logits (the same tensor when no row asks for a penalty). Only the
    logits of the tokens a row has seen (or biases) are read and written, through the rows'
    tokens laid end to end as flat indices into the [N * V] logits: no pass over the
    vocabulary."""
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
