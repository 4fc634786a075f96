"""OpenAI's Conversations API items, on kvchat's conversations (app/transports/
conversation_items.py): list and add items, read and delete one. The conversation routes
themselves are kvchat's (app/api/conversations.py), which take OpenAI's fields too, and
OpenAI's update (POST, metadata only) is here."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from kvchat.app.deps import CurrentKey, RateLimitedKey, StateDep
from kvchat.app.schemas.conversations import ConversationOut
from kvchat.app.schemas.present import conversation_out
from kvchat.app.schemas.response_items import (
    ConversationUpdate,
    Item,
    ItemList,
    ItemsCreate,
)
from kvchat.app.transports import conversation_items

router = APIRouter(prefix="/v1/conversations", tags=["conversations"])

Order = Annotated[
    Literal["asc", "desc"],
    Query(description="By position in the conversation; OpenAI's default is desc."),
]
Limit = Annotated[int, Query(ge=1, le=100)]


@router.post("/{conversation_id}", response_model=ConversationOut)
async def update_metadata(
    conversation_id: str, body: ConversationUpdate, key: CurrentKey, state: StateDep
) -> ConversationOut:
    """OpenAI's conversation update: its metadata (kvchat's PATCH changes the rest)."""
    conv = await conversation_items.update_metadata(
        state, key.owner, conversation_id, body.metadata
    )
    return conversation_out(conv)


@router.get("/{conversation_id}/items", response_model=ItemList)
async def list_items(
    conversation_id: str,
    key: CurrentKey,
    state: StateDep,
    order: Order = "desc",
    after: str | None = None,
    limit: Limit = 20,
) -> ItemList:
    """The conversation's current branch, root to leaf, as items."""
    return await conversation_items.list_items(
        state, key.owner, conversation_id, order=order, after=after, limit=limit
    )


@router.post("/{conversation_id}/items", response_model=ItemList)
async def add_items(
    conversation_id: str, body: ItemsCreate, key: RateLimitedKey, state: StateDep
) -> ItemList:
    """Add items after the current leaf (the leaf moves to the last one); counted against the
    key's request rate (storing and tokenizing items is work per byte)."""
    return await conversation_items.add_items(state, key.owner, conversation_id, body.items)


@router.get("/{conversation_id}/items/{item_id}", response_model=Item)
async def get_item(conversation_id: str, item_id: str, key: CurrentKey, state: StateDep) -> Any:
    return await conversation_items.get_item(state, key.owner, conversation_id, item_id)


@router.delete("/{conversation_id}/items/{item_id}", response_model=ConversationOut)
async def delete_item(
    conversation_id: str, item_id: str, key: CurrentKey, state: StateDep
) -> ConversationOut:
    """Take the item out of the conversation; the conversation, as OpenAI answers."""
    conv = await conversation_items.delete_item(state, key.owner, conversation_id, item_id)
    return conversation_out(conv)
