"""What operators see and change: where the KV memory goes, each session's budget and policy
(stored on the conversation, applied at its next turn, kept across restarts), evictions, the
defaults of new sessions.

A session is a conversation's (its id, `conv_...`) or a stateless one of `POST
/v1/chat/completions` with `X-Session-Id` (`sess_...`, see app.turns.prompting.session_key):
that one has no stored settings and no history on the server, only its engine state and
budget."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from memory.config import SessionBudget
from history import HistoryPolicy

from app.errors import invalid_request, not_found
from app.coord.leases import lease_name
from app.schemas.conversations import (
    InvalidSessionSettings,
    SessionSettings,
    check_session_settings,
)
from app.state import AppState
from app.store import OVERRIDE_FIELDS, ConversationRecord
from app.turns.pipeline import context_budget, history_policy, session_budget
from app.turns.prompting import STATELESS_SESSION_PREFIX

TIERS = {"resident": "gpu", "offloaded": "host", "active": "gpu", "empty": None}


def memory(state: AppState) -> dict[str, Any]:
    engine = state.runtime.engine
    report = engine.memory_report()
    stats: dict[str, Any] = report["stats"]  # type: ignore[assignment]
    per_block = engine.layout.bytes_per_block
    block_size = int(report["block_size"])  # type: ignore[call-overload]
    allocated, filled = engine.kv_slot_usage()
    sessions = []
    for session_id in engine.session_ids():
        info = engine.session_info(session_id)
        if info is None:
            continue
        stateless = is_stateless(session_id)
        sessions.append({
            "session_id": session_id,
            "kind": "stateless" if stateless else "conversation",
            "conversation_id": None if stateless else session_id,
            "state": info["state"],
            "tier": TIERS.get(str(info["state"])),
            "tokens": info["tokens"],
            "device_blocks": info["device_blocks"],
            "host_blocks": info["host_blocks"],
            "turns": info["turns"],
            "idle_seconds": info["idle_seconds"],
            "budget": {"max_kv_tokens": info["max_kv_tokens"],
                       "max_context_tokens": info["max_context_tokens"]},
            "history": info["history"],
        })
    used = int(report["used_blocks"])  # type: ignore[call-overload]
    host_total = int(report["num_host_blocks"])  # type: ignore[call-overload]
    host_used = int(report["used_host_blocks"])  # type: ignore[call-overload]
    total = int(report["num_blocks"])  # type: ignore[call-overload]
    pinned = int(report["pinned_blocks"])  # type: ignore[call-overload]
    return {
        "object": "memory",
        "kv_cache_dtype": report["kv_cache_dtype"],
        "bytes_per_token": report["bytes_per_token"],
        "pool": {
            "block_size": block_size,
            "num_blocks": total,
            "used_blocks": used,
            "pinned_blocks": pinned,
            "free_blocks": int(report["free_blocks"]),  # type: ignore[call-overload]
            "cached_blocks": report["cached_blocks"],
            "usage": report["kv_cache_usage"],
            "bytes": total * per_block,
            "used_bytes": used * per_block,
            "tokens": total * block_size,
            "used_tokens": filled,
            "allocated_tokens": allocated,
        },
        "host_pool": {
            "num_blocks": host_total,
            "used_blocks": host_used,
            "bytes": host_total * per_block,
            "used_bytes": host_used * per_block,
        },
        "requests": {"running": report["num_running"], "waiting": report["num_waiting"],
                     "swapped": report["num_swapped"]},
        "sessions": sessions,
        "prefix_cache": {
            "queries": stats["prompt_tokens"],
            "hits": stats["from_prefix_cache"],
            "hit_rate": (stats["from_prefix_cache"] / stats["prompt_tokens"]
                         if stats["prompt_tokens"] else 0.0),
            "reuse_rate": stats["hit_rate"],
        },
        "prefill_sources": {
            "computed": stats["computed"],
            "session": stats["from_session"],
            "prefix_cache": stats["from_prefix_cache"],
            "host": stats["from_host"],
            "recomputed": stats["recomputed"],
        },
        "evictions": {"offloads": stats["session_offloads"], "drops": stats["session_drops"],
                      "restores": stats["session_restores"]},
        "preemptions": {"swap": stats["preemptions_swap"],
                        "recompute": stats["preemptions_recompute"]},
        "kv_bytes_moved": (stats["blocks_to_host"] + stats["blocks_from_host"]) * per_block,
        "history": report["history"],
        "defaults": dataclasses.asdict(state.defaults),
        "replica": state.replica_id,
    }


def is_stateless(session_id: str) -> bool:
    return session_id.startswith(STATELESS_SESSION_PREFIX)


async def conversation(state: AppState, conversation_id: str) -> ConversationRecord:
    conv = await state.store.find_conversation(conversation_id)
    if conv is None:
        raise not_found(f"conversation {conversation_id!r}")
    return conv


def engine_session(state: AppState, session_id: str) -> dict[str, Any]:
    """A stateless session as the engine holds it; 404 for one it does not know (never used,
    or gone with a restart)."""
    info = state.runtime.engine.session_info(session_id)
    if info is None:
        raise not_found(f"session {session_id!r}")
    return info


async def session(state: AppState, session_id: str) -> dict[str, Any]:
    """A session's settings (as stored), what is in effect, its engine state and lease holder.
    `error` says why a turn would be refused (the stored settings do not fit together or with
    the defaults; `effective` then shows what the views fall back to); PUT repairs it."""
    if is_stateless(session_id):
        return stateless_session(state, session_id)
    conv = await conversation(state, session_id)
    policy = history_policy(state, conv)
    error = None
    try:
        check_session_settings(conv.overrides, {}, dataclasses.asdict(state.defaults))
    except InvalidSessionSettings as e:
        error = {"param": e.field, "message": str(e)}
    return {
        "object": "session",
        "session_id": conv.id,
        "kind": "conversation",
        "conversation_id": conv.id,
        "owner": conv.owner,
        "settings": {f: getattr(conv, f) for f in OVERRIDE_FIELDS},
        "effective": {
            "max_context_tokens": context_budget(state, conv),
            "max_kv_tokens": session_budget(state, conv).max_kv_tokens,
            "history_policy": policy.policy,
            "high_watermark": policy.high_watermark,
            "low_watermark": policy.low_watermark,
            "max_tool_result_tokens": policy.max_tool_result_tokens,
            "max_summary_tokens": policy.max_summary_tokens,
        },
        "error": error,
        "engine": state.runtime.engine.session_info(conv.id),
        "lease_holder": await state.coord.lease_holder(lease_name(conv.id)),
    }


def stateless_session(state: AppState, session_id: str) -> dict[str, Any]:
    """A stateless session: nothing stored, its budget the engine's (in effect from its next
    call)."""
    info = engine_session(state, session_id)
    limit = state.runtime.max_model_len
    context = info["max_context_tokens"]
    return {
        "object": "session",
        "session_id": session_id,
        "kind": "stateless",
        "conversation_id": None,
        "owner": None,
        "settings": {},
        "effective": {
            "max_context_tokens": min(limit, context) if context else limit,
            "max_kv_tokens": info["max_kv_tokens"],
        },
        "error": None,
        "engine": info,
        "lease_holder": None,
    }


async def update_session(
    state: AppState, session_id: str, body: SessionSettings
) -> dict[str, Any]:
    """Store the settings on the conversation (they survive restarts) and give the engine
    the new budget: it applies at the session's next turn. The settings are checked as they
    will be, stored and new together over the defaults (400 naming the field, nothing
    written). A stateless session takes only a budget (update_stateless)."""
    if is_stateless(session_id):
        return update_stateless(state, session_id, body)
    conv = await conversation(state, session_id)
    fields = body.model_dump(exclude_unset=True)
    if fields:
        check_session_settings(conv.overrides, fields, dataclasses.asdict(state.defaults))
    updated = await state.store.update_conversation(conv.owner, conv.id, **fields)
    if updated is None:  # deleted meanwhile
        raise not_found(f"conversation {session_id!r}")
    state.runtime.engine.set_session_budget(conv.id, session_budget(state, updated))
    return await session(state, session_id)


STATELESS_SETTINGS = ("max_kv_tokens", "max_context_tokens")


def update_stateless(state: AppState, session_id: str, body: SessionSettings) -> dict[str, Any]:
    """Give a stateless session's engine session a new budget, from its next call: the fields
    set replace the current ones (null: the server default). Held in this process only, not
    stored: a restart forgets it. History settings do not apply (the client sends its whole
    history each call, nothing is planned): a value for one is a 400 naming the field (null,
    as an editor sends for every field left empty, is nothing to change)."""
    info = engine_session(state, session_id)
    fields = body.model_dump(exclude_unset=True)
    for name, value in fields.items():
        if name not in STATELESS_SETTINGS and value is not None:
            raise invalid_request(
                f"{name} does not apply to a stateless session (its client sends the whole "
                f"history each call); it takes {' and '.join(STATELESS_SETTINGS)}", name,
            )
    budget = {name: info[name] for name in STATELESS_SETTINGS}
    for name in STATELESS_SETTINGS:
        if name in fields:
            value = fields[name]
            budget[name] = getattr(state.defaults, name) if value is None else value
    state.runtime.engine.set_session_budget(session_id, SessionBudget(**budget))
    return stateless_session(state, session_id)


async def evict(state: AppState, session_id: str, offload: bool) -> dict[str, Any]:
    """Move the session's KV to the host pool (offload) or drop it; waits for the engine."""
    stateless = is_stateless(session_id)
    if stateless:
        engine_session(state, session_id)
    else:
        session_id = (await conversation(state, session_id)).id
    engine = state.runtime.engine
    before = engine.session_info(session_id)
    engine.evict_session(session_id, offload=offload)
    state.runtime.notify()
    deadline = time.monotonic() + 5.0
    after = before
    while time.monotonic() < deadline:
        after = engine.session_info(session_id)
        if after is None or before is None or after["state"] != before["state"]:
            break
        if not engine.has_unfinished_requests():  # the step ran: nothing more will change
            await asyncio.sleep(0.05)
            after = engine.session_info(session_id)
            break
        await asyncio.sleep(0.02)
    state_after = None if after is None else after["state"]
    if not stateless and state_after in (None, "empty") and state.leases is not None:
        await state.leases.release(session_id)
    return {
        "object": "session.eviction",
        "session_id": session_id,
        "kind": "stateless" if stateless else "conversation",
        "conversation_id": None if stateless else session_id,
        "before": None if before is None else before["state"],
        "state": state_after,
    }


REQUIRED_DEFAULTS = ("history_policy", "high_watermark", "low_watermark", "max_summary_tokens")


def update_defaults(state: AppState, body: SessionSettings) -> dict[str, Any]:
    """Defaults of sessions that set none of their own, from their next turn on (this
    process; every replica takes its own). A conversation whose own settings no longer fit
    the new defaults (its low_watermark above the new high one) keeps them: its next turn is
    refused, 400 naming its field, until PATCH or PUT repairs it."""
    fields = body.model_dump(exclude_unset=True)
    for name in REQUIRED_DEFAULTS:
        if name in fields and fields[name] is None:
            raise invalid_request(f"{name} cannot be unset: give a value", name)
    defaults = dataclasses.replace(state.defaults, **fields)
    HistoryPolicy(  # raises, naming the field, on a bad combination
        policy=defaults.history_policy, high_watermark=defaults.high_watermark,
        low_watermark=defaults.low_watermark,
        max_tool_result_tokens=defaults.max_tool_result_tokens,
        max_summary_tokens=defaults.max_summary_tokens,
    )
    state.defaults = defaults
    return dataclasses.asdict(state.defaults)
