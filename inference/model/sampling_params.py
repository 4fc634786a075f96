"""SamplingParams: how one request's tokens are chosen and when its generation stops."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequestError
from ..structured.grammar import Grammar

MAX_STOP_STRINGS = 4
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API allows


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens None means: until a stop condition or the model's context is full.
    temperature 0 is greedy. top_k None/0 and top_p 1.0 disable those filters. The same seed
    with the same prompt gives the same tokens, whatever else runs in the batch."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int | None = None  # None, 0 or -1 (vLLM's "off"): no top-k
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    # Penalties, with vLLM's semantics (inference/model/penalties.py): presence and frequency over
    # the generated tokens, additive; repetition over prompt and generated tokens,
    # multiplicative (1.0 is off); logit_bias (token id, bias) pairs added to the logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()  # up to four; a plain string is taken as one stop string
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # report log p of each chosen token
    top_logprobs: int = 0  # and of the most likely alternatives at each step (0-20)
    # Structured output: the output must match this grammar (tokens it does not allow are never
    # sampled; the request ends when the grammar is complete).
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        # One string is one stop string (not its characters); lists become tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop must be a string or a list of strings", field="stop")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", field="max_tokens"
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(
                f"temperature must be between 0 and 2, got {self.temperature}", field="temperature"
            )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", None)
        if self.top_k is not None and self.top_k < 0:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}", field="top_k"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", field=name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
                field="repetition_penalty",
            )
        self._check_logit_bias()
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}",
                field="stop",
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", field="stop")
        if not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError(
                f"top_logprobs must be between 0 and 20, got {self.top_logprobs}",
                field="top_logprobs",
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs needs logprobs to be true", field="top_logprobs"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be >= 0", field="stop_token_ids")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(bias.items())
        bias = tuple((t, float(b)) for t, b in bias)
        object.__setattr__(self, "logit_bias", bias)
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}",
                field="logit_bias",
            )
        for token, value in bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token!r}",
                    field="logit_bias",
                )
            if not -100.0 <= value <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias values must be in [-100, 100], got {value} for token {token}",
                    field="logit_bias",
                )
        if len({t for t, _ in bias}) < len(bias):
            raise InvalidRequestError("logit_bias names a token twice", field="logit_bias")

    @property
    def has_penalties(self) -> bool:
        """Whether the logits are changed before sampling (inference/model/penalties.py)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filtering(self) -> bool:
        return bool(self.top_k) or self.top_p < 1.0 or self.min_p > 0.0
