"""Operator routes (admin keys only): memory, the sessions and what the retention policy makes
of each, per-session budgets, retention and policy, eviction, the defaults of new sessions."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from kvchat.app.deps import AdminKey, StateDep
from kvchat.app.schemas.admin import (
    AdminSession,
    EngineReport,
    MemoryReportOut,
    SessionEvictionOut,
    SessionList,
)
from kvchat.app.session_settings import SessionSettings
from kvchat.app.transports import operators

router = APIRouter(prefix="/v1/admin", tags=["admin"])


@router.get("/memory", response_model=MemoryReportOut)
async def memory(key: AdminKey, state: StateDep) -> dict[str, Any]:
    """Pool and host pool usage, pinned sessions (each with its `session_id` and `kind`:
    `conversation`, or `stateless` for an `X-Session-Id` of chat completions), prefix-cache
    hit rate, where prefill tokens came from, evictions, offloads, preemptions, trims and
    summaries."""
    return await operators.memory(state)


@router.get("/engine", response_model=EngineReport)
async def engine(key: AdminKey, state: StateDep) -> dict[str, Any]:
    """How this replica runs the model: dtype, device, attention backend, the CPU, and the
    paths its linear layers took (measured at start-up), with the probe's timings."""
    return operators.engine_report(state)


@router.get("/sessions", response_model=SessionList)
async def list_sessions(key: AdminKey, state: StateDep) -> dict[str, Any]:
    """Every session this replica's engine knows, as `GET /memory` lists them: each one's
    state, tier (device, host, disk, none), class (agent or person), predicted wait for its
    next turn, the value of its KV, whether it is held, its budget and history counters."""
    return await operators.sessions(state)


@router.get("/sessions/{session_id}", response_model=AdminSession)
async def get_session(session_id: str, key: AdminKey, state: StateDep) -> dict[str, Any]:
    """A conversation's session (its id) or a stateless one (`sess_...`, as `GET /memory`
    lists it): settings stored and in effect, why a turn would be refused (`error`), the
    engine's state."""
    return await operators.session(state, session_id)


@router.put("/sessions/{session_id}", response_model=AdminSession)
async def put_session(
    session_id: str, body: SessionSettings, key: AdminKey, state: StateDep
) -> dict[str, Any]:
    """Set max_context_tokens, max_kv_tokens, history_policy, watermarks,
    max_tool_result_tokens, max_summary_tokens, retention_ttl_s, retention_priority (null: back
    to the default). Stored on the conversation; applied at the session's next turn. Checked
    with what the conversation stores and the defaults (400 naming the field, nothing written).

    A stateless session (`sess_...`) takes max_kv_tokens, max_context_tokens, retention_ttl_s
    and retention_priority only, applied to its engine session from its next call and held by
    this process, not stored (a restart forgets them); a history setting is a 400 naming the
    field, since its client sends the whole history each call."""
    return await operators.update_session(state, session_id, body)


@router.post("/sessions/{session_id}/evict", response_model=SessionEvictionOut)
async def evict(
    session_id: str,
    key: AdminKey,
    state: StateDep,
    offload: Annotated[bool, Query(description="Move to the host pool (else drop).")] = True,
) -> dict[str, Any]:
    """Move an idle session's KV (a conversation's or a stateless one's) to the host pool, or
    drop it; its next turn restores or recomputes it."""
    return await operators.evict(state, session_id, offload)


@router.get("/defaults", response_model=SessionSettings)
async def get_defaults(key: AdminKey, state: StateDep) -> dict[str, Any]:
    return state.defaults.model_dump()


@router.put("/defaults", response_model=SessionSettings)
async def put_defaults(body: SessionSettings, key: AdminKey, state: StateDep) -> dict[str, Any]:
    """The budget, retention and history policy of sessions that set none of their own."""
    return operators.update_defaults(state, body)
