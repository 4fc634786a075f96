"""Items (the Responses and Conversations APIs' unit) onto kvchat's message tree, and back.

Ids are the stored messages' ids, so nothing is kept twice:
- a response is an assistant reply: `resp_<hex>` is message `msg_<hex>`;
- a user or system message is the item `msg_<hex>` (developer messages are stored as system
  messages: the chat template has no other role for them);
- an assistant message is its text as the item `msg_<hex>` (when it has text, or nothing else)
  and each of its tool calls as `fc_<hex>_<n>` (n: the call's index);
- a tool message is the `function_call_output` item `fco_<hex>`.

Input items become messages in order: consecutive `function_call` items (and an assistant
message right before them) are one assistant message with those tool calls, as the model
wrote them; each `function_call_output` is a tool message and must answer a call of the
branch or of the same input (400 naming its `call_id` otherwise, as OpenAI answers)."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from kvchat.app.deps import AppState
from kvchat.app.errors import APIError, invalid_request
from kvchat.app.schemas.conversations import ROOT
from kvchat.app.schemas.present import visible_text
from kvchat.app.schemas.response_items import (
    FunctionCall,
    FunctionCallItem,
    FunctionCallOutput,
    FunctionCallOutputItem,
    InputItem,
    InputMessage,
    InputText,
    Item,
    ItemList,
    MessageItem,
    OutputMessage,
    OutputText,
)
from kvchat.app.store import MessageRecord
from kvchat.inference import ChatMessage

RESPONSE_PREFIX = "resp_"
MESSAGE_PREFIX = "msg_"
CALL_PREFIX = "fc_"
OUTPUT_PREFIX = "fco_"
MAX_PAGE = 100


def response_id(message_id: str) -> str:
    return RESPONSE_PREFIX + message_id.removeprefix(MESSAGE_PREFIX)


def message_of_response(response: str) -> str | None:
    """The message id a response id names (None: not a response id)."""
    if not response.startswith(RESPONSE_PREFIX) or len(response) == len(RESPONSE_PREFIX):
        return None
    return MESSAGE_PREFIX + response.removeprefix(RESPONSE_PREFIX)


def call_item_id(message_id: str, index: int) -> str:
    return f"{CALL_PREFIX}{message_id.removeprefix(MESSAGE_PREFIX)}_{index}"


@dataclass(frozen=True)
class ItemRef:
    """Where an item id points: a message, and for a tool call its index."""

    message_id: str
    call_index: int | None = None
    is_output: bool = False


def parse_item_id(item_id: str) -> ItemRef | None:
    if item_id.startswith(OUTPUT_PREFIX):
        return ItemRef(MESSAGE_PREFIX + item_id.removeprefix(OUTPUT_PREFIX), is_output=True)
    if item_id.startswith(CALL_PREFIX):
        hex_id, _, index = item_id.removeprefix(CALL_PREFIX).rpartition("_")
        if not hex_id or not index.isdigit():
            return None
        return ItemRef(MESSAGE_PREFIX + hex_id, int(index))
    if item_id.startswith(MESSAGE_PREFIX):
        return ItemRef(item_id)
    return None


# -- stored messages as items ---------------------------------------------------------------------


def item_status(message: MessageRecord) -> str:
    if message.status == "generating":
        return "in_progress"
    if message.status == "complete" and message.finish_reason != "length":
        return "completed"
    return "incomplete"


def items_of(message: MessageRecord, tool_format: str | None = None) -> list[Item]:
    """The items one stored message is (see the module's docstring); `tool_format`: the
    template's tool-call format (visible_text)."""
    if message.role in ("user", "system"):
        return [
            InputMessage(
                id=message.id,
                role=message.role,  # type: ignore[arg-type]
                content=[InputText(text=message.content or "")],
            )
        ]
    if message.role == "tool":
        return [
            FunctionCallOutput(
                id=OUTPUT_PREFIX + message.id.removeprefix(MESSAGE_PREFIX),
                call_id=message.tool_call_id or "",
                output=message.content or "",
            )
        ]
    status = item_status(message)
    items: list[Item] = []
    calls = message.tool_calls or []
    text = visible_text(message, tool_format)
    if text or (text is not None and not calls):  # a reply that wrote nothing: no item
        items.append(
            OutputMessage(
                id=message.id,
                status=status,  # type: ignore[arg-type]
                content=[OutputText(text=text or "")],
            )
        )
    for index, call in enumerate(calls):
        function = call.get("function", {})
        items.append(
            FunctionCall(
                id=call_item_id(message.id, index),
                call_id=call.get("id", ""),
                name=function.get("name", ""),
                arguments=function.get("arguments", ""),
                status=status,
            )
        )  # type: ignore[arg-type]
    return items


def item_by_ref(message: MessageRecord, ref: ItemRef, tool_format: str | None) -> Item | None:
    """The item `ref` names in `message`, if it is one."""
    items = items_of(message, tool_format)
    wanted = (
        call_item_id(message.id, ref.call_index)
        if ref.call_index is not None
        else OUTPUT_PREFIX + message.id.removeprefix(MESSAGE_PREFIX)
        if ref.is_output
        else message.id
    )
    return next((item for item in items if item.id == wanted), None)


def page(items: Sequence[Item], *, order: str, after: str | None, limit: int) -> ItemList:
    """One page of `items` (oldest first as given): in `order` (asc, desc), after the item
    `after` (400 when it is not one of them), at most `limit`."""
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if after is not None:
        ids = [item.id for item in ordered]
        if after not in ids:
            raise invalid_request(f"after names no item of this list: {after!r}", "after")
        start = ids.index(after) + 1
    chosen = ordered[start : start + limit]
    return ItemList(
        data=chosen,
        first_id=chosen[0].id if chosen else None,
        last_id=chosen[-1].id if chosen else None,
        has_more=start + limit < len(ordered),
    )


def branch_items(messages: Iterable[MessageRecord], tool_format: str | None) -> list[Item]:
    return [item for m in messages for item in items_of(m, tool_format)]


# -- input items as messages ----------------------------------------------------------------------


def to_messages(
    items: Sequence[InputItem], param: str, known_calls: Collection[str]
) -> list[ChatMessage]:
    """Input items as the messages to store, in order (see the module's docstring).
    `known_calls`: the call ids of the branch the items continue."""
    out: list[ChatMessage] = []
    calls = set(known_calls)
    for i, item in enumerate(items):
        where = f"{param}.{i}"
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append(ChatMessage(role, item.text))
        elif isinstance(item, FunctionCallItem):
            call = _call(item, where)
            if item.call_id in calls:
                raise invalid_request(
                    f"a function_call with call_id {item.call_id!r} was already given",
                    f"{where}.call_id",
                )
            calls.add(item.call_id)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # the same assistant turn
                out[-1] = ChatMessage(
                    "assistant", last.content, tool_calls=(*(last.tool_calls or ()), call)
                )
            else:
                out.append(ChatMessage("assistant", None, tool_calls=(call,)))
        else:
            assert isinstance(item, FunctionCallOutputItem)
            if item.call_id not in calls:
                raise invalid_request(
                    f"No tool call found for function call output with call_id {item.call_id}.",
                    f"{where}.call_id",
                )
            out.append(ChatMessage("tool", item.text, tool_call_id=item.call_id))
    return out


def joined(*texts: str | None) -> str | None:
    """System prompts one after the other (None when there are none)."""
    present = [t for t in texts if t]
    return "\n\n".join(present) if present else None


def split_system(
    messages: Sequence[ChatMessage], param: str
) -> tuple[str | None, list[ChatMessage]]:
    """The leading system (and developer) messages joined, and the rest. kvchat keeps one
    system prompt per conversation (or turn), so they are taken only at the start; later
    ones are a 400 naming the item."""
    head = 0
    while head < len(messages) and messages[head].role == "system":
        head += 1
    for i, m in enumerate(messages[head:], start=head):
        if m.role == "system":
            raise APIError(
                400,
                "system and developer messages are taken only at the start of "
                "the input (they become the system prompt)",
                param=f"{param}.{i}.role",
                code="unsupported",
            )
    system = "\n\n".join(m.content or "" for m in messages[:head]) if head else None
    return system, list(messages[head:])


def _call(item: FunctionCallItem, where: str) -> dict[str, object]:
    try:
        arguments = json.loads(item.arguments)
    except json.JSONDecodeError as e:
        raise invalid_request(
            f"function_call arguments must be a JSON object: {e.msg}", f"{where}.arguments"
        ) from e
    if not isinstance(arguments, dict):
        raise invalid_request("function_call arguments must be a JSON object", f"{where}.arguments")
    return {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }


def call_ids(branch: Iterable[MessageRecord]) -> set[str]:
    return {str(c.get("id")) for m in branch for c in (m.tool_calls or ())}


async def store_messages(
    state: AppState,
    conversation_id: str,
    parent_id: str,
    messages: Sequence[ChatMessage],
    *,
    move_leaf: bool,
) -> tuple[str, list[MessageRecord]]:
    """Store `messages` as a chain under `parent_id` (ROOT: a new root), in order, in one
    transaction; returns the last one's id (or `parent_id` when there are none) and the
    records."""
    parent: str | None = None if parent_id == ROOT else parent_id
    records = await state.store.add_chain(
        conversation_id,
        parent,
        [
            {
                "role": m.role,
                "content": m.content,
                "tool_calls": list(m.tool_calls) if m.tool_calls else None,
                "tool_call_id": m.tool_call_id,
            }
            for m in messages
        ],
        move_leaf=move_leaf,
    )
    if records:
        parent = records[-1].id
    return (parent or ROOT), records
