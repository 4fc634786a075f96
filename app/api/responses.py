"""OpenAI's Responses API on kvchat's stored conversations (app/transports/responses.py):
create, retrieve (or resume its stream), delete, cancel, list its input items."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request

from kvchat.app.deps import CurrentKey, RateLimitedKey, StateDep
from kvchat.app.schemas.response_items import ItemList
from kvchat.app.schemas.responses import (
    ResponseCreate,
    ResponseDeleted,
    ResponseObject,
)
from kvchat.app.schemas.streams import event_stream
from kvchat.app.transports import responses

router = APIRouter(prefix="/v1/responses", tags=["responses"])

STREAM = event_stream(
    "The response object, or with stream=true its events (SSE: "
    "response.created ... response.completed).",
    data="A Responses API event (JSON); the event's name is its `type`.",
)
Order = Annotated[
    Literal["asc", "desc"], Query(description="By creation; OpenAI's default is desc.")
]
Limit = Annotated[int, Query(ge=1, le=100)]
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        description="A retry with the same key and body gets the first request's response.",
    ),
]


@router.post("", response_model=ResponseObject, responses=STREAM)
async def create_response(
    body: ResponseCreate,
    request: Request,
    key: RateLimitedKey,
    state: StateDep,
    idempotency_key: IdempotencyKey = None,
) -> Any:
    return await responses.create(state, key, body, request, idempotency_key)


@router.get("/{response_id}", response_model=ResponseObject, responses=STREAM)
async def get_response(
    response_id: str,
    key: CurrentKey,
    state: StateDep,
    stream: bool = False,
    starting_after: Annotated[
        int | None,
        Query(ge=0, description="With stream=true: the sequence number of the last event seen."),
    ] = None,
) -> Any:
    if stream:
        return await responses.resume(state, key.owner, response_id, starting_after)
    message = await responses.find_response(state, key.owner, response_id)
    return responses.stored_response(state, message)


@router.delete("/{response_id}", response_model=ResponseDeleted)
async def delete_response(response_id: str, key: CurrentKey, state: StateDep) -> ResponseDeleted:
    await responses.delete(state, key.owner, response_id)
    return ResponseDeleted(id=response_id)


@router.post("/{response_id}/cancel", response_model=ResponseObject)
async def cancel_response(response_id: str, key: CurrentKey, state: StateDep) -> ResponseObject:
    return await responses.cancel(state, key.owner, response_id)


@router.get("/{response_id}/input_items", response_model=ItemList)
async def list_input_items(
    response_id: str,
    key: CurrentKey,
    state: StateDep,
    order: Order = "desc",
    after: str | None = None,
    limit: Limit = 20,
) -> ItemList:
    return await responses.input_items(
        state, key.owner, response_id, order=order, after=after, limit=limit
    )
