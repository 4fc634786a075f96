"""Responses API objects from what kvchat keeps: a stored reply (and its `response` record)
or a stateless generation's result, as OpenAI's response object.

A reply's logprobs are not stored: the answer to the request that asked for them (whole or
streamed) has them, from the text deltas of its generation (`text_logprobs`, `with_logprobs`);
a response read back later (retrieve, cancel, one answered whole from an Idempotency-Key's
record) has `logprobs: []`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvchat.app.deps import AppState
from kvchat.app.errors import APIError
from kvchat.app.schemas.response_items import (
    FunctionCall,
    OutputLogprob,
    OutputMessage,
    OutputText,
    TopLogprob,
)
from kvchat.app.schemas.responses import (
    ConversationRef,
    IncompleteDetails,
    InputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponseTextOut,
    ResponseUsage,
)
from kvchat.app.store import MessageRecord
from kvchat.app.transports.response_items import call_item_id, response_id, visible_text
from kvchat.app.turns.events import TurnDelta, TurnEvent
from kvchat.app.turns.generation import Generated, Generation, TokenLogprob
from kvchat.inference import Tokenizer


@dataclass(frozen=True)
class Stateless:
    """A `store: false` response being generated (in the session its prompt_cache_key
    names, if any)."""

    id: str
    generation: Generation
    record: dict[str, Any]
    created_at: int
    session_key: str | None = None


def remember(state: AppState, stateless: Stateless, result: Generated) -> None:
    """Keep a finished reply's ids for its session, keyed as its client sends it back (its
    output_text and function calls), so they are spliced in (app.turns.prompting.spliced)."""
    if stateless.session_key is None or result.finish_reason == "cancelled":
        return
    reply = Reply.generated(stateless, result)
    state.generated.remember(
        stateless.session_key, reply.content, reply.tool_calls, result.token_ids
    )


@dataclass(frozen=True)
class Reply:
    """What a response object is made of: a stored reply or a stateless generation's."""

    message_id: str
    status: str  # as stored: generating, complete, cancelled, interrupted, error
    finish_reason: str | None
    content: str | None
    tool_calls: Sequence[dict[str, Any]]
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    error: str | None
    created_at: int
    updated_at: int
    record: dict[str, Any]

    @classmethod
    def of(cls, message: MessageRecord) -> Reply:
        return cls(
            message.id,
            message.status,
            message.finish_reason,
            message.content,
            message.tool_calls or (),
            message.prompt_tokens,
            message.completion_tokens,
            message.cached_tokens,
            message.error,
            int(message.created_at.timestamp()),
            int(message.updated_at.timestamp()),
            message.response or {},
        )

    @classmethod
    def generated(
        cls, stateless: Stateless, result: Generated | None, error: str | None = None
    ) -> Reply:
        if result is None:
            return cls(
                stateless.id,
                "generating",
                None,
                None,
                (),
                None,
                None,
                None,
                None,
                stateless.created_at,
                stateless.created_at,
                stateless.record,
            )
        status = (
            "error"
            if error is not None
            else "cancelled"
            if result.finish_reason == "cancelled"
            else "complete"
        )
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in result.tool_calls
        ]
        return cls(
            stateless.id,
            status,
            result.finish_reason,
            result.content if result.content is not None else result.text,
            calls,
            result.prompt_tokens,
            result.completion_tokens,
            result.cached_tokens,
            error,
            stateless.created_at,
            int(time.time()),
            stateless.record,
        )


def response_status(reply: Reply) -> str:
    if reply.status == "generating":
        return "in_progress"
    if reply.status == "error":
        return "failed"
    if reply.status in ("cancelled", "interrupted"):
        return "cancelled"
    return "incomplete" if reply.finish_reason == "length" else "completed"


def output_items(reply: Reply) -> list[OutputMessage | FunctionCall]:
    status = (
        "in_progress"
        if reply.status == "generating"
        else ("completed" if response_status(reply) == "completed" else "incomplete")
    )
    items: list[OutputMessage | FunctionCall] = []
    if reply.status == "generating":
        return items
    if reply.content or (reply.content is not None and not reply.tool_calls):
        items.append(
            OutputMessage(
                id=reply.message_id,
                status=status,  # type: ignore[arg-type]
                content=[OutputText(text=reply.content or "")],
            )
        )
    for index, call in enumerate(reply.tool_calls):
        function = call.get("function", {})
        items.append(
            FunctionCall(
                id=call_item_id(reply.message_id, index),
                call_id=call.get("id", ""),
                name=function.get("name", ""),
                arguments=function.get("arguments", ""),
                status=status,
            )
        )  # type: ignore[arg-type]
    return items


def response_object(reply: Reply, model: str, *, failure: APIError | None = None) -> ResponseObject:
    """The response object of `reply` (with `failure`: the turn ended without a stored
    reply, e.g. its conversation was deleted under it)."""
    record = reply.record
    status = "failed" if failure is not None else response_status(reply)
    output = [] if failure is not None else output_items(reply)
    usage = None
    if reply.prompt_tokens is not None and reply.status != "generating":
        prompt, completion = reply.prompt_tokens, reply.completion_tokens or 0
        cached = reply.cached_tokens or 0
        usage = ResponseUsage(
            input_tokens=prompt,
            output_tokens=completion,
            total_tokens=prompt + completion,
            input_tokens_details=InputTokensDetails(
                cached_tokens=cached, cache_write_tokens=max(0, prompt - cached)
            ),
        )
    error = None
    if failure is not None:
        error = ResponseError(code="server_error", message=failure.message)
    elif status == "failed":
        error = ResponseError(
            code="server_error", message=f"The generation failed: {reply.error or 'unknown'}"
        )
    conversation = record.get("conversation")
    return ResponseObject(
        id=response_id(reply.message_id),
        created_at=reply.created_at,
        completed_at=reply.updated_at if status == "completed" else None,
        status=status,
        error=error,
        incomplete_details=IncompleteDetails(reason="max_output_tokens")
        if status == "incomplete"
        else None,
        instructions=record.get("instructions"),
        max_output_tokens=record.get("max_output_tokens"),
        model=record.get("model", model),
        output=output,
        output_text="".join(
            part.text for item in output if isinstance(item, OutputMessage) for part in item.content
        ),
        parallel_tool_calls=record.get("parallel_tool_calls", True),
        previous_response_id=record.get("previous_response_id"),
        conversation=ConversationRef(id=conversation) if conversation else None,
        store=record.get("store", True),
        temperature=record.get("temperature"),
        top_p=record.get("top_p"),
        top_logprobs=record.get("top_logprobs"),
        text=ResponseTextOut(**record.get("text", {"format": {"type": "text"}})),
        tool_choice=record.get("tool_choice", "auto"),
        tools=record.get("tools", []),
        truncation=record.get("truncation", "disabled"),
        usage=usage,
        user=record.get("user"),
        metadata=record.get("metadata") or {},
        prompt_cache_key=record.get("prompt_cache_key"),
        prompt_cache_retention=record.get("prompt_cache_retention"),
    )


def stored_response(state: AppState, message: MessageRecord) -> ResponseObject:
    text = visible_text(message, state.runtime.template.tool_call_format)
    return response_object(replace(Reply.of(message), content=text), state.runtime.model_name)


def skeleton(state: AppState, message: MessageRecord) -> ResponseObject:
    """The response as `response.created` shows it: in progress, nothing out yet."""
    pending = replace(
        Reply.of(message), status="generating", content=None, tool_calls=(), prompt_tokens=None
    )
    return response_object(pending, state.runtime.model_name)


# -- logprobs -------------------------------------------------------------------------------------


def output_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> list[OutputLogprob]:
    """The entries as OpenAI's `logprobs` of an output_text part (a token's `token` is its
    bytes decoded, U+FFFD where it holds part of a character; `bytes` are exact)."""

    def token(token_id: int, logprob: float) -> TopLogprob:
        raw = tokenizer.id_bytes(token_id)
        return TopLogprob(
            token=raw.decode("utf-8", errors="replace"), bytes=list(raw), logprob=logprob
        )

    return [
        OutputLogprob(
            **token(e.token_id, e.logprob).model_dump(),
            top_logprobs=[token(t, lp) for t, lp in e.top or ()],
        )
        for e in entries
    ]


def text_logprobs(events: Sequence[TurnEvent]) -> list[TokenLogprob]:
    """The logprobs of a reply's text: its text deltas' (empty unless it asked for them)."""
    return [e for event in events if isinstance(event, TurnDelta) for e in event.logprobs]


def with_logprobs(response: ResponseObject, logprobs: list[OutputLogprob]) -> ResponseObject:
    """`response` with `logprobs` on its message's text part (unchanged without them)."""
    if not logprobs:
        return response
    output = [
        item.model_copy(
            update={
                "content": [part.model_copy(update={"logprobs": logprobs}) for part in item.content]
            }
        )
        if isinstance(item, OutputMessage)
        else item
        for item in response.output
    ]
    return response.model_copy(update={"output": output})
