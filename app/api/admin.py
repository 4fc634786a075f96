"""Operator routes (admin keys only): memory, per-session budgets and policy, eviction, the
defaults of new sessions."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from app.ops import operators
from app.schemas.conversations import SessionSettings
from app.state import AdminKey, StateDep

router = APIRouter(prefix="/v1/admin", tags=["admin"])


@router.get("/memory")
async def memory(key: AdminKey, state: StateDep) -> dict[str, Any]:
    """Pool and host pool usage, pinned sessions, prefix-cache hit rate, where prefill tokens
    came from, evictions, offloads, preemptions, trims and summaries."""
    return operators.memory(state)


@router.get("/sessions/{conversation_id}")
async def get_session(conversation_id: str, key: AdminKey, state: StateDep) -> dict[str, Any]:
    return await operators.session(state, conversation_id)


@router.put("/sessions/{conversation_id}")
async def put_session(
    conversation_id: str, body: SessionSettings, key: AdminKey, state: StateDep
) -> dict[str, Any]:
    """Set max_context_tokens, max_kv_tokens, history_policy, watermarks,
    max_tool_result_tokens, max_summary_tokens (null: back to the default). Stored on the
    conversation; applied at the session's next turn. Checked with what the conversation
    stores and the defaults (400 naming the field, nothing written)."""
    return await operators.update_session(state, conversation_id, body)


@router.post("/sessions/{conversation_id}/evict")
async def evict(
    conversation_id: str,
    key: AdminKey,
    state: StateDep,
    offload: Annotated[bool, Query(description="Move to the host pool (else drop).")] = True,
) -> dict[str, Any]:
    return await operators.evict(state, conversation_id, offload)


@router.get("/defaults")
async def get_defaults(key: AdminKey, state: StateDep) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(state.defaults)


@router.put("/defaults")
async def put_defaults(body: SessionSettings, key: AdminKey, state: StateDep) -> dict[str, Any]:
    """The budget and history policy of sessions that set none of their own."""
    return operators.update_defaults(state, body)
