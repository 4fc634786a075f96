"""Sequence: one request's state in the engine (tokens, KV, progress, output)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import llguidance
import torch

from kvchat.memory.kv_cache_manager import KVState, KVWindow

from ..model.penalty_state import PenaltyState
from ..model.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    # Its output is final; it runs once more, without sampling, to put its last token's KV in
    # its session (so the next turn reuses every token of this one).
    FINISHING = "finishing"
    FINISHED = "finished"


@dataclass
class PrefillAccounting:
    """Where the prompt's KV came from at admission (the rest was computed)."""

    from_session: int = 0
    from_prefix_cache: int = 0
    from_host: int = 0
    from_store: int = 0

    @property
    def cached(self) -> int:
        return self.from_session + self.from_prefix_cache + self.from_host + self.from_store


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + generated may not exceed this (context or max_tokens)
    session_id: str | None = None
    priority: int = 0  # lower runs first; above 0 is background work (see the scheduler)
    kv: KVState = field(default_factory=KVState)
    # prompt + generated ids; the last generated id has no KV yet.
    token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when it was first admitted to run
    # When it first stayed waiting so as not to break a held session's KV (the sessions'
    # clock; see SessionStore.should_wait).
    held_back_since: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    accounting: PrefillAccounting = field(default_factory=PrefillAccounting)
    # Set once the KV reuse (session, prefix cache) has been looked up for this admission.
    reuse_checked: bool = False
    was_admitted: bool = False  # admitted at least once (later admissions are resumptions)
    pending_reuse: PrefillAccounting = field(default_factory=PrefillAccounting)
    prompt_hashes: list[bytes] | None = None  # chain hashes of the prompt's full blocks
    # Sink + window attention when the turn would outgrow its session's max_kv_tokens.
    window: KVWindow | None = None
    # Structured output: the grammar's state after the tokens generated so far (it advances
    # only when a token is sampled, so recomputing KV after a preemption leaves it as is).
    matcher: llguidance.LLMatcher | None = None
    # What its mask takes (llguidance's part): the last one's time or, decaying, more of
    # earlier ones; where the engine computes the next one (Engine._start_masks).
    mask_seconds: float = 0.0
    # After its checked draws were all rejected, it takes its mask first for a few steps
    # (Engine._note_checks): the steps left, and how many the next rejection gives.
    mask_first_steps: int = 0
    mask_first_backoff: int = 0
    # Penalties and logit_bias: what they read each step (vectors over the vocabulary), built
    # on the first and then updated by one token a step (see current_penalties). It follows
    # token_ids alone, so it survives preemption (swap or recompute) as it is.
    penalty_state: PenaltyState | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def current_penalties(self, vocab_size: int, device: torch.device) -> PenaltyState | None:
        """The penalty state up to date with token_ids (None when the request asks for no
        penalty): built from the whole history the first time, then taking in the tokens
        appended since the last call (the one a step samples). Its vectors live on `device`
        (the logits'), vocab_size * 4 bytes each (PenaltyState)."""
        if not self.params.has_penalties:
            return None
        if self.penalty_state is None:
            self.penalty_state = PenaltyState(
                self.params, vocab_size, self.num_prompt_tokens, device
            )
        self.penalty_state.update(self.token_ids)
        return self.penalty_state

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.kv.num_computed_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.kv.num_computed_tokens

    @property
    def window_applied(self) -> bool:
        """Whether the window left some earlier token out of some query's attention (a query
        at a position >= exact_tokens has run)."""
        return self.window is not None and self.num_computed_tokens > self.window.exact_tokens

    @property
    def in_window(self) -> bool:
        """Whether this step's queries run with the window (they start at or after it)."""
        return self.window is not None and self.window.applies(self.num_computed_tokens)

    def chunk(self, num_tokens: int) -> int:
        """`num_tokens` new tokens, or fewer so a chunk never spans the window's start (the
        queries of one chunk share one attention mode)."""
        window = self.window
        start = self.num_computed_tokens
        if window is not None and start < window.start < start + num_tokens:
            return window.start - start
        return num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
