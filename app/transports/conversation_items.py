"""OpenAI's Conversations API items on kvchat's conversations (the same tables, the same
conversations: one made either way is usable both ways). A conversation's items are its
current branch, root to leaf, as items (app/transports/response_items.py says which message
is which item). Items added go after the current leaf, which moves to the last one; an item
taken out leaves the rest of the tree in place (a message's children move up to its parent;
one call of an assistant message is taken out of its calls, which drops the reply's exact
token ids: the next turn renders it from its text)."""

from __future__ import annotations

from typing import Any

from kvchat.app.deps import AppState
from kvchat.app.errors import APIError, busy, not_found
from kvchat.app.schemas.conversations import ROOT, ConversationCreate
from kvchat.app.schemas.response_items import ItemList, parse_items
from kvchat.app.store import ConversationRecord
from kvchat.app.transports.response_items import (
    branch_items,
    call_ids,
    item_by_ref,
    joined,
    page,
    parse_item_id,
    split_system,
    store_messages,
    to_messages,
)
from kvchat.app.turns.service import lock_key
from kvchat.inference import ChatMessage

BUSY = "A reply is being generated in this conversation; wait for it or stop it."


def _format(state: AppState) -> str | None:
    return state.runtime.template.tool_call_format


async def conversation(state: AppState, owner: str, conversation_id: str) -> ConversationRecord:
    conv = await state.store.get_conversation(owner, conversation_id)
    if conv is None:
        raise not_found(f"conversation {conversation_id!r}")
    return conv


async def _check_idle(state: AppState, conv: ConversationRecord) -> None:
    """409 while a turn (or a delete) holds the conversation: its branch is being read."""
    if await state.coord.lock_holder(lock_key(conv.id)) is not None:
        raise busy(BUSY)


def messages_of(
    raw: list[Any], param: str, known_calls: set[str]
) -> tuple[str | None, list[ChatMessage]]:
    """The items' leading system and developer messages (joined) and the others."""
    return split_system(to_messages(parse_items(raw, param), param, known_calls), param)


async def create_conversation(
    state: AppState, owner: str, body: ConversationCreate, settings: dict[str, Any]
) -> ConversationRecord:
    """A new conversation with kvchat's fields and, as OpenAI's API takes them, its first
    `items` (checked before anything is stored; leading system and developer items join
    `system` as its system prompt)."""
    system, messages = messages_of(body.items, "items", set()) if body.items else (None, [])
    conv = await state.store.create_conversation(
        owner,
        title=body.title,
        system_prompt=joined(body.system, system),
        metadata=body.metadata or {},
        **settings,
    )
    if messages:
        await store_messages(state, conv.id, ROOT, messages, move_leaf=True)
        conv = await conversation(state, owner, conv.id)
    return conv


async def update_metadata(
    state: AppState, owner: str, conversation_id: str, metadata: dict[str, Any]
) -> ConversationRecord:
    updated = await state.store.update_conversation(owner, conversation_id, metadata=metadata)
    if updated is None:
        raise not_found(f"conversation {conversation_id!r}")
    return updated


async def list_items(
    state: AppState,
    owner: str,
    conversation_id: str,
    *,
    order: str,
    after: str | None,
    limit: int,
) -> ItemList:
    conv = await conversation(state, owner, conversation_id)
    branch = await state.store.branch(conv.id, conv.current_leaf_id)
    return page(branch_items(branch, _format(state)), order=order, after=after, limit=limit)


async def add_items(state: AppState, owner: str, conversation_id: str, raw: list[Any]) -> ItemList:
    """Store `raw` items after the current leaf; the items made, oldest first."""
    conv = await conversation(state, owner, conversation_id)
    await _check_idle(state, conv)
    branch = await state.store.branch(conv.id, conv.current_leaf_id)
    system, messages = messages_of(raw, "items", call_ids(branch))
    if system is not None:
        raise APIError(
            400,
            "system and developer messages are taken only when the "
            "conversation is created (they become its system prompt)",
            param="items.0.role",
            code="unsupported",
        )
    _, records = await store_messages(
        state, conv.id, conv.current_leaf_id or ROOT, messages, move_leaf=True
    )
    added = branch_items(records, _format(state))
    return page(added, order="asc", after=None, limit=len(added))


async def get_item(state: AppState, owner: str, conversation_id: str, item_id: str) -> Any:
    conv = await conversation(state, owner, conversation_id)
    ref = parse_item_id(item_id)
    message = await state.store.get_message(conv.id, ref.message_id) if ref else None
    item = None
    if message is not None and ref is not None:
        item = item_by_ref(message, ref, _format(state))
    if item is None:
        raise not_found(f"item {item_id!r} in this conversation", "item_id")
    return item


async def delete_item(
    state: AppState, owner: str, conversation_id: str, item_id: str
) -> ConversationRecord:
    """Take the item out (see the module's docstring); the conversation as it is now."""
    conv = await conversation(state, owner, conversation_id)
    await _check_idle(state, conv)
    await get_item(state, owner, conversation_id, item_id)  # 404 unless it is one
    ref = parse_item_id(item_id)
    assert ref is not None
    message = await state.store.get_message(conv.id, ref.message_id)
    assert message is not None
    store = state.store
    calls = list(message.tool_calls or [])
    if ref.call_index is not None:
        del calls[ref.call_index]
        keep_text, keep_calls = message.content, calls
    elif message.role == "assistant" and calls:
        keep_text, keep_calls = None, calls
    else:
        keep_text, keep_calls = None, []
    if keep_text or keep_calls:
        await store.update_message(
            message.id,
            content=keep_text,
            tool_calls=keep_calls or None,
            token_ids=None,
            num_tokens=None,
            content_tokens=None,
        )
    else:
        await store.delete_message(conv.id, message.id)
    return await conversation(state, owner, conversation_id)
