"""OpenAI's Responses API over the turn service: a response is a stored assistant reply.

- `previous_response_id` names the reply a response continues: its conversation is the one
  the chain lives in, and the new input goes under that reply. A chain is a branch of the
  conversation's tree; two responses continuing one response are sibling branches, and the
  session's pinned KV is reused up to where they diverge (the engine matches the prompt
  against the session's tokens). `conversation` continues a conversation's current leaf.
  With neither, a stored response starts a new conversation. Another owner's response or
  conversation, a deleted response and an unknown id are 404s.
- The input items become stored messages in order (app/transports/response_items.py): all
  but the last are stored first, as useChat's imported history is; the last one is the turn's
  new message (a user, system or developer message, or a function_call_output). When the turn
  cannot start (a 400 from planning, a 409), what was stored for it is taken out again.
- `instructions` are that turn's system prompt (not carried along a chain, as OpenAI's);
  `truncation` "auto" plans under the conversation's history policy, "disabled" (OpenAI's
  default) needs the whole branch to fit, else 400 context_length_exceeded.
- `store: false`: run like a stateless chat completion (nothing written; the prompt is the
  branch `previous_response_id` or `conversation` names, then the input), under the owner's
  cache salt, so the prefix cache serves it and keeps its blocks; with a `prompt_cache_key`
  in the session it names (app.turns.prompting.prompt_cache_session_key), whose replies are
  spliced back by their ids when the client sends them again (Codex resends its whole
  history so), else in no session. Its id is not retrievable.
- `prompt_cache_retention` holds the session's KV after the turn (app.turns.cache_hints); a
  stored response's session is its conversation's, and its `prompt_cache_key` only routes
  (a fleet's HAProxy reads it).
- What a stored response was asked with (instructions, tools, text format, metadata, where its
  input starts) is kept with the reply (`messages.response`), so retrieve, input_items and
  the stream read the tree.

Outcomes: finish_reason stop/tool_calls -> `completed`; length -> `incomplete`
(`max_output_tokens`); stopped or cut off by a restart -> `cancelled`; the engine failing ->
`failed` with `error`. Usage: input/output/total tokens, `cached_tokens` (prompt tokens served
from KV already in memory), `cache_write_tokens` (the rest: prefilled now, kept pinned)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvchat.app.deps import AppState
from kvchat.app.errors import APIError, api_error, invalid_request, not_found
from kvchat.app.schemas.chat import (
    SamplingFields,
)
from kvchat.app.schemas.conversations import ROOT
from kvchat.app.schemas.response_items import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ItemList,
    MessageItem,
    parse_items,
)
from kvchat.app.schemas.responses import ResponseCreate, ResponseObject
from kvchat.app.store import ConversationRecord, KeyRecord, MessageRecord
from kvchat.app.transports import sse
from kvchat.app.transports.chat_completions import check_model
from kvchat.app.transports.response_items import (
    call_ids,
    items_of,
    joined,
    message_of_response,
    page,
    response_id,
    split_system,
    store_messages,
    to_messages,
    visible_text,
)
from kvchat.app.transports.response_objects import (
    Reply,
    Stateless,
    output_logprobs,
    remember,
    response_object,
    skeleton,
    stored_response,
    text_logprobs,
    with_logprobs,
)
from kvchat.app.transports.response_requests import (
    check_supported,
    renamed,
    response_record,
    sampling_fields,
)
from kvchat.app.transports.responses_stream import (
    drained,
    final_stored,
    response_events,
    sse_lines,
    stateless_stream,
    watched,
)
from kvchat.app.turns.cache_hints import retention_ttl_s
from kvchat.app.turns.events import TurnDelta, TurnEvent
from kvchat.app.turns.generation import Generation
from kvchat.app.turns.idempotency import Replayed, run_once
from kvchat.app.turns.pipeline import as_chat, turn_system, usable
from kvchat.app.turns.prompting import prompt_cache_session_key, spliced
from kvchat.app.turns.requests import AnswerFallback, answer_fallback, offer, prepare_request
from kvchat.app.turns.service import EndHook
from kvchat.app.turns.turn import Turn
from kvchat.inference import ChatMessage, CheckedRequest

log = logging.getLogger(__name__)

TITLE_CHARS = 80


# -- where a response goes ------------------------------------------------------------------------


async def find_reply(
    state: AppState, owner: str, response: str
) -> tuple[ConversationRecord, MessageRecord]:
    """The stored reply a response id names, with its conversation; 404 for an unknown,
    deleted or another owner's one."""
    message_id = message_of_response(response)
    found = await state.store.owned_message(owner, message_id) if message_id else None
    message = found[1] if found is not None else None
    if (
        found is None
        or message is None
        or message.role != "assistant"
        or (message.response is not None and message.response.get("deleted"))
    ):
        raise not_found(f"response {response!r}")
    return found


async def find_response(state: AppState, owner: str, response: str) -> MessageRecord:
    return (await find_reply(state, owner, response))[1]


@dataclass(frozen=True)
class Placement:
    conversation: ConversationRecord | None  # None: a new one (when stored)
    parent_id: str  # where the input goes (ROOT: a new root)
    parent_calls: frozenset[str] = frozenset()  # the calls of the message it continues


async def place(state: AppState, owner: str, body: ResponseCreate) -> Placement:
    if body.previous_response_id is not None:
        try:
            conv, previous = await find_reply(state, owner, body.previous_response_id)
        except APIError as e:
            raise APIError(404, e.message, param="previous_response_id", code="not_found") from e
        return Placement(conv, previous.id, frozenset(call_ids([previous])))
    conversation_id = body.conversation_id
    if conversation_id is not None:
        found = await state.store.get_conversation(owner, conversation_id)
        if found is None:
            raise not_found(f"conversation {conversation_id!r}", "conversation")
        return Placement(found, found.current_leaf_id or ROOT)
    return Placement(None, ROOT)


async def branch_of(state: AppState, placement: Placement) -> list[MessageRecord]:
    conv = placement.conversation
    if conv is None or placement.parent_id == ROOT:
        return []
    return await state.store.branch(conv.id, placement.parent_id)


async def input_messages(
    state: AppState, body: ResponseCreate, placement: Placement
) -> tuple[str | None, list[ChatMessage]]:
    """The input's leading system and developer messages (joined), and its other messages
    to store. Outputs answer the calls of the input or of the branch (read only when the
    message continued does not have them)."""
    raw = body.input
    items = (
        [MessageItem(role="user", content=raw)]
        if isinstance(raw, str)
        else parse_items(raw, "input")
    )
    given = {i.call_id for i in items if isinstance(i, FunctionCallItem)}
    answered = {i.call_id for i in items if isinstance(i, FunctionCallOutputItem)}
    known: set[str] = set(placement.parent_calls)
    if answered - given - known:
        known = call_ids(await branch_of(state, placement))
    system, messages = split_system(to_messages(items, "input", known), "input")
    if not messages or messages[-1].role == "assistant":
        raise invalid_request(
            "the last input item must be a user message or a function_call_output", "input"
        )
    return system, messages


# -- starting one ---------------------------------------------------------------------------------


async def start(
    state: AppState, key: KeyRecord, body: ResponseCreate, on_end: EndHook | None = None
) -> Turn | Stateless:
    """Check the request, place it on the tree, store its input and start its turn (or, with
    `store: false`, its stateless generation). `on_end` runs when the turn has ended."""
    model = state.runtime.model_name
    check_model(state, body.model or model)
    check_supported(body)
    fields = sampling_fields(body)
    retention = retention_ttl_s(body.prompt_cache_retention)
    placement = await place(state, key.owner, body)
    system, messages = await input_messages(state, body, placement)
    if body.store is False:
        return await _start_stateless(
            state, key, body, fields, placement, messages, system, retention
        )
    conv, created = placement.conversation, False
    instructions = body.instructions
    if conv is None:  # its system messages are the new conversation's system prompt
        first_user = next((m.content for m in messages if m.role == "user" and m.content), None)
        conv = await state.store.create_conversation(
            key.owner, title=first_user[:TITLE_CHARS] if first_user else None, system_prompt=system
        )
        created = True
    elif system is not None:  # continuing one: this turn's, with the instructions
        instructions = joined(instructions or conv.system_prompt, system)
    await _previous_turn_ended(state, conv.id)
    imported: list[MessageRecord] = []
    try:
        parent, imported = await store_messages(
            state, conv.id, placement.parent_id, messages[:-1], move_leaf=False
        )
        record = response_record(body, model, imported[0].id if imported else None)
        return await state.turns.start(
            key,
            conv.id,
            fields,
            new_message=messages[-1],
            parent_id=parent,
            instructions=instructions,
            truncation=body.truncation == "auto",
            reply_fields={"response": record},
            on_end=on_end,
            key_verified=True,
            retention_ttl_s=retention,
        )
    except BaseException as e:
        # Nothing of a request that did not start stays behind: also when its client went
        # away (the cancellation) while its input was being stored.
        await asyncio.shield(_forget_input(state, key.owner, conv.id, created, imported))
        if isinstance(e, Exception):
            raise renamed(api_error(e)) from e
        raise


async def _forget_input(
    state: AppState, owner: str, conversation_id: str, created: bool, imported: list[MessageRecord]
) -> None:
    try:
        if created:
            await state.store.delete_conversation(owner, conversation_id)
        else:
            await state.store.remove_chain(conversation_id, [m.id for m in imported])
    except Exception:  # the request's own error is the answer; this one is logged
        log.exception("responses: removing the input of a request that did not start")


async def _previous_turn_ended(state: AppState, conversation_id: str) -> None:
    """Wait for this process's previous turn of the conversation to let go of it: its
    client has its terminal event (an agent sends the next step at once) a moment before the
    turn has released its lock."""
    turn = state.turns.running(conversation_id)
    if turn is not None and turn.is_done and turn.task is not None:
        await asyncio.shield(turn.task)


async def _start_stateless(
    state: AppState,
    key: KeyRecord,
    body: ResponseCreate,
    fields: SamplingFields,
    placement: Placement,
    messages: list[ChatMessage],
    input_system: str | None,
    retention: float | None,
) -> Stateless:
    runtime = state.runtime
    skey = prompt_cache_session_key(key.owner, body.prompt_cache_key)
    conv = placement.conversation
    system = turn_system(conv, body.instructions) if conv is not None else body.instructions
    system = joined(system, input_system)
    chat = (
        ([ChatMessage("system", system)] if system else [])
        + [as_chat(m) for m in usable(await branch_of(state, placement))]
        + messages
    )
    try:
        request, fallback, fmt, names = await runtime.run_cpu(
            _prepare_stateless, state, fields, chat, skey, retention
        )
        state.limits.check_capacity()
    except Exception as e:
        raise renamed(api_error(e)) from e
    generation = Generation(
        runtime,
        request,
        cache_salt=key.owner,
        tool_format=fmt,
        tool_names=names,
        on_finish=state.limits.spend_on_finish(key.id),
        fallback=fallback,
    )
    hex_id = uuid.uuid4().hex
    record = response_record(body, runtime.model_name, None) | {"store": False}
    return Stateless(f"msg_{hex_id}", generation, record, int(time.time()), skey)


def _prepare_stateless(
    state: AppState,
    fields: SamplingFields,
    chat: list[ChatMessage],
    skey: str | None,
    retention: float | None,
) -> tuple[CheckedRequest, AnswerFallback | None, str | None, set[str] | None]:
    """The checked engine request (prompt ids and sampling parameters), its answer fallback, the
    tool-call format and the tool names (CPU-bound: a worker thread runs it). In a session
    (`skey`) the replies it generated are spliced in, its prompt extends its last render, and
    the request carries the retention hint."""
    runtime = state.runtime
    offered = offer(runtime, fields)
    if skey is not None:
        chat = spliced(chat, state.generated, skey)
    prompt = runtime.builder.renderer.render_ids(chat, tools=offered.tools, state_key=skey)
    request = prepare_request(
        runtime,
        fields,
        offered,
        prompt,
        max_tokens=fields.reply_budget,
        session_id=skey,
        retention_ttl_s=retention,
    )
    fallback = answer_fallback(runtime, fields, offered, chat, request)
    return request, fallback, offered.tool_format, offered.tool_names


# -- the other routes -------------------------------------------------------------------------


async def delete(state: AppState, owner: str, response: str) -> None:
    """A deleted response reads as not found and cannot be continued. Its message stays in
    the tree as history of the responses that continue it (their prompts are exact
    extensions of it), marked deleted in its record."""
    message = await find_response(state, owner, response)
    if message.status == "generating":
        raise APIError(
            409,
            "This response is still being generated; cancel it first.",
            code="conversation_busy",
        )
    record = dict(message.response or {}) | {"deleted": True}
    await state.store.update_message(message.id, response=record)


async def cancel(state: AppState, owner: str, response: str) -> ResponseObject:
    """Stop a response being generated (stored as cancelled with what it has) and return it;
    a response that has ended is returned as it is."""
    message = await find_response(state, owner, response)
    if message.status == "generating":
        turn = state.turns.running(message.conversation_id)
        await state.turns.stop(owner, message.conversation_id)
        if turn is not None and turn.message_id == message.id:
            await turn.ended()
        stored = await state.store.get_message(message.conversation_id, message.id)
        message = stored or message
    return stored_response(state, message)


async def input_items(
    state: AppState, owner: str, response: str, *, order: str, after: str | None, limit: int
) -> ItemList:
    """The items given as the response's input: the messages stored for it, oldest first."""
    message = await find_response(state, owner, response)
    if message.parent_id is None:
        return page([], order=order, after=after, limit=limit)
    branch = await state.store.branch(message.conversation_id, message.parent_id)
    start_id = (message.response or {}).get("input_start")
    ids = [m.id for m in branch]
    start = ids.index(start_id) if start_id in ids else len(branch) - 1
    fmt = state.runtime.template.tool_call_format
    items = [item for m in branch[start:] for item in items_of(m, fmt)]
    return page(items, order=order, after=after, limit=limit)


# -- answering: whole, streamed, resumed ----------------------------------------------------------


async def create(
    state: AppState,
    key: KeyRecord,
    body: ResponseCreate,
    request: Request,
    idempotency_key: str | None = None,
) -> ResponseObject | StreamingResponse:
    """`POST /v1/responses`: the response once it has ended, or with `stream` its events. A
    client that leaves a stream lets the reply go on for the WebSocket's grace period (it may
    resume it with `GET /v1/responses/{id}?stream=true`); one that leaves a whole request
    stops it. With an `Idempotency-Key` (stored responses), as on `/messages`: a retry with the
    same key and body gets the first request's response instead of a second one, a retry of
    an attempt that died regenerates its reply, another body is a 400."""
    if idempotency_key is not None and body.store is not False:
        result = await run_once(
            state.turns,
            key.owner,
            RESPONSES_SCOPE,
            idempotency_key,
            body.model_dump(mode="json", exclude_unset=True),
            start=lambda on_end: _stored_turn(start(state, key, body, on_end)),
            rerun=lambda user_id, on_end: _rerun(state, key, body, user_id, on_end),
        )
        if isinstance(result, Replayed):
            if body.stream:
                return await resume(state, key.owner, response_id(result.message.id), None)
            return stored_response(state, result.message)
        started: Turn | Stateless = result
    else:
        started = await start(state, key, body)
    model, tokenizer = state.runtime.model_name, state.runtime.tokenizer
    if isinstance(started, Stateless):
        if body.stream:
            return sse.sse_response(sse_lines(stateless_stream(state, started)))
        generation = started.generation
        result_, logprobs = await sse.run_unless_disconnected(
            request, drained(generation), generation.stop
        )
        remember(state, started, result_)
        whole = response_object(Reply.generated(started, result_), model)
        return with_logprobs(whole, output_logprobs(tokenizer, logprobs))
    turn = started
    if body.stream:
        return sse.sse_response(sse_lines(watched(state, turn)))
    final = await sse.run_unless_disconnected(request, turn.wait(), turn.stop)
    return with_logprobs(
        stored_response(state, final), output_logprobs(tokenizer, text_logprobs(turn.log))
    )


# Idempotency records of the Responses API are the owner's, not a conversation's: the first
# request may create its conversation.
RESPONSES_SCOPE = "responses"


async def _stored_turn(started: Awaitable[Turn | Stateless]) -> Turn:
    turn = await started
    assert isinstance(turn, Turn), "an idempotent response is a stored one"
    return turn


async def _rerun(
    state: AppState, key: KeyRecord, body: ResponseCreate, user_message_id: str, on_end: EndHook
) -> Turn:
    """A retry of an attempt that died after storing its input: a new reply to that input's
    last message (the interrupted reply stays beside it)."""
    found = await state.store.owned_message(key.owner, user_message_id)
    if found is None:
        raise not_found("the input of the first request with this Idempotency-Key")
    conv, _ = found
    record = response_record(body, state.runtime.model_name, None)
    instructions = body.instructions
    try:
        return await state.turns.start(
            key,
            conv.id,
            sampling_fields(body),
            new_message=None,
            parent_id=user_message_id,
            instructions=instructions,
            truncation=body.truncation == "auto",
            reply_fields={"response": record},
            on_end=on_end,
            key_verified=True,
            retention_ttl_s=retention_ttl_s(body.prompt_cache_retention),
        )
    except Exception as e:
        raise renamed(api_error(e)) from e


async def resume(
    state: AppState, owner: str, response: str, starting_after: int | None
) -> StreamingResponse:
    """`GET /v1/responses/{id}?stream=true`: the response's events from the start, or those
    after `starting_after` (the turn service's attach() is the source: the live turn, one that
    ended here lately, another process's buffer, else the stored reply)."""
    message = await find_response(state, owner, response)
    events = await state.turns.attach(message.conversation_id, message.id, 0)
    visible = visible_text(message, state.runtime.template.tool_call_format)
    return sse.sse_response(
        sse_lines(
            response_events(
                _without_markup(events, message, visible),
                skeleton(state, message),
                message.id,
                final_stored(state, message),
                state.runtime.tokenizer,
            ),
            starting_after,
        )
    )


async def _without_markup(
    events: AsyncIterator[TurnEvent], message: MessageRecord, visible: str | None
) -> AsyncIterator[TurnEvent]:
    """A stored reply's events (attach()'s last source) tell its stored text, which for a
    reply with calls holds their markup; a live turn's deltas never do. That text is shown as
    the response shows it."""
    async for event in events:
        if (
            isinstance(event, TurnDelta)
            and message.tool_calls
            and event.offset == 0
            and event.text == message.content
            and visible != message.content
        ):
            if visible:
                yield TurnDelta(event.message_id, visible, 0, event.logprobs)
            continue
        yield event
