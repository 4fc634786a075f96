"""RequestOutput: what one engine step reports for one request (a streaming delta)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV was reused (session, prefix cache, host)
    new_logprobs: list[float] | None = None
    # With top_logprobs: for each new token, the most likely (id, logprob) pairs.
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Only on the final output: every generated id and the whole text.
    output_token_ids: list[int] | None = None
    text: str | None = None
    time_to_first_token: float | None = None  # seconds, once the first token exists
    queue_time: float | None = None  # seconds from arrival to first being scheduled
    # Why an aborted request ended: "cancelled" (the caller aborted it), "shutdown" (the engine
    # stopped before it finished), "error" (a step it was in failed); None unless
    # finish_reason is "abort".
    abort_reason: str | None = None
    # The turn ran in sink + window mode and its attention left earlier tokens out (it would
    # have outgrown its session's max_kv_tokens).
    window_applied: bool = False
    # Why the engine failed this request (finish_reason "abort", abort_reason "error"): a step
    # it was in raised. None otherwise.
    error: str | None = None
