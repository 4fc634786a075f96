"""Request checks: everything about a request that can be wrong is found here, once, before it
is queued, and answered with an InvalidRequestError naming the field (the service turns it
into a 400). What passes is a CheckedRequest, the only thing the engine queues: the service
checks a turn before it stores anything and hands the checked request on, so nothing checks
it a second time, and the type of what is queued says it was checked."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvchat.memory.config import SessionBudget

from ..errors import InvalidRequestError
from ..model.sampling_params import SamplingParams
from ..structured.compiler import GrammarError
from ..structured.output import StructuredOutputManager


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed every check (RequestChecker.check makes them; nothing else
    should).

    max_total_tokens: the cap on prompt + generated tokens (the model's context, the session's
        max_context_tokens, prompt + max_tokens: the least of them).
    max_kv_tokens: the session's KV budget it was checked under (a turn that could outgrow it
        runs with sink + window attention); None without a session or a cap.
    session_budget: the session's budget when the caller gave it (the service owns its
        sessions' budgets): the engine records it for the session when the request is added,
        so a turn carries its budget to the engine once."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    session_id: str | None
    max_total_tokens: int
    max_kv_tokens: int | None
    session_budget: SessionBudget | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


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
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        session_id: str | None = None,
        budget: SessionBudget | None = None,
    ) -> CheckedRequest:
        """Check a prompt against the model and, in a session, its budget: `budget` when the
        caller owns it (the engine records it with the request), else the one the engine
        holds for the session."""
        assert session_id is not None or budget is None, "a budget belongs to a session"
        given = budget
        if session_id is not None and budget is None:
            budget = self.budget_of(session_id)
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
        context_budget = None if budget is None else budget.max_context_tokens
        if context_budget is not None and context_budget < limit:
            limit, what = context_budget, "This session's context budget (max_context_tokens)"
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
        for t, _ in params.logit_bias:
            if t >= vocab:
                raise InvalidRequestError(
                    f"logit_bias names token id {t}, outside the vocabulary (0..{vocab - 1})",
                    field="logit_bias",
                )
        if params.grammar is not None:
            try:
                # Cached: the request's own matcher is a hit.
                self.structured.grammars.compile(params.grammar)
            except GrammarError as e:
                raise InvalidRequestError(str(e), field="grammar") from e
        if params.max_tokens is not None:
            limit = min(limit, n + params.max_tokens)
        return CheckedRequest(
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            session_id=session_id,
            max_total_tokens=limit,
            max_kv_tokens=None if budget is None else budget.max_kv_tokens,
            session_budget=given,
        )
