"""Stateless chat completions (OpenAI's `POST /v1/chat/completions`): the client sends the whole
history every call. With an `X-Session-Id` the call runs in that session (scoped to the key's
owner), so its pinned KV is reused exactly as in the conversations API; else with a
`prompt_cache_key` in the session that key names (app.turns.prompting.prompt_cache_session_key);
without either the prefix cache still serves, and with KVCHAT_KEYLESS_SESSIONS the call runs in
a session named by the conversation's opening (app.turns.prompting.opening_session_key). A
session's replies are remembered by their ids, so a client that sends them back gets them
spliced in. `prompt_cache_retention` and content parts' `cache_control` hold the session's KV
after the turn (app.turns.cache_hints). Nothing is stored. Operators see such a session, evict
it and set its budget by its `sess_...` id (app.turns.prompting.session_key)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvchat.app.deps import AppState
from kvchat.app.errors import APIError, engine_failure
from kvchat.app.schemas import chat as schema
from kvchat.app.store import KeyRecord
from kvchat.app.transports import sse
from kvchat.app.turns.cache_hints import retention_ttl_s
from kvchat.app.turns.generation import (
    Done,
    Generated,
    Generation,
    TextDelta,
    TokenLogprob,
    ToolDelta,
)
from kvchat.app.turns.prompting import (
    chat_messages,
    opening_session_key,
    prompt_cache_session_key,
    session_key,
)
from kvchat.app.turns.requests import AnswerFallback, answer_fallback, offer, prepare_request
from kvchat.inference import CheckedRequest, Tokenizer


def check_model(state: AppState, model: str) -> None:
    if model != state.runtime.model_name:
        raise APIError(
            404,
            f"The model '{model}' does not exist (this server serves "
            f"'{state.runtime.model_name}'; see GET /v1/models).",
            param="model",
            code="model_not_found",
        )


async def create(
    state: AppState,
    key: KeyRecord,
    body: schema.ChatCompletionRequest,
    request: Request,
    session_header: str | None,
) -> schema.ChatCompletion | StreamingResponse:
    runtime = state.runtime
    check_model(state, body.model)
    skey = session_key(key.owner, session_header)
    if skey is None:
        skey = prompt_cache_session_key(key.owner, body.prompt_cache_key)
    if skey is None and state.settings.keyless_sessions:
        skey = opening_session_key(key.owner, body.messages)
    requests, fmt, tool_names = await runtime.run_cpu(_prepare, state, body, skey)
    state.limits.check_capacity()
    started = time.monotonic()
    generations = [
        Generation(
            runtime,
            request,
            cache_salt=key.owner,
            tool_format=fmt,
            tool_names=tool_names,
            started_at=started,
            on_finish=state.limits.spend_on_finish(key.id),
            fallback=fallback,
        )
        for request, fallback in requests
    ]
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        return sse.sse_response(_stream(state, body, generations, completion_id, created, skey))

    async def run_all() -> list[Generated]:
        return list(await asyncio.gather(*(_drain(g) for g in generations)))

    def stop_all() -> None:
        for g in generations:
            g.stop()

    results: list[Generated] = await sse.run_unless_disconnected(request, run_all(), stop_all)
    if skey is not None:
        _remember(state, skey, results[0])
    tokenizer = runtime.tokenizer
    return schema.ChatCompletion(
        id=completion_id,
        created=created,
        model=runtime.model_name,
        choices=[
            schema.Choice(
                index=i,
                message=schema.AssistantMessage(
                    content=r.content, tool_calls=_tool_calls(r) or None
                ),
                finish_reason=_finish_reason(r),
                logprobs=_logprobs(tokenizer, r.logprobs) if body.logprobs else None,
            )
            for i, r in enumerate(results)
        ],
        usage=_usage(results),
    )


def _prepare(
    state: AppState, body: schema.ChatCompletionRequest, skey: str | None
) -> tuple[list[tuple[CheckedRequest, AnswerFallback | None]], str | None, set[str] | None]:
    """The request's checked engine requests (one per choice, each with its answer fallback),
    tool-call format and tool names: the CPU-bound part (templates, tokenizing, schema
    compiles), for a worker thread. A named session's prompt extends its last render; any
    other reuses segments of messages seen."""
    runtime = state.runtime
    retention = retention_ttl_s(body.prompt_cache_retention, body.messages)
    offered = offer(runtime, body)
    messages = chat_messages(body.messages, offered.tool_names, state.generated, skey)
    prompt = runtime.builder.renderer.render_ids(messages, tools=offered.tools, state_key=skey)
    # The first choice runs in the session, against its budget too (an operator's
    # max_context_tokens): a 400 now, not an error mid-stream. It carries the retention hint.
    requests = [
        prepare_request(
            runtime,
            body,
            offered,
            prompt,
            max_tokens=body.reply_budget,
            seed_offset=i,
            session_id=skey if i == 0 else None,
            retention_ttl_s=retention if i == 0 else None,
        )
        for i in range(body.n)
    ]
    with_fallbacks = [(r, answer_fallback(runtime, body, offered, messages, r)) for r in requests]
    return with_fallbacks, offered.tool_format, offered.tool_names


async def _drain(generation: Generation) -> Generated:
    async for item in generation.events():
        if isinstance(item, Done):
            return item.result
    raise AssertionError("a generation ends with Done")


def _remember(state: AppState, skey: str, result: Generated) -> None:
    """Keep the reply's ids for the session, keyed by what the client will send back."""
    if result.finish_reason != "cancelled":
        state.generated.remember(skey, result.content, _tool_calls(result), result.token_ids)


def _finish_reason(result: Generated) -> str:
    # A cancelled generation only reaches a client that is already gone.
    return "stop" if result.finish_reason == "cancelled" else result.finish_reason


def _tool_calls(result: Generated) -> list[schema.ToolCall]:
    return [
        schema.ToolCall(id=c.id, function=schema.FunctionCall(name=c.name, arguments=c.arguments))
        for c in result.tool_calls
    ]


def _usage(results: list[Generated]) -> schema.Usage:
    prompt = results[0].prompt_tokens
    completion = sum(r.completion_tokens for r in results)
    return schema.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=schema.PromptTokensDetails(cached_tokens=results[0].cached_tokens),
    )


def _logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> schema.ChoiceLogprobs:
    def token(token_id: int, logprob: float) -> schema.TopLogprob:
        raw = tokenizer.id_bytes(token_id)
        return schema.TopLogprob(
            token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw)
        )

    return schema.ChoiceLogprobs(
        content=[
            schema.TokenLogprob(
                **token(e.token_id, e.logprob).model_dump(),
                top_logprobs=[token(t, lp) for t, lp in e.top or []],
            )
            for e in entries
        ]
    )


async def _stream(
    state: AppState,
    body: schema.ChatCompletionRequest,
    generations: list[Generation],
    completion_id: str,
    created: int,
    skey: str | None,
) -> AsyncIterator[str]:
    """One id for all chunks; per choice a first chunk with the role, deltas, and exactly one
    chunk with its finish_reason; with include_usage a last chunk with `choices: []`."""
    model = state.runtime.model_name
    tokenizer = state.runtime.tokenizer

    def chunk(choices: list[schema.ChunkChoice], usage: schema.Usage | None = None) -> str:
        return sse.event(
            schema.ChatCompletionChunk(
                id=completion_id,
                created=created,
                model=model,
                choices=choices,
                usage=usage,
            )
        )

    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for item in generation.events():
                await queue.put((index, item))
        except Exception as e:  # an engine failure mid-stream: reported as an error chunk
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    results: dict[int, Generated] = {}
    try:
        for i in range(len(generations)):
            yield chunk(
                [
                    schema.ChunkChoice(
                        index=i, delta=schema.ChoiceDelta(role="assistant", content="")
                    )
                ]
            )
        while len(results) < len(generations):
            index, item = await queue.get()
            if isinstance(item, Exception):
                error = engine_failure(item)
                yield sse.event(error.body())
                yield sse.DONE
                return
            if isinstance(item, TextDelta):
                if not item.text and not item.logprobs:
                    continue
                logprobs = _logprobs(tokenizer, item.logprobs) if body.logprobs else None
                yield chunk(
                    [
                        schema.ChunkChoice(
                            index=index,
                            delta=schema.ChoiceDelta(content=item.text),
                            logprobs=logprobs,
                        )
                    ]
                )
            elif isinstance(item, ToolDelta):
                yield chunk(
                    [
                        schema.ChunkChoice(
                            index=index,
                            delta=schema.ChoiceDelta(
                                tool_calls=[
                                    schema.ToolCallDelta(
                                        index=item.index,
                                        id=item.id,
                                        type="function" if item.id is not None else None,
                                        function=schema.ToolCallFunctionDelta(
                                            name=item.name, arguments=item.arguments
                                        ),
                                    )
                                ],
                            ),
                        )
                    ]
                )
            elif isinstance(item, Done):
                results[index] = item.result
                yield chunk(
                    [
                        schema.ChunkChoice(
                            index=index,
                            delta=schema.ChoiceDelta(),
                            finish_reason=_finish_reason(item.result),  # type: ignore[arg-type]
                        )
                    ]
                )
        if skey is not None:
            _remember(state, skey, results[0])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], _usage([results[i] for i in range(len(generations))]))
        yield sse.DONE
    finally:
        # The client left (or we are done): stop whatever still runs.
        for generation, task in zip(generations, tasks):
            if not task.done():
                generation.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
