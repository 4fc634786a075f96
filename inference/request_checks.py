"""Request checks: everything about a request that can be wrong is found here, before it is
queued, and answered with an InvalidRequestError naming the field (the service turns it into
a 400). Nothing in the step loop checks a request again."""

from __future__ import annotations

from collections.abc import Callable

from memory.config import SessionBudget

from .errors import InvalidRequestError
from .grammar_compiler import GrammarError
from .sampling_params import SamplingParams
from .structured_output import StructuredOutputManager


class RequestChecker:
    """The model's limits a request is held to: its vocabulary, its context length, the KV
    pool's capacity, and its session's context budget (`budget_of`, a thread-safe read)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        max_model_len: int,
        kv_capacity_tokens: int,
        has_tokenizer: bool,
        structured: StructuredOutputManager,
        budget_of: Callable[[str], SessionBudget],
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens
        self.has_tokenizer = has_tokenizer
        self.structured = structured
        self.budget_of = budget_of

    def check(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
    ) -> int:
        """Check a prompt against the model (and its session's context budget); returns the cap
        on prompt + generated tokens."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", field="prompt")
        vocab = self.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
            raise InvalidRequestError(
                f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})",
                field="prompt",
            )
        n = len(prompt_token_ids)
        limit, what = self.max_model_len, "This model's maximum context length"
        if session_id is not None:
            budget = self.budget_of(session_id).max_context_tokens
            if budget is not None and budget < limit:
                limit, what = budget, "This session's context budget (max_context_tokens)"
        if n >= limit:
            raise InvalidRequestError(
                f"{what} is {limit} tokens. However, your prompt has {n} tokens, leaving no "
                "room to generate. Please reduce the length of the prompt.",
                field="prompt",
                code="context_length_exceeded",
            )
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise InvalidRequestError(
                f"{what} is {limit} tokens. However, you requested {n + params.max_tokens} "
                f"tokens ({n} in the prompt, {params.max_tokens} in the completion). Please "
                "reduce the length of the prompt or completion.",
                field="max_tokens",
                code="context_length_exceeded",
            )
        capacity = self.kv_capacity_tokens
        if n + 1 > capacity:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but the KV cache holds only {capacity}",
                field="prompt",
                code="context_length_exceeded",
            )
        if params.stop and not self.has_tokenizer:
            raise InvalidRequestError(
                "stop strings need a tokenizer; this model directory has none", field="stop"
            )
        for t in params.stop_token_ids:
            if t >= vocab:
                raise InvalidRequestError(
                    f"stop token id {t} is outside the vocabulary", field="stop_token_ids"
                )
        if params.grammar is not None:
            try:
                # Cached: the request's own matcher is a hit.
                self.structured.grammars.compile(params.grammar)
            except GrammarError as e:
                raise InvalidRequestError(str(e), field="grammar") from e
        if params.max_tokens is not None:
            limit = min(limit, n + params.max_tokens)
        return limit
