"""A turn's typed events (app/turns/events.py) as the Responses API's semantic stream events:
`response.created`, `response.in_progress`, then per output item `response.output_item.added`,
for text `response.content_part.added`, `response.output_text.delta`... `.done`,
`response.content_part.done`, for a call `response.function_call_arguments.delta`... `.done`,
`response.output_item.done`, and last `response.completed`, `response.incomplete` (also a
cancelled response, whose object says `cancelled`) or `response.failed` (after an `error`
event in OpenAI's shape).

Sequence numbers count the events made from the turn's event log, from 0. The log is what the
turn service's `attach()` gives (a live turn's, or one that ended here lately, exactly as it
was published), so a stream resumed with `starting_after=N` gets exactly the events after N of
the original. The text streams as one message item (output index 0 when text comes first);
each tool call is an item of its own, in the order the model wrote them.

With `include: ["message.output_text.logprobs"]` each `response.output_text.delta` has the
logprobs of its text's tokens, and `response.output_text.done`, `response.content_part.done`,
the message's `response.output_item.done` and the terminal event's response have them all.
They come with the turn's events in this process (TurnDelta.logprobs): a stream resumed from
the live turn, or one that ended here lately, has them as first sent; one resumed from another
process's buffer or from the stored reply has `logprobs: []`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvchat.app.deps import AppState
from kvchat.app.errors import APIError, engine_failure
from kvchat.app.schemas.response_items import OutputLogprob
from kvchat.app.schemas.responses import ResponseObject
from kvchat.app.store import MessageRecord
from kvchat.app.transports.response_items import call_item_id
from kvchat.app.transports.response_objects import (
    Reply,
    Stateless,
    output_logprobs,
    remember,
    response_object,
    skeleton,
    stored_response,
    with_logprobs,
)
from kvchat.app.turns.events import (
    TurnDelta,
    TurnDone,
    TurnEvent,
    TurnFailed,
    TurnStarted,
    TurnToolCall,
    is_terminal,
)
from kvchat.app.turns.generation import (
    Done,
    Generated,
    Generation,
    TextDelta,
    TokenLogprob,
    ToolDelta,
)
from kvchat.app.turns.turn import Turn
from kvchat.inference import Tokenizer

Event = dict[str, Any]
FinalResponse = Callable[[TurnEvent], Awaitable[ResponseObject]]

TERMINAL_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


class ResponseEvents:
    """Builds the numbered events of one response, event by event of its turn."""

    def __init__(self, skeleton: ResponseObject, message_id: str, tokenizer: Tokenizer) -> None:
        self.skeleton = skeleton
        self.message_id = message_id
        self.tokenizer = tokenizer
        self.next_sequence = 0
        self.items: list[Event] = []  # the output items so far, by output index
        self.message_index: int | None = None  # the text's item
        self.text = ""
        self.logprobs: list[OutputLogprob] = []  # the text's, when the request asked
        self.calls: dict[int, int] = {}  # the model's call index -> output index
        self.open_call: int | None = None  # output index of the call being written

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.next_sequence, **fields}
        self.next_sequence += 1
        return event

    def started(self) -> list[Event]:
        response = self.skeleton.model_dump(mode="json")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def on(self, event: TurnEvent) -> list[Event]:
        if isinstance(event, TurnDelta):
            return self._text(event.text, event.logprobs)
        if isinstance(event, TurnToolCall):
            return self._call(event)
        return []

    def _text(self, text: str, entries: tuple[TokenLogprob, ...]) -> list[Event]:
        out = []
        if self.message_index is None:
            self.message_index = len(self.items)
            item = {
                "id": self.message_id,
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            self.items.append(item)
            out += [
                self._event(
                    "response.output_item.added", output_index=self.message_index, item=dict(item)
                ),
                self._event(
                    "response.content_part.added",
                    item_id=self.message_id,
                    output_index=self.message_index,
                    content_index=0,
                    part=_text_part(""),
                ),
            ]
        self.text += text
        logprobs = output_logprobs(self.tokenizer, entries)
        self.logprobs += logprobs
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=self.message_id,
                output_index=self.message_index,
                content_index=0,
                delta=text,
                logprobs=_dumped(logprobs),
            )
        )
        return out

    def _call(self, event: TurnToolCall) -> list[Event]:
        out = []
        if event.id is not None:  # a new call: its id and name come whole, first
            out += self._close_call("completed")
            index = len(self.items)
            self.calls[event.index] = index
            self.open_call = index
            item = {
                "id": call_item_id(self.message_id, event.index),
                "type": "function_call",
                "call_id": event.id,
                "name": event.name or "",
                "arguments": "",
                "status": "in_progress",
            }
            self.items.append(item)
            out.append(
                self._event("response.output_item.added", output_index=index, item=dict(item))
            )
        at = self.calls.get(event.index)
        if at is None or not event.arguments:
            return out
        item = self.items[at]
        item["arguments"] += event.arguments
        out.append(
            self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=at,
                delta=event.arguments,
            )
        )
        return out

    def _close_call(self, status: str) -> list[Event]:
        if self.open_call is None:
            return []
        index, self.open_call = self.open_call, None
        item = self.items[index]
        item["status"] = status
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def _close_text(self, status: str) -> list[Event]:
        if self.message_index is None:
            return []
        index = self.message_index
        part = _text_part(self.text, self.logprobs)
        item = self.items[index] | {"status": status, "content": [part]}
        return [
            self._event(
                "response.output_text.done",
                item_id=self.message_id,
                output_index=index,
                content_index=0,
                text=self.text,
                logprobs=part["logprobs"],
            ),
            self._event(
                "response.content_part.done",
                item_id=self.message_id,
                output_index=index,
                content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def finished(self, final: ResponseObject, event: TurnEvent) -> list[Event]:
        status = "completed" if final.status == "completed" else "incomplete"
        final = with_logprobs(final, self.logprobs)
        out = [*self._close_call(status), *self._close_text(status)]
        if isinstance(event, TurnFailed):
            out.append(self._event("error", code=event.code, message=event.message, param=None))
        out.append(
            self._event(TERMINAL_EVENT[final.status], response=final.model_dump(mode="json"))
        )
        return out


def _text_part(text: str, logprobs: list[OutputLogprob] | None = None) -> Event:
    return {
        "type": "output_text",
        "text": text,
        "annotations": [],
        "logprobs": _dumped(logprobs or []),
    }


def _dumped(logprobs: list[OutputLogprob]) -> list[Event]:
    return [entry.model_dump(mode="json") for entry in logprobs]


async def response_events(
    events: AsyncIterator[TurnEvent],
    skeleton: ResponseObject,
    message_id: str,
    final: FinalResponse,
    tokenizer: Tokenizer,
) -> AsyncIterator[Event]:
    """The numbered stream events of a turn's events (from its start); `final` gives the
    response object once the turn's terminal event came."""
    writer = ResponseEvents(skeleton, message_id, tokenizer)
    async for event in events:
        if isinstance(event, TurnStarted):
            batch = writer.started()
        elif is_terminal(event):
            batch = writer.finished(await final(event), event)
        else:
            batch = writer.on(event)
        for out in batch:
            yield out
        if is_terminal(event):
            return


async def sse_lines(
    events: AsyncIterator[Event], starting_after: int | None = None
) -> AsyncIterator[str]:
    """`event: <type>` and `data: <json>` per event, as OpenAI streams them; with
    `starting_after`, only the events numbered after it."""
    async for event in events:
        if starting_after is not None and event["sequence_number"] <= starting_after:
            continue
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        yield f"event: {event['type']}\ndata: {data}\n\n"


# -- the streams of a turn and of a stateless generation ---------------------------------------


def final_stored(state: AppState, message: MessageRecord) -> FinalResponse:
    async def final(event: TurnEvent) -> ResponseObject:
        stored = await state.store.get_message(message.conversation_id, message.id)
        if stored is None or stored.status == "generating":  # ended without a stored reply
            reason = event.message if isinstance(event, TurnFailed) else "the turn ended"
            status = event.status if isinstance(event, TurnFailed) else 500
            return response_object(
                Reply.of(message), state.runtime.model_name, failure=APIError(status, reason)
            )
        return stored_response(state, stored)

    return final


async def watched(state: AppState, turn: Turn) -> AsyncIterator[Event]:
    turn.watch()
    try:
        async for event in response_events(
            turn.events(),
            skeleton(state, turn.assistant_message),
            turn.message_id,
            final_stored(state, turn.assistant_message),
            state.runtime.tokenizer,
        ):
            yield event
    finally:
        turn.unwatch(None if state.shutting_down else state.settings.ws_grace_period)


async def drained(generation: Generation) -> tuple[Generated, list[TokenLogprob]]:
    """The generation's result, and the logprobs of its text (as its stream gives them)."""
    shown = generation.shown_logprobs()
    logprobs: list[TokenLogprob] = []
    async for event in generation.events():
        if isinstance(event, TextDelta):
            logprobs += shown.of(event)
        elif isinstance(event, Done):
            return event.result, logprobs
    raise AssertionError("a generation ends with Done")


async def stateless_stream(state: AppState, stateless: Stateless) -> AsyncIterator[Event]:
    """A stateless generation's events as a turn's, then as the stream's; the generation is
    stopped if the client leaves."""
    generation = stateless.generation
    model = state.runtime.model_name
    failure: list[str] = []

    async def turn_events() -> AsyncIterator[TurnEvent]:
        message_id = stateless.id
        yield TurnStarted(message_id, None)
        offset = 0
        shown = generation.shown_logprobs()
        try:
            async for event in generation.events():
                if isinstance(event, TextDelta):
                    logprobs = shown.of(event)
                    if not event.text:
                        continue
                    yield TurnDelta(message_id, event.text, offset, logprobs)
                    offset += len(event.text)
                elif isinstance(event, ToolDelta):
                    yield TurnToolCall(
                        message_id, event.index, event.id, event.name, event.arguments
                    )
        except Exception as e:  # the engine failed mid-stream: a failed response
            error = engine_failure(e)
            failure.append(error.message)
            yield TurnFailed(message_id, error.code or "engine_error", error.message)
            return
        result = generation.result
        remember(state, stateless, result)  # before the client has the end and sends again
        yield TurnDone(message_id, "complete", result.finish_reason, {}, {})

    async def final(event: TurnEvent) -> ResponseObject:
        return response_object(
            Reply.generated(stateless, generation.result, failure[0] if failure else None), model
        )

    finished = False
    try:
        async for event in response_events(
            turn_events(),
            response_object(Reply.generated(stateless, None), model),
            stateless.id,
            final,
            state.runtime.tokenizer,
        ):
            yield event
        finished = True
    finally:
        if not finished:
            generation.stop()
