"""OutputProcessor: turns each sampled token into what the caller sees: detokenized text
(held back while it may still become a stop string), stop decisions (stop and end-of-sequence
tokens, stop strings, length), and the `RequestOutput` deltas.

Text of a finished request: when a stop string ends it, the text ends where the stop string
begins and nothing after it is kept. Otherwise (a stop or end-of-sequence token, the length
limit, an abort) the whole generation is decoded: bytes of a character the model never
completed come out as U+FFFD, exactly as `tokenizer.decode(ids)` shows them, so the text always
equals the decoded output ids (less a closing stop token, whose text is never shown)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..text.tokenizer import IncrementalDetokenizer, Tokenizer
from .request_output import RequestOutput
from .sequence import Sequence


@dataclass
class _TextState:
    """Detokenized output of one sequence; text inside a possible stop string is held back."""

    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted: int = 0
    stopped_by_string: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._text: dict[str, _TextState] = {}

    def add(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            self._text[seq.request_id] = _TextState(self.tokenizer.new_detokenizer())

    def append_token(
        self,
        seq: Sequence,
        token_id: int,
        logprob: float | None,
        top_logprobs: list[tuple[int, float]] | None = None,
        *,
        grammar_done: bool = False,
    ) -> RequestOutput:
        """Record a sampled token. When it ends the request, `seq.finish_reason` is set and the
        output returned is the final one (the caller then releases the sequence).
        `grammar_done`: the request's grammar is complete with this token (nothing may
        follow), which ends it with "stop" unless something else ended it first."""
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_ids.append(token_id)
        params = seq.params
        if logprob is not None and params.logprobs:
            seq.output_logprobs.append(logprob)
        text = self._text.get(seq.request_id)
        reason: str | None = None
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        ):
            reason = "stop"
        elif text is not None:
            text.text += text.detokenizer.push(token_id)
            if params.stop:
                cut = _find_stop(text.text, params.stop, text.num_emitted)
                if cut is not None:
                    text.text = text.text[:cut]
                    text.stopped_by_string = True
                    reason = "stop"
        if reason is None and grammar_done:
            reason = "stop"
        if reason is None and seq.num_tokens >= seq.max_total_tokens:
            reason = "length"
        if reason is not None:
            return self.finish(
                seq,
                reason,
                new_token_id=token_id,
                new_logprob=logprob,
                new_top_logprobs=top_logprobs,
            )
        new_text = ""
        if text is not None:
            hold = max((len(s) - 1 for s in params.stop), default=0)
            upto = max(text.num_emitted, len(text.text) - hold)
            new_text = text.text[text.num_emitted : upto]
            text.num_emitted = upto
        return _output(seq, token_id, logprob, new_text, top_logprobs=top_logprobs)

    def finish(
        self,
        seq: Sequence,
        reason: str,
        *,
        new_token_id: int | None = None,
        new_logprob: float | None = None,
        new_top_logprobs: list[tuple[int, float]] | None = None,
        abort_reason: str | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """The final output of a request that ends now (`reason`: stop | length | abort;
        `error`: what failed, for abort_reason "error")."""
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        text = self._text.pop(seq.request_id, None)
        full_text = None
        new_text = ""
        if text is not None:
            if not text.stopped_by_string:
                text.text += text.detokenizer.flush()
            full_text = text.text
            new_text = text.text[text.num_emitted :]
        return _output(
            seq,
            new_token_id,
            new_logprob,
            new_text,
            reason,
            full_text,
            abort_reason,
            new_top_logprobs,
            error,
        )


def _output(
    seq: Sequence,
    token_id: int | None,
    logprob: float | None,
    new_text: str,
    finish_reason: str | None = None,
    full_text: str | None = None,
    abort_reason: str | None = None,
    top_logprobs: list[tuple[int, float]] | None = None,
    error: str | None = None,
) -> RequestOutput:
    finished = finish_reason is not None
    ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
    queued = (
        None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time
    )
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=[] if token_id is None else [token_id],
        new_text=new_text,
        finished=finished,
        finish_reason=finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        num_cached_tokens=seq.accounting.cached,
        new_logprobs=[logprob] if logprob is not None and seq.params.logprobs else None,
        new_top_logprobs=[top_logprobs] if top_logprobs is not None else None,
        output_token_ids=list(seq.output_token_ids) if finished else None,
        text=full_text,
        time_to_first_token=ttft,
        queue_time=queued,
        abort_reason=abort_reason,
        window_applied=seq.window_applied,
        error=error,
    )


def _find_stop(text: str, stops: tuple[str, ...], emitted: int) -> int | None:
    """Index where the earliest stop string starts in text (searching from what may still be
    withheld), or None."""
    start = max(0, emitted - max(len(s) for s in stops))
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
