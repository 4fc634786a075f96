"""StructuredOutputManager: the grammars of constrained requests across a step (as vLLM's
StructuredOutputManager): the compiler, each row's matcher, and when its token mask is
computed.

A constrained row either takes its mask first (top-k/p, logprobs, or checks rejected lately)
or has its unconstrained draws checked by its matcher after sampling, getting a mask only if
every draw is rejected. Masks taken first are computed while the forward runs, by a worker
thread (llguidance drops the GIL), when they are costly or the forward leaves a core free;
otherwise right after the forward. A row's cost is forecast from its own last masks, and
whether it is checked or masked is decided by its own past only, so a seeded request samples
the same way alone or batched."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import llguidance
import torch

from ..engine.scheduler import ScheduledBatch
from ..engine.sequence import Sequence, SequenceStatus
from ..errors import InvalidRequestError
from ..model.sampler import masks_first
from ..text.tokenizer import Tokenizer
from .compiler import GrammarCompiler
from .grammar import Grammar

log = logging.getLogger(__name__)

# Masks computed before sampling and expected to take at least this long are computed beside
# the forward even when it has every core (see StructuredOutputManager.start_masks).
MASK_WORKER_MIN_SECONDS = 0.002
MASK_TIME_DECAY = 0.9  # per step, of a row's remembered mask time
# A constrained row whose checked draws were all rejected takes its mask first for the next
# 1, 2, 4, ... steps (doubling with each rejection, one less after each pass, up to this),
# then is checked again (see StructuredOutputManager.note_checks).
MAX_MASK_FIRST_STEPS = 16


def _compute_masks(
    grammars: GrammarCompiler, seqs: list[tuple[int, Sequence]]
) -> dict[int, torch.Tensor]:
    """key -> the fill_bitmask words [mask_words] of the sequence's next token, for (key,
    sequence) pairs of constrained sequences; each one's mask time goes into its forecast."""
    seconds: list[float] = []
    bitmask = grammars.fill_bitmask(
        [(k, cast(llguidance.LLMatcher, seq.matcher)) for k, (_, seq) in enumerate(seqs)],
        len(seqs),
        seconds,
    )
    for (_, seq), took in zip(seqs, seconds):
        # Up at once, down slowly: one cheap mask among costly ones is no forecast.
        seq.mask_seconds = max(took, seq.mask_seconds * MASK_TIME_DECAY)
    return {key: bitmask[k] for k, (key, _) in enumerate(seqs)}


class StepGrammars:
    """One step's constrained rows as the sampler asks about them (sampler.RowGrammars):
    the rows whose masks were computed before sampling take them first; the others' draws
    are checked by their matchers, and a mask asked for then is computed on the engine
    thread."""

    def __init__(
        self,
        grammars: GrammarCompiler,
        seqs: list[Sequence],
        ready: dict[int, torch.Tensor],
        device: torch.device,
    ) -> None:
        self._grammars = grammars
        self._seqs = seqs
        self._words = dict(ready)  # logits row -> mask words
        self._device = device
        self.rows = [j for j, seq in enumerate(seqs) if seq.matcher is not None]
        self.mask_first = frozenset(ready)

    def allows(self, row: int, token: int) -> bool:
        return self._grammars.allows(cast(llguidance.LLMatcher, self._seqs[row].matcher), token)

    def offsets(self, rows: list[int], num_rows: int | None = None) -> torch.Tensor:
        missing = [row for row in rows if row not in self._words]
        if missing:
            self._words.update(
                _compute_masks(self._grammars, [(row, self._seqs[row]) for row in missing])
            )
        if num_rows is None:
            words = torch.stack([self._words[row] for row in rows])
        else:  # other rows allow every token
            words = torch.full((num_rows, self._grammars.mask_words), -1, dtype=torch.int32)
            for row in rows:
                words[row] = self._words[row]
        return self._grammars.logit_offsets(words, self._device)


class StructuredOutputManager:
    """Owns the grammar compiler (built on first use, from any thread), the mask worker and
    the placement forecast. `checks_first` False masks every constrained row first."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        device: torch.device,
        checks_first: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self.device = device
        self.checks_first = checks_first
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self.mask_worker: ThreadPoolExecutor | None = None  # started by the first costly mask
        # Whether the forward leaves a core to the mask worker (see start_masks).
        self.spare_core = (os.cpu_count() or 1) > torch.get_num_threads()

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (built on first use, any thread)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self._tokenizer is None:
                    raise InvalidRequestError(
                        "structured output needs a tokenizer; this model directory has none",
                        field="grammar",
                    )
                self._grammars = GrammarCompiler(
                    self._tokenizer, self._vocab_size, self._eos_token_ids
                )
            return self._grammars

    def new_matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        return self.grammars.new_matcher(grammar)

    # -- a step ----------------------------------------------------------------------------------

    def start_masks(self, batch: ScheduledBatch) -> Callable[[], dict[int, torch.Tensor]] | None:
        """Starts computing the masks of the constrained rows that take theirs first (top-k/p,
        logprobs, or checks rejected lately: Sequence.mask_first_steps); the other
        constrained rows are checked after sampling and get a mask only if all their draws
        are rejected. Returns what gives the masks (batch row -> its fill_bitmask words) once
        the forward is done; None when no row takes its mask first. The matchers are not
        touched again until sampling, so costly masks are computed by the mask worker while
        the forward runs (llguidance drops the GIL); cheap ones, when the forward already has
        every core, right after it: beside a forward that fills the cores, work still costs
        about half its time, and a thread's memory traffic slows the forward's threads. A
        row's cost is forecast from its own last masks."""
        first = [
            (i, seq)
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
            if seq.matcher is not None
            and seq.status is not SequenceStatus.FINISHING
            and seq.num_computed_tokens + n == seq.num_tokens  # it samples (its prompt is in)
            and (masks_first(seq.params) or seq.mask_first_steps > 0 or not self.checks_first)
        ]
        if not first:
            return None
        compute = functools.partial(_compute_masks, self.grammars, first)
        expected = sum(seq.mask_seconds for _, seq in first)
        if self.device.type == "cpu" and not self.spare_core and expected < MASK_WORKER_MIN_SECONDS:
            return compute
        if self.mask_worker is None:
            self.mask_worker = ThreadPoolExecutor(1, thread_name_prefix="kvchat-grammar")
        return self.mask_worker.submit(compute).result

    def step_grammars(
        self, sampling_seqs: list[Sequence], sampled: list[int], ready: dict[int, torch.Tensor]
    ) -> StepGrammars | None:
        """The sampler's view of this step's constrained rows: `sampled` maps logits rows to
        batch rows, `ready` holds the masks computed first (by batch row). None when no row
        that samples is constrained."""
        if all(s.matcher is None for s in sampling_seqs):
            return None
        row_of = {i: j for j, i in enumerate(sampled)}  # batch row -> logits row
        return StepGrammars(
            self.grammars,
            sampling_seqs,
            {row_of[i]: words for i, words in ready.items() if i in row_of},
            self.device,
        )

    @staticmethod
    def note_checks(
        seqs: list[Sequence], grammar: StepGrammars, fell_back: tuple[int, ...]
    ) -> None:
        """After sampling: a checked row whose draws were all rejected takes its mask first
        for the next 1, 2, 4, ... steps (MAX_MASK_FIRST_STEPS at most); one whose check
        passed is checked again next step, and its next rejection backs off one step less
        far. So a row is mostly checked only while its checks pass about 4 times in 5: a
        rejected check costs a mask on the engine thread after the forward, where a mask
        taken first is computed beside it. Decided by the row's own past only, so a seeded
        request samples the same way alone or batched."""
        for j in grammar.rows:
            seq = seqs[j]
            if masks_first(seq.params):
                continue
            if j in grammar.mask_first:
                seq.mask_first_steps -= 1
            elif j in fell_back:
                seq.mask_first_backoff = min(
                    max(1, 2 * seq.mask_first_backoff), MAX_MASK_FIRST_STEPS
                )
                seq.mask_first_steps = seq.mask_first_backoff
            else:
                seq.mask_first_backoff = max(0, seq.mask_first_backoff - 1)

    @staticmethod
    def advance(seq: Sequence, token_id: int) -> bool:
        """Feed a sampled token to the request's grammar; True when the grammar is complete
        (it accepts nothing more), which ends the request."""
        matcher = seq.matcher
        assert matcher is not None
        if not matcher.consume_token(token_id):
            log.warning(
                "request %s: grammar rejected token %d (%s); ending it",
                seq.request_id,
                token_id,
                matcher.get_error(),
            )
            return True
        return matcher.is_stopped()
