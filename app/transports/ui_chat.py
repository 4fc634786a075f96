"""useChat's messages onto a stored conversation.

useChat resends the whole chat each time; kvchat keeps the chat as a tree of messages. A chat id
is a conversation: an owner's conversation id is used as is; any other id (useChat makes its
own) names a conversation derived from (owner, chat id), created on first use, so two owners'
chats never meet.

The request is placed on the tree by walking its messages from the root: each one is matched to
a stored child of the previous one, by id (assistant replies carry the id kvchat gave them in
the stream's `start` part) or, for a user message (useChat gives those ids of its own), by
role and text. The first message that matches nothing starts a new branch there, so an edited
message becomes a sibling of the original, as the conversations API does. Messages the server
has never seen before the new one (a history the client brings) are stored as they are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvchat.app.deps import AppState
from kvchat.app.errors import busy, invalid_request, not_found
from kvchat.app.schemas.conversations import ROOT
from kvchat.app.schemas.present import tree_children
from kvchat.app.schemas.ui_chat import UIChatRequest, UIMessage
from kvchat.app.store import ConversationRecord, KeyRecord, MessageRecord
from kvchat.app.turns.service import regenerated_parent
from kvchat.app.turns.turn import Turn
from kvchat.inference import ChatMessage

DERIVED_PREFIX = "conv_ui_"
TITLE_CHARS = 80


def derived_conversation_id(owner: str, chat_id: str) -> str:
    digest = hashlib.sha256(f"{owner}\0{chat_id}".encode()).hexdigest()
    return f"{DERIVED_PREFIX}{digest[:40]}"


async def find_chat(state: AppState, owner: str, chat_id: str) -> ConversationRecord | None:
    conv = await state.store.get_conversation(owner, chat_id)
    if conv is not None:
        return conv
    return await state.store.get_conversation(owner, derived_conversation_id(owner, chat_id))


async def create_chat(state: AppState, owner: str, request: UIChatRequest) -> ConversationRecord:
    """The conversation of a new chat, titled by its first user message, with the chat's system
    message as its system prompt."""
    system = system_prompt(request.messages)
    first_user = next((m for m in request.messages if m.role == "user"), None)
    title = text_of(first_user)[:TITLE_CHARS] if first_user is not None else None
    try:
        return await state.store.create_conversation(
            owner,
            title=title or None,
            system_prompt=system,
            metadata={"ui_chat_id": request.id},
            conversation_id=derived_conversation_id(owner, request.id),
        )
    except Exception:
        # Two first requests of one chat at once: the other one created it.
        conv = await find_chat(state, owner, request.id)
        if conv is None:
            raise
        return conv


@dataclass(frozen=True)
class Placement:
    """Where the request's turn goes: the parent of the new user message (ROOT for a new
    root), or, to regenerate, the user message whose reply is made again."""

    parent_id: str
    new_message: ChatMessage | None
    imported: tuple[UIMessage, ...]  # history the server had not seen, stored under parent


def text_of(message: UIMessage | None) -> str:
    if message is None:
        return ""
    return "".join(str(p.get("text", "")) for p in message.parts if p.get("type") == "text")


def system_prompt(messages: Sequence[UIMessage]) -> str | None:
    texts = [text_of(m) for m in messages if m.role == "system"]
    return "\n\n".join(texts) if texts else None


def check_parts(message: UIMessage, index: int) -> None:
    """Parts kvchat can take: text, and what useChat adds to replies it has received (steps,
    reasoning, tool parts) on messages the server already stores."""
    for j, part in enumerate(message.parts):
        kind = part.get("type")
        if not isinstance(kind, str):
            raise invalid_request("every part needs a string type", f"messages.{index}.parts.{j}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise invalid_request("a text part needs text", f"messages.{index}.parts.{j}.text")
        if message.role == "user" and kind != "text":
            raise invalid_request(
                f"user messages may only have text parts, not {kind!r}",
                f"messages.{index}.parts.{j}",
                code="unsupported",
            )


def check_request(request: UIChatRequest) -> int:
    """Everything about the request that needs no stored state (checked before anything is
    created or stored); returns the index of the first non-system message."""
    ui = request.messages
    for i, m in enumerate(ui):
        check_parts(m, i)
    first = next((i for i, m in enumerate(ui) if m.role != "system"), len(ui))
    if any(m.role == "system" for m in ui[first:]):
        raise invalid_request("system messages must come first", "messages")
    chat = ui[first:]
    if request.trigger == "submit-message":
        if not chat or chat[-1].role != "user":
            raise invalid_request("the last message must be the new user message", "messages")
        if not text_of(chat[-1]).strip():
            raise invalid_request("the new user message has no text", "messages")
    elif not chat and request.message_id is None:
        raise invalid_request("regenerating needs the chat's messages or messageId", "messages")
    return first


async def place(
    state: AppState, conv: ConversationRecord | None, request: UIChatRequest
) -> Placement:
    """Match the request's messages to the stored tree of `conv` (None: a chat not stored yet,
    whose conversation is made after this succeeds). Nothing is stored here."""
    ui = request.messages
    first = check_request(request)
    system = system_prompt(ui)
    if conv is not None and system is not None and system != (conv.system_prompt or ""):
        raise invalid_request(
            "the chat's system message differs from the conversation's "
            "system prompt; change it with PATCH /v1/conversations/{id}",
            "messages",
        )
    if conv is not None and state.turns.running(conv.id) is not None:
        raise busy("A reply is already being generated in this chat; wait for it or stop it.")
    stored = await state.store.messages(conv.id) if conv is not None else []
    by_id = {m.id: m for m in stored}

    if request.trigger == "regenerate-message" and request.message_id in by_id:
        return Placement(regenerated_parent(by_id[request.message_id], "messageId"), None, ())

    chat = ui[first:]
    if request.trigger == "submit-message":
        history, new = chat[:-1], chat[-1]
    else:
        history, new = chat, None

    children = tree_children(stored)
    node: str | None = None
    imported: list[UIMessage] = []
    for i, m in enumerate(history):
        match = None if imported else _match(m, children.get(node, []), by_id)
        if match is None:
            if m.role == "assistant" and any(
                p.get("type") != "text" and p.get("type") != "step-start" for p in m.parts
            ):
                raise invalid_request(
                    "an assistant message the server does not store can only have text parts",
                    f"messages.{first + i}",
                    code="unsupported",
                )
            imported.append(m)
        else:
            node = match.id
    if new is None:
        last_role = imported[-1].role if imported else (by_id[node].role if node else None)
        if last_role != "user":
            raise invalid_request(
                "regenerating needs the chat to end with a user message", "messages"
            )
    parent = node or ROOT
    message = ChatMessage("user", text_of(new)) if new is not None else None
    return Placement(parent, message, tuple(imported))


def _match(
    message: UIMessage, candidates: list[str], by_id: dict[str, MessageRecord]
) -> MessageRecord | None:
    if message.id in candidates:
        return by_id[message.id]
    text = text_of(message)
    for candidate in reversed(candidates):  # the newest sibling with the same text
        record = by_id[candidate]
        if record.role == message.role and (record.content or "") == text:
            return record
    return None


async def store_imported(state: AppState, conv: ConversationRecord, placement: Placement) -> str:
    """Store the history the client brought under the placement's parent; returns the parent
    of the turn (the last message stored, or the placement's parent)."""
    parent: str | None = None if placement.parent_id == ROOT else placement.parent_id
    for m in placement.imported:
        record = await state.store.add_message(
            conv.id,
            parent_id=parent,
            role=m.role,
            content=text_of(m),
            move_leaf=False,
        )
        parent = record.id
    return parent or ROOT


async def start_chat_turn(state: AppState, key: KeyRecord, request: UIChatRequest) -> Turn:
    """Place useChat's request on its conversation and start the turn (app/turns/service.py)."""
    owner = key.owner
    conv = await find_chat(state, owner, request.id)
    if (
        conv is None
        and request.id.startswith("conv_")
        and not request.id.startswith(DERIVED_PREFIX)
    ):
        raise not_found(f"conversation {request.id!r}", "id")
    placement = await place(state, conv, request)  # checks everything before storing
    if conv is None:
        conv = await create_chat(state, owner, request)
    parent = await store_imported(state, conv, placement)
    return await state.turns.start(
        key,
        conv.id,
        request,
        new_message=placement.new_message,
        parent_id=parent,
        key_verified=True,
    )
