"""PenaltyState: one sequence's penalties as vectors over the vocabulary, kept across steps and
updated in O(1) per new token, so that a step's penalty work is a few elementwise passes over
the penalized rows' logits (inference/model/penalties.py applies it): O(rows x vocab), the order
of the sampler's own softmax, and the same at every history length and however many distinct
ids a history holds.

It holds, each [vocab_size] float32 on the logits' device:
- repetition: the repetition penalty r at every id of the prompt and the output so far, 1 at the
  others (None where r = 1);
- offsets: -(frequency * c + presence) at every id generated c > 0 times, 0 at the others: what
  frequency and presence add to the logit (None where both are 0);
and the logit_bias pairs as two small tensors. The bias is added before the repetition penalty
(whose choice of dividing or multiplying reads the biased logit's sign), so it cannot be folded
into the offsets; it stays sparse, at most MAX_LOGIT_BIAS ids. Memory: vocab_size * 4 bytes a
vector, one or two a sequence (192 KiB each for a 49,152-token vocabulary, 0.5 MiB for 128k),
plus the counts of the ids generated; rows without penalties keep no state.

It is built when a sequence with penalties first samples, from its prompt and any output so far
(the whole history once: O(history), a new turn's prompt included), and then takes in the one
token each step appends: a count and a vector element or two written. On the CPU the vectors
are written through numpy views of their memory (a scalar write through torch costs ~50x as
much); on another device through torch. Ids outside [0, vocab_size) are clamped into it, as the
whole-history reference clamps them.

Which tokens it has taken in is a count of the sequence's `token_ids` (which only ever grow:
a preemption recomputes KV, never tokens), so `update` takes in exactly the tokens appended
since the last call: calling it twice changes nothing, and a step it missed is taken in by the
next call."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .sampling_params import SamplingParams


def writes_on_host(device: torch.device) -> bool:
    """Whether a state on `device` writes its vectors through numpy views of their memory (the
    CPU) rather than through torch (any other device)."""
    return device.type == "cpu"


class _Vector:
    """A [size] float32 tensor on `device` and, on the CPU, a numpy view of its memory to write
    single elements through."""

    def __init__(self, size: int, fill: float, device: torch.device) -> None:
        self.host: np.ndarray | None = None
        if writes_on_host(device):
            self.host = np.full(size, fill, dtype=np.float32)
            self.tensor = torch.from_numpy(self.host)
        else:
            self.tensor = torch.full((size,), fill, dtype=torch.float32, device=device)

    def set_one(self, index: int, value: float) -> None:
        if self.host is not None:
            self.host[index] = value
        else:
            self.tensor[index] = value

    def set_many(self, indices: np.ndarray, values: np.ndarray | float) -> None:
        """`indices` [K] int64, distinct where `values` is an array ([K])."""
        if self.host is not None:
            self.host[indices] = values
            return
        at = torch.from_numpy(indices).to(self.tensor.device)
        if isinstance(values, np.ndarray):
            self.tensor[at] = torch.from_numpy(values).to(self.tensor.device, torch.float32)
        else:
            self.tensor[at] = values


class PenaltyState:
    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        num_prompt_tokens: int,
        device: torch.device | str = "cpu",
    ) -> None:
        assert params.has_penalties, "a sequence without penalties keeps no state"
        self.vocab_size = vocab_size
        self.num_prompt_tokens = num_prompt_tokens
        self.repetition_penalty = params.repetition_penalty
        self.frequency_penalty = params.frequency_penalty
        self.presence_penalty = params.presence_penalty
        self.is_repeated = params.repetition_penalty != 1.0  # every token seen, prompt included
        self.is_counted = bool(params.frequency_penalty or params.presence_penalty)
        bias_ids = [t for t, _ in params.logit_bias]
        assert all(0 <= t < vocab_size for t in bias_ids), "checked on the way in"
        self.bias_ids = torch.tensor(bias_ids, dtype=torch.int64, device=device)  # [B]
        self.bias_values = torch.tensor(  # [B]
            [b for _, b in params.logit_bias], dtype=torch.float32, device=device
        )
        self.device = self.bias_ids.device  # "cuda" as the tensors have it: "cuda:0"
        self.num_tokens = 0  # how many of the sequence's token ids were taken in
        # The ids generated and how many times each (the frequency penalty's c); kept only
        # where frequency or presence is on.
        self.counts: dict[int, int] = {}
        self._repetition = _Vector(vocab_size, 1.0, self.device) if self.is_repeated else None
        self._offsets = _Vector(vocab_size, 0.0, self.device) if self.is_counted else None
        self._last_token: int | None = None

    @classmethod
    def of(
        cls,
        params: SamplingParams,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> PenaltyState:
        """The state after `token_ids` (the prompt's tokens, then the output's)."""
        state = cls(params, vocab_size, num_prompt_tokens, device)
        state.update(token_ids)
        return state

    @property
    def repetition(self) -> torch.Tensor | None:
        """[V] float32: r at the ids seen, 1 elsewhere; None where r = 1."""
        return None if self._repetition is None else self._repetition.tensor

    @property
    def offsets(self) -> torch.Tensor | None:
        """[V] float32: -(frequency * c + presence) at the ids generated c > 0 times, 0
        elsewhere; None where frequency and presence are both 0."""
        return None if self._offsets is None else self._offsets.tensor

    @property
    def has_bias(self) -> bool:
        return len(self.bias_ids) > 0

    def update(self, token_ids: Sequence[int]) -> None:
        """Take in the tokens of `token_ids` (the sequence's prompt then output, which only
        grow) that were not taken in yet: all of them the first time, then the one a step
        appends."""
        num_new = len(token_ids) - self.num_tokens
        assert num_new >= 0, "a sequence's token ids never shrink"
        assert self.num_tokens == 0 or token_ids[self.num_tokens - 1] == self._last_token, (
            "a sequence's token ids are only appended to"
        )
        if num_new == 0:
            return
        if self.is_repeated or self.is_counted:
            if num_new == 1:
                self._take_one(token_ids[-1], is_output=self.num_tokens >= self.num_prompt_tokens)
            else:
                self._take_many(token_ids)
        self.num_tokens = len(token_ids)
        self._last_token = token_ids[-1]

    def _offset(self, count: int) -> float:
        return -(self.frequency_penalty * count + self.presence_penalty)

    def _take_one(self, token: int, *, is_output: bool) -> None:
        """The step's path: O(1)."""
        token = min(max(token, 0), self.vocab_size - 1)
        if self._repetition is not None:
            self._repetition.set_one(token, self.repetition_penalty)
        if is_output and self._offsets is not None:
            count = self.counts.get(token, 0) + 1
            self.counts[token] = count
            self._offsets.set_one(token, self._offset(count))

    def _take_many(self, token_ids: Sequence[int]) -> None:
        """The build's path: the tokens from num_tokens on, in array operations."""
        start = self.num_tokens
        new = np.fromiter(
            (token_ids[i] for i in range(start, len(token_ids))) if start else token_ids,
            dtype=np.int64,
            count=len(token_ids) - start,
        ).clip(0, self.vocab_size - 1)
        if self._repetition is not None:
            self._repetition.set_many(np.unique(new), self.repetition_penalty)
        output = new[max(self.num_prompt_tokens - start, 0) :]
        if self._offsets is not None and len(output):
            generated, times = np.unique(output, return_counts=True)
            counts = np.array(
                [self.counts.get(t, 0) + n for t, n in zip(generated.tolist(), times.tolist())],
                dtype=np.int64,
            )
            self.counts.update(zip(generated.tolist(), counts.tolist()))
            offsets = -(self.frequency_penalty * counts + self.presence_penalty)
            self._offsets.set_many(generated, offsets.astype(np.float32))
