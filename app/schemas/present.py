"""Stored records shaped as API responses."""

from __future__ import annotations

from collections.abc import Sequence

from kvchat.app.schemas.chat import FunctionCall, ToolCall
from kvchat.app.schemas.conversations import ConversationOut, MessageOut, MessageUsage, Timings
from kvchat.app.store import ConversationRecord, MessageRecord
from kvchat.inference import parse_tool_calls


def conversation_out(conv: ConversationRecord) -> ConversationOut:
    return ConversationOut(
        id=conv.id,
        title=conv.title,
        system=conv.system_prompt,
        metadata=conv.metadata or {},
        current_leaf_id=conv.current_leaf_id,
        created_at=int(conv.created_at.timestamp()),
        updated_at=int(conv.updated_at.timestamp()),
        max_context_tokens=conv.max_context_tokens,
        max_kv_tokens=conv.max_kv_tokens,
        history_policy=conv.history_policy,
        high_watermark=conv.high_watermark,
        low_watermark=conv.low_watermark,
        max_tool_result_tokens=conv.max_tool_result_tokens,
        max_summary_tokens=conv.max_summary_tokens,
        retention_ttl_s=conv.retention_ttl_s,
        retention_priority=conv.retention_priority,
    )


def visible_text(message: MessageRecord, tool_format: str | None) -> str | None:
    """An assistant message's text outside its tool calls. A reply that is only calls is
    stored with the text the model wrote (the calls' markup, in the template's format);
    parsed again here, that is nothing."""
    content = message.content
    if not content or not message.tool_calls or tool_format is None:
        return content
    return parse_tool_calls(content, tool_format).content


def message_out(
    m: MessageRecord,
    siblings: Sequence[str] = (),
    children: Sequence[str] | None = None,
    *,
    tool_format: str | None = None,
) -> MessageOut:
    """A stored message as the API shows it; `tool_format`: the template's tool-call format,
    so a reply's calls show as calls only, never also as the markup the model wrote."""
    usage = None
    if m.role == "assistant" and m.prompt_tokens is not None:
        prompt, completion = m.prompt_tokens or 0, m.completion_tokens or 0
        usage = MessageUsage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            cached_tokens=m.cached_tokens or 0,
        )
    timings = None
    if m.role == "assistant" and (m.ttft_ms is not None or m.total_ms is not None):
        timings = Timings(ttft_ms=m.ttft_ms, total_ms=m.total_ms)
    calls = None
    if m.tool_calls:
        calls = [
            ToolCall(
                id=c["id"],
                function=FunctionCall(
                    name=c["function"]["name"], arguments=c["function"]["arguments"]
                ),
            )
            for c in m.tool_calls
        ]
    return MessageOut(
        id=m.id,
        conversation_id=m.conversation_id,
        parent_id=m.parent_id,
        role=m.role,
        content=visible_text(m, tool_format),
        name=m.name,
        tool_calls=calls,
        tool_call_id=m.tool_call_id,
        status=m.status,
        finish_reason=m.finish_reason,
        usage=usage,
        timings=timings,
        num_tokens=m.num_tokens,
        siblings=list(siblings) or [m.id],
        children=list(children) if children is not None else None,
        created_at=m.created_at,
    )


def tree_children(messages: Sequence[MessageRecord]) -> dict[str | None, list[str]]:
    """parent id -> child ids, oldest first (messages come in creation order)."""
    children: dict[str | None, list[str]] = {}
    for m in messages:
        children.setdefault(m.parent_id, []).append(m.id)
    return children


def newest_leaf(start: str, children: dict[str | None, list[str]]) -> str:
    """Follow the newest child from `start` down to a leaf (branch switching lands there)."""
    node = start
    while children.get(node):
        node = children[node][-1]
    return node
