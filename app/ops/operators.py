"""What operators see and change: where the KV memory goes, each session's budget and policy
(stored on the conversation, applied at its next turn, kept across restarts), evictions, the
defaults of new sessions."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from memory.history import HistoryPolicy

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
        sessions.append({
            "conversation_id": session_id,
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


async def conversation(state: AppState, conversation_id: str) -> ConversationRecord:
    conv = await state.store.find_conversation(conversation_id)
    if conv is None:
        raise not_found(f"conversation {conversation_id!r}")
    return conv


async def session(state: AppState, conversation_id: str) -> dict[str, Any]:
    """A session's settings (as stored), what is in effect, its engine state and lease holder.
    `error` says why a turn would be refused (the stored settings do not fit together or with
    the defaults; `effective` then shows what the views fall back to); PUT repairs it."""
    conv = await conversation(state, conversation_id)
    policy = history_policy(state, conv)
    error = None
    try:
        check_session_settings(conv.overrides, {}, dataclasses.asdict(state.defaults))
    except InvalidSessionSettings as e:
        error = {"param": e.field, "message": str(e)}
    return {
        "object": "session",
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


async def update_session(
    state: AppState, conversation_id: str, body: SessionSettings
) -> dict[str, Any]:
    """Store the settings on the conversation (they survive restarts) and give the engine
    the new budget: it applies at the session's next turn. The settings are checked as they
    will be, stored and new together over the defaults (400 naming the field, nothing
    written)."""
    conv = await conversation(state, conversation_id)
    fields = body.model_dump(exclude_unset=True)
    if fields:
        check_session_settings(conv.overrides, fields, dataclasses.asdict(state.defaults))
    updated = await state.store.update_conversation(conv.owner, conv.id, **fields)
    if updated is None:  # deleted meanwhile
        raise not_found(f"conversation {conversation_id!r}")
    state.runtime.engine.set_session_budget(conv.id, session_budget(state, updated))
    return await session(state, conversation_id)


async def evict(state: AppState, conversation_id: str, offload: bool) -> dict[str, Any]:
    """Move the session's KV to the host pool (offload) or drop it; waits for the engine."""
    conv = await conversation(state, conversation_id)
    engine = state.runtime.engine
    before = engine.session_info(conv.id)
    engine.evict_session(conv.id, offload=offload)
    state.runtime.notify()
    deadline = time.monotonic() + 5.0
    after = before
    while time.monotonic() < deadline:
        after = engine.session_info(conv.id)
        if after is None or before is None or after["state"] != before["state"]:
            break
        if not engine.has_unfinished_requests():  # the step ran: nothing more will change
            await asyncio.sleep(0.05)
            after = engine.session_info(conv.id)
            break
        await asyncio.sleep(0.02)
    state_after = None if after is None else after["state"]
    if state_after in (None, "empty") and state.leases is not None:
        await state.leases.release(conv.id)
    return {
        "object": "session.eviction",
        "conversation_id": conv.id,
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
