"""One generation seen from the service: runs a prompt on the async engine and turns its
outputs into text deltas, tool-call deltas (when tools were offered) and a final result with
usage and timings. `stop()` ends it within one engine step; the partial result is still
returned (finish_reason "cancelled"), so the caller can store it.

A reply that repeats one of its tool calls is done: a small model under a grammar that allows
several calls loops on the first one until max_tokens. The repeat is not sent, the engine
stops the request at its next step (finish_reason "tool_calls"), and the stored reply ends
with the last new call. So is a generic-format reply caught in a loop (inference.text.loops):
it ends with its whole calls, or its answer as it stands. With an AnswerFallback
(app/turns/requests.py: the generic format under tool_choice auto) the calls the
conversation's last turn made count as made, and a reply that would only make them again, or
loops before its first call is whole, is stopped before anything is sent and the same prompt
is answered without a call instead.

The stored reply is always a whole one in its format, as the next turn's history shows it:
what a repeat or the end of max_tokens left unfinished (a call, an escape) is cut, and a
generic reply ended inside its answer's string or its calls is closed (`"}`, `]}`)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field

from kvchat.app.runtime import Runtime
from kvchat.app.turns.requests import AnswerFallback
from kvchat.inference import (
    GENERIC,
    CheckedRequest,
    ContentDelta,
    EngineDeadError,
    RequestOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamParser,
    ends_in_loop,
    ids_without_spans,
)
from kvchat.memory import HistoryStats

# Why a reply was ended before the model ended it (the engine request's abort reason).
REPEATED_CALL = "repeated_call"  # it repeated one of its own calls
LOOPED = "looped"  # it was caught in a loop (inference.text.loops)
ANSWER_INSTEAD = "answer_instead"  # it sent nothing yet and is answered without a call
# kvchat:cut_tool_replies_total's outcomes: ended there, or answered instead.
ENDED = {REPEATED_CALL: "repeat", LOOPED: "loop"}
ANSWERED = {REPEATED_CALL: "answered_repeat", LOOPED: "answered_loop"}


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


class ShownLogprobs:
    """The logprobs of a reply's text, delta by delta: a text delta gets those of the tokens
    that came with it and of the tokens before it that came without text (part of a
    character, or text held back while it may start a stop string). A closing end-of-sequence
    token (its text is never shown) and tokens whose text a stop string cut away go with none;
    the token a stop string begins inside is listed whole. So a reply's deltas' logprobs,
    joined, are those of its text, streamed or not."""

    def __init__(self, closing_ids: frozenset[int]) -> None:
        self._closing_ids = closing_ids
        self._pending: list[TokenLogprob] = []

    def of(self, delta: TextDelta) -> tuple[TokenLogprob, ...]:
        """Those of `delta.text` (call it for every text delta, in order); () for a delta
        without text, whose own are kept for the next one."""
        self._pending += [e for e in delta.logprobs if e.token_id not in self._closing_ids]
        if not delta.text:
            return ()
        shown, self._pending = tuple(self._pending), []
        return shown


@dataclass(frozen=True)
class ToolDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class Generated:
    request_id: str
    text: str = ""  # everything the model wrote (decoded), less the repeated calls dropped
    content: str | None = None  # the text outside tool calls
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"  # stop | length | tool_calls | cancelled
    abort_reason: str | None = None  # cancelled | shutdown when finish_reason is cancelled
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float | None = None
    total_ms: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Done:
    result: Generated


Event = TextDelta | ToolDelta | Done


class Generation:
    """Run with `async for event in generation.events()`; the last event is Done."""

    def __init__(
        self,
        runtime: Runtime,
        request: CheckedRequest,
        *,
        cache_salt: str | None = None,
        tool_format: str | None = None,
        tool_names: Collection[str] | None = None,
        started_at: float | None = None,
        request_id: str | None = None,
        on_finish: Callable[[Generated], None] | None = None,
        fallback: AnswerFallback | None = None,
    ) -> None:
        self.runtime = runtime
        self.request = request
        self.cache_salt = cache_salt
        self.tool_format = tool_format
        self.tool_names = tool_names
        self.fallback = fallback
        self.started_at = started_at if started_at is not None else time.monotonic()
        self.request_id = request_id or f"req-{uuid.uuid4().hex}"
        self.result = Generated(self.request_id, prompt_tokens=request.num_prompt_tokens)
        self.on_finish = on_finish
        self._stopped = False
        # Why the reply ended before the model ended it (REPEATED_CALL, LOOPED), and how much
        # of its text had been parsed then: the rest is not the reply's.
        self._ended: str | None = None
        self._parsed_upto = 0
        # An answer instead of a dropped attempt: the prompt tokens the first attempt found
        # cached (the answer finds the whole prompt, which the first one prefilled).
        self._cached_before: int | None = None

    def shown_logprobs(self) -> ShownLogprobs:
        """What gives each of this generation's text deltas the logprobs of its text: an
        end-of-sequence token ends the reply unseen unless the request ignores it."""
        params = self.request.params
        closing = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            closing |= self.runtime.engine_client.eos_token_ids
        return ShownLogprobs(closing)

    def stop(self) -> None:
        """End the generation at the next engine step (idempotent)."""
        if not self._stopped:
            self._stopped = True
            self.runtime.engine_client.abort(self.request_id)

    async def events(self) -> AsyncIterator[Event]:
        fallback = self.fallback
        parser = self._parser(fallback.answered if fallback is not None else ())
        result = self.result
        request = self.request
        metrics = self.runtime.metrics
        last_token_at: float | None = None
        while True:
            stream = self.runtime.engine_client.generate(
                self.request_id, request, cache_salt=self.cache_salt
            )
            answer_instead = False
            async for out in stream:
                if answer_instead:  # the dropped attempt's request ending: nothing is kept
                    if out.finished:  # but what it found cached, before it prefilled anything
                        self._cached_before = out.num_cached_tokens
                    continue
                if out.new_token_ids:
                    now = time.monotonic()
                    if result.ttft_ms is None:
                        result.ttft_ms = (now - self.started_at) * 1e3
                    elif last_token_at is not None:
                        metrics.itl.observe(now - last_token_at)
                    last_token_at = now
                # Kept as it streams, so a generation cut short (the engine failing) still has
                # what was sent; _finish replaces them with the engine's final values.
                result.token_ids.extend(out.new_token_ids)
                result.text += out.new_text
                logprobs = _logprobs(out)
                result.logprobs.extend(logprobs)
                if parser is None:
                    if out.new_text or logprobs:
                        yield TextDelta(out.new_text, logprobs)
                elif self._ended is None:
                    for event in parser.push(out.new_text):
                        yield _event(event)
                    ended = self._ending(parser, out.finished)
                    if ended is not None and fallback is not None and parser.awaits_first_call:
                        # Nothing sent yet: the same prompt is answered without a call.
                        answer_instead = True
                        metrics.cut_tool_replies.labels(ANSWERED[ended]).inc()
                        if out.finished:
                            self._cached_before = out.num_cached_tokens
                        else:
                            self.runtime.engine_client.abort(self.request_id, ANSWER_INSTEAD)
                        continue
                    if ended is not None:
                        self._ended, self._parsed_upto = ended, len(result.text)
                        metrics.cut_tool_replies.labels(ENDED[ended]).inc()
                        if ended == LOOPED:  # what it holds is decided (a call is cut)
                            for event in parser.finish():
                                yield _event(event)
                        if not out.finished:
                            self.runtime.engine_client.abort(self.request_id, ended)
                    elif out.finished:
                        for event in parser.finish():
                            yield _event(event)
                if out.finished:
                    self._finish(out, parser)
                    session_id = request.session_id
                    if session_id is not None and result.finish_reason == "tool_calls":
                        # Its client comes back with the results: a hint the engine lacks.
                        with contextlib.suppress(EngineDeadError):
                            await self.runtime.engine_client.note_session(
                                session_id, end="tool_calls"
                            )
                    if out.window_applied and session_id is not None:
                        self.runtime.history.record(session_id, HistoryStats(window_turns=1))
                    metrics.finished(
                        ttft_s=None if result.ttft_ms is None else result.ttft_ms / 1e3,
                        e2e_s=result.total_ms / 1e3,
                        queue_s=out.queue_time,
                        completion_tokens=result.completion_tokens,
                        finish_reason=result.finish_reason,
                    )
                    if self.on_finish is not None:
                        self.on_finish(result)
            if not answer_instead or fallback is None:
                break
            if self._stopped:  # stopped before the answer began: nothing of it to keep
                result.token_ids, result.text, result.content = [], "", None
                result.finish_reason, result.abort_reason = "cancelled", "cancelled"
                if self.on_finish is not None:
                    self.on_finish(result)
                break
            # The same prompt again (its KV is the session's or the prefix cache's), under
            # the grammar of an answer.
            request, fallback = fallback.answer, None
            parser = self._parser(())
            self.request_id = result.request_id = f"{self.request_id}-answer"
            result.token_ids, result.text, result.logprobs = [], "", []
            result.ttft_ms = None
        yield Done(result)

    def _ending(self, parser: ToolCallStreamParser, finished: bool) -> str | None:
        """Why the reply should end here (REPEATED_CALL, LOOPED), None if it should go on."""
        if parser.dropped_spans:
            return REPEATED_CALL
        if parser.fmt == GENERIC and not finished and ends_in_loop(self.result.token_ids):
            return LOOPED
        return None

    def _parser(self, answered: Collection[tuple[str, str]]) -> ToolCallStreamParser | None:
        if self.tool_format is None:
            return None
        return ToolCallStreamParser(self.tool_format, self.tool_names, answered)

    def _finish(self, out: RequestOutput, parser: ToolCallStreamParser | None) -> None:
        result = self.result
        result.text = out.text or ""
        result.token_ids = list(out.output_token_ids or [])
        result.prompt_tokens = out.num_prompt_tokens
        result.completion_tokens = out.num_output_tokens
        result.cached_tokens = out.num_cached_tokens
        if self._cached_before is not None:
            result.cached_tokens = min(result.cached_tokens, self._cached_before)
        result.total_ms = (time.monotonic() - self.started_at) * 1e3
        if parser is not None:  # the calls as streamed, with the ids the deltas carried
            parsed = parser.result()
            result.content, result.tool_calls = parsed.content, list(parsed.tool_calls)
            if out.finish_reason != "abort" or self._ended is not None:
                self._whole_reply(parser)
        else:
            result.content = result.text
        if self._ended is not None:  # ended here: its calls, or its answer as it stands
            result.finish_reason = "tool_calls" if result.tool_calls else "stop"
        elif out.finish_reason == "abort":
            result.finish_reason = "cancelled"
            result.abort_reason = out.abort_reason
        elif result.tool_calls and out.finish_reason == "stop":
            result.finish_reason = "tool_calls"
        else:
            result.finish_reason = out.finish_reason or "stop"

    def _whole_reply(self, parser: ToolCallStreamParser) -> None:
        """The stored reply as a whole one of its format: repeated calls taken out (when a
        repeat stopped it, everything from it on), an unfinished call or escape cut, and
        what closes it added (before its end of sequence, if it has one)."""
        result, template = self.result, self.runtime.template
        spans = list(parser.dropped_spans)
        cut_from = parser.unfinished_from
        if self._ended == REPEATED_CALL:
            cut_from = spans[0][0]
        elif cut_from is None and self._ended is not None:
            cut_from = self._parsed_upto  # what came after it ended is not the reply's
        if cut_from is not None and cut_from < len(result.text):
            spans = [s for s in spans if s[1] <= cut_from] + [(cut_from, len(result.text))]
        ids, text = result.token_ids, result.text
        if spans:
            ids, text = ids_without_spans(
                ids, text, spans, self.runtime.tokenizer.decode, template.tokenize
            )
        closing = parser.closing
        if closing:
            end = ids[-1:] if ids and ids[-1] in self.runtime.engine_client.eos_token_ids else []
            ids = [*ids[: len(ids) - len(end)], *template.tokenize(closing), *end]
            text += closing
        result.token_ids, result.text = ids, text


def _event(event: ContentDelta | ToolCallDelta) -> TextDelta | ToolDelta:
    if isinstance(event, ContentDelta):
        return TextDelta(event.text)
    return ToolDelta(event.index, event.id, event.name, event.arguments)


def _logprobs(out: RequestOutput) -> list[TokenLogprob]:
    if out.new_logprobs is None:
        return []
    tops: list[list[tuple[int, float]] | None] = (
        list(out.new_top_logprobs) if out.new_top_logprobs else [None] * len(out.new_logprobs)
    )
    return [
        TokenLogprob(token_id, logprob, top)
        for token_id, logprob, top in zip(out.new_token_ids, out.new_logprobs, tops)
    ]
