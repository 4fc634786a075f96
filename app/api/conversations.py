"""The conversations API: server-side history for frontends and agents that do not resend it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request

from kvchat.app.deps import CurrentKey, RateLimitedKey, StateDep
from kvchat.app.errors import invalid_request, not_found
from kvchat.app.schemas.conversations import (
    SETTINGS_FIELDS,
    ConversationCreate,
    ConversationDeleted,
    ConversationList,
    ConversationOut,
    ConversationPatch,
    MessageList,
    MessageOut,
    PostMessage,
    Regenerate,
    StopResult,
    check_session_settings,
)
from kvchat.app.schemas.present import conversation_out, message_out, newest_leaf, tree_children
from kvchat.app.schemas.streams import event_stream
from kvchat.app.store import MessageRecord
from kvchat.app.transports import conversation_items, sse
from kvchat.app.turns.events import TurnEvent
from kvchat.app.turns.idempotency import Replayed, run_once
from kvchat.app.turns.turn import Turn
from kvchat.inference import ChatMessage

router = APIRouter(prefix="/v1/conversations", tags=["conversations"])

IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]


@router.post("", response_model=ConversationOut)
async def create_conversation(
    body: ConversationCreate, key: CurrentKey, state: StateDep
) -> ConversationOut:
    """A new conversation; its settings are checked together, over the server defaults (400
    naming the field). OpenAI's Conversations API: `items` are its first items."""
    fields = body.model_dump(exclude={"title", "system", "metadata", "items"}, exclude_none=True)
    check_session_settings({}, fields, state.defaults.model_dump())
    conv = await conversation_items.create_conversation(state, key.owner, body, fields)
    return conversation_out(conv)


@router.get("", response_model=ConversationList)
async def list_conversations(
    key: CurrentKey,
    state: StateDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
) -> ConversationList:
    try:
        items, cursor = await state.store.list_conversations(key.owner, limit=limit, after=after)
    except ValueError as e:
        raise invalid_request(f"after is not a cursor this server gave: {e}", "after") from e
    return ConversationList(
        data=[conversation_out(c) for c in items], has_more=cursor is not None, next_cursor=cursor
    )


@router.get("/{conversation_id}", response_model=ConversationOut)
async def get_conversation(
    conversation_id: str, key: CurrentKey, state: StateDep
) -> ConversationOut:
    conv = await state.store.get_conversation(key.owner, conversation_id)
    if conv is None:
        raise not_found(f"conversation {conversation_id!r}")
    return conversation_out(conv)


@router.patch("/{conversation_id}", response_model=ConversationOut)
async def update_conversation(
    conversation_id: str, body: ConversationPatch, key: CurrentKey, state: StateDep
) -> ConversationOut:
    """Change what the body sets (null: back to the default). Settings are checked as they
    will be, what is stored and the change together, over the server defaults (400 naming the
    field, nothing written); a conversation whose stored settings are refused is repaired
    here. Another owner's conversation is not found, whatever the body names."""
    conv = await state.store.get_conversation(key.owner, conversation_id)
    if conv is None:
        raise not_found(f"conversation {conversation_id!r}")
    fields = body.model_dump(exclude_unset=True)
    if "system" in fields:
        fields["system_prompt"] = fields.pop("system")
    settings = {name: fields[name] for name in SETTINGS_FIELDS if name in fields}
    if settings:
        check_session_settings(conv.overrides, settings, state.defaults.model_dump())
    leaf = fields.get("current_leaf_id")
    if leaf is not None and await state.store.get_message(conversation_id, leaf) is None:
        raise not_found(f"message {leaf!r}", "current_leaf_id")
    updated = await state.store.update_conversation(key.owner, conversation_id, **fields)
    if updated is None:  # deleted meanwhile
        raise not_found(f"conversation {conversation_id!r}")
    return conversation_out(updated)


@router.delete("/{conversation_id}", response_model=ConversationDeleted)
async def delete_conversation(
    conversation_id: str, key: CurrentKey, state: StateDep
) -> dict[str, Any]:
    """Delete the conversation; a reply being generated is stopped first."""
    await state.turns.delete(key.owner, conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.get("/{conversation_id}/messages", response_model=MessageList)
async def list_messages(
    conversation_id: str,
    key: CurrentKey,
    state: StateDep,
    leaf: Annotated[
        str | None,
        Query(description="Show the branch through this message (down to its newest descendant)."),
    ] = None,
    all: Annotated[bool, Query(description="The whole tree, with parent and child ids.")] = False,
) -> MessageList:
    conv = await state.store.get_conversation(key.owner, conversation_id)
    if conv is None:
        raise not_found(f"conversation {conversation_id!r}")
    messages = await state.store.messages(conversation_id)
    children = tree_children(messages)
    fmt = state.runtime.template.tool_call_format
    if all:
        return MessageList(
            data=[
                message_out(
                    m, children.get(m.parent_id, []), children.get(m.id, []), tool_format=fmt
                )
                for m in messages
            ],
            leaf_id=conv.current_leaf_id,
        )
    by_id = {m.id: m for m in messages}
    if leaf is not None and leaf not in by_id:
        raise not_found(f"message {leaf!r}", "leaf")
    end = newest_leaf(leaf, children) if leaf is not None else conv.current_leaf_id
    path = []
    while end is not None:
        path.append(by_id[end])
        end = by_id[end].parent_id
    path.reverse()
    return MessageList(
        data=[message_out(m, children.get(m.parent_id, []), tool_format=fmt) for m in path],
        leaf_id=path[-1].id if path else None,
    )


TURN_RESPONSES = event_stream(
    "The stored assistant message "
    "(JSON), or with stream=true its events (SSE: start, delta, tool_call, done).",
    data="A turn event (JSON): its `type` is start, delta, tool_call, done or error.",
)


@router.post("/{conversation_id}/messages", response_model=MessageOut, responses=TURN_RESPONSES)
async def post_message(
    conversation_id: str,
    body: PostMessage,
    request: Request,
    key: RateLimitedKey,
    state: StateDep,
    idempotency_key: IdempotencyKey = None,
) -> Any:
    new_message = None
    text = body.text
    if text is not None:
        if body.role == "tool" and not body.tool_call_id:
            raise invalid_request("a tool message needs tool_call_id", "tool_call_id")
        new_message = ChatMessage(
            body.role,
            text,
            name=body.name,
            tool_call_id=body.tool_call_id if body.role == "tool" else None,
        )
    elif body.parent_id is None:
        raise invalid_request(
            "content is required (without it, parent_id must name the user "
            "or tool message whose reply to regenerate)",
            "content",
        )
    service = state.turns
    result = await run_once(
        state.turns,
        key.owner,
        conversation_id,
        idempotency_key,
        body.model_dump(mode="json", exclude_unset=True),
        start=lambda on_end: service.start(
            key,
            conversation_id,
            body,
            new_message=new_message,
            parent_id=body.parent_id,
            on_end=on_end,
            key_verified=True,
        ),
        rerun=lambda user_id, on_end: service.start(
            key,
            conversation_id,
            body,
            new_message=None,
            parent_id=user_id,
            on_end=on_end,
            key_verified=True,
        ),
    )
    return await _respond(state, request, result, body.stream)


@router.post("/{conversation_id}/regenerate", response_model=MessageOut, responses=TURN_RESPONSES)
async def regenerate(
    conversation_id: str,
    body: Regenerate,
    request: Request,
    key: RateLimitedKey,
    state: StateDep,
    idempotency_key: IdempotencyKey = None,
) -> Any:
    """A new reply to the message an assistant reply answered (a new sibling of that reply)."""
    service = state.turns
    parent = await service.regenerate_parent(key.owner, conversation_id, body.message_id)
    result = await run_once(
        state.turns,
        key.owner,
        conversation_id,
        idempotency_key,
        {
            "regenerate": body.message_id or parent,
            **body.model_dump(mode="json", exclude_unset=True),
        },
        start=lambda on_end: service.start(
            key,
            conversation_id,
            body,
            new_message=None,
            parent_id=parent,
            on_end=on_end,
            key_verified=True,
        ),
        rerun=lambda _user, on_end: service.start(
            key,
            conversation_id,
            body,
            new_message=None,
            parent_id=parent,
            on_end=on_end,
            key_verified=True,
        ),
    )
    return await _respond(state, request, result, body.stream)


@router.post("/{conversation_id}/stop", response_model=StopResult)
async def stop(conversation_id: str, key: CurrentKey, state: StateDep) -> dict[str, Any]:
    """Stop the reply being generated (it is stored as cancelled with what it has)."""
    stopped = await state.turns.stop(key.owner, conversation_id)
    return {"id": conversation_id, "stopped": stopped}


async def _respond(state: StateDep, request: Request, result: Turn | Replayed, stream: bool) -> Any:
    if isinstance(result, Replayed):
        message = result.message
        if stream:
            events = await state.turns.attach(message.conversation_id, message.id)
            return sse.sse_response(_frames(events))
        return await _message_out(state, message)
    turn = result
    if stream:
        return sse.sse_response(_stream(state, turn))
    final = await sse.run_unless_disconnected(request, turn.wait(), turn.stop)
    if turn.user_message is not None and final.parent_id == turn.user_message.id:
        # the new message's only reply: no siblings
        return message_out(final, [final.id], tool_format=state.runtime.template.tool_call_format)
    return await _message_out(state, final)


async def _message_out(state: StateDep, message: MessageRecord) -> MessageOut:
    siblings = [
        m.id for m in await state.store.children(message.conversation_id, message.parent_id)
    ]
    return message_out(message, siblings, tool_format=state.runtime.template.tool_call_format)


async def _frames(events: AsyncIterator[TurnEvent]) -> AsyncIterator[str]:
    async for event in events:
        yield sse.event(event.frame())


async def _stream(state: StateDep, turn: Turn) -> AsyncIterator[str]:
    finished = False
    try:
        async for event in turn.events():
            yield sse.event(event.frame())
        finished = True
    finally:
        # The client left mid-reply: stop it (the turn stores what it has). At shutdown the
        # engine's drain stops it instead, and it is stored as interrupted.
        if not finished and not state.shutting_down:
            turn.stop()
