"""What operators see and change: where the KV memory goes, each session's budget, retention and
policy (stored on the conversation, applied at its next turn, kept across restarts) and what the
engine's retention policy makes of it (its tier, class, predicted next turn, value, hold),
evictions, the defaults of new sessions.

A session is a conversation's (its id, `conv_...`) or a stateless one of `POST
/v1/chat/completions` with `X-Session-Id` (`sess_...`, see app.turns.prompting.session_key):
that one has no stored settings and no history on the server, only its engine state and
budget."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvchat.app.coord.leases import lease_name
from kvchat.app.deps import AppState
from kvchat.app.errors import invalid_request, not_found
from kvchat.app.schemas.conversations import InvalidSessionSettings, check_session_settings
from kvchat.app.session_settings import BUDGET_FIELDS, SessionSettings
from kvchat.app.store import OVERRIDE_FIELDS, ConversationRecord
from kvchat.app.turns.prompting import STATELESS_SESSION_PREFIX
from kvchat.inference import SessionInfo
from kvchat.memory import CacheStats, HistoryStats, KVStoreStats, SessionState


def engine_report(state: AppState) -> dict[str, Any]:
    """Fixed at start-up: read without a trip to the engine thread."""
    return {"object": "engine", **state.runtime.engine_client.describe()}


def retention_view(info: SessionInfo) -> dict[str, Any]:
    """What the engine's retention policy makes of the session now: its tier, class, the
    predicted wait for its next turn, the value of its KV, whether it is held."""
    return {
        "tier": info.tier,
        "class": info.klass,
        "next_turn_s": info.next_turn_s,
        "value": info.value,
        "held": info.held,
    }


def occupancy(info: SessionInfo) -> dict[str, Any]:
    """Where a session's KV is and how much of it, as every session view shows it."""
    return {
        "state": info.state.value,
        **retention_view(info),
        "tokens": info.num_tokens,
        "device_blocks": info.num_device_blocks,
        "host_blocks": info.num_host_blocks,
        "turns": info.num_turns,
        "idle_seconds": info.idle_seconds,
    }


def listed_session(info: SessionInfo, history: HistoryStats) -> dict[str, Any]:
    """A session as the listings show it (`GET /v1/admin/memory`, `GET /v1/admin/sessions`)."""
    stateless = is_stateless(info.session_id)
    return {
        "session_id": info.session_id,
        "kind": "stateless" if stateless else "conversation",
        "conversation_id": None if stateless else info.session_id,
        **occupancy(info),
        "budget": dataclasses.asdict(info.budget),
        "history": dataclasses.asdict(history),
    }


async def sessions(state: AppState) -> dict[str, Any]:
    """Every session this replica's engine knows."""
    report = await state.runtime.engine_client.memory_report()
    history = state.runtime.history
    return {
        "object": "list",
        "data": [listed_session(i, history.session(i.session_id)) for i in report.sessions],
    }


async def memory(state: AppState) -> dict[str, Any]:
    report = await state.runtime.engine_client.memory_report()
    history = state.runtime.history
    stats, cache = report.stats, report.stats.cache
    per_block, block_size = report.bytes_per_block, report.block_size
    sessions = [listed_session(i, history.session(i.session_id)) for i in report.sessions]
    return {
        "object": "memory",
        "kv_cache_dtype": report.kv_cache_dtype,
        "bytes_per_token": report.bytes_per_token,
        "pool": {
            "block_size": block_size,
            "num_blocks": stats.num_blocks,
            "used_blocks": stats.num_used_blocks,
            "pinned_blocks": stats.num_pinned_blocks,
            "free_blocks": stats.num_free_blocks,
            "cached_blocks": stats.num_cached_blocks,
            "usage": stats.kv_cache_usage,
            "bytes": stats.num_blocks * per_block,
            "used_bytes": stats.num_used_blocks * per_block,
            "tokens": stats.num_blocks * block_size,
            "used_tokens": report.slots.num_filled,
            "allocated_tokens": report.slots.num_allocated,
        },
        "host_pool": {
            "num_blocks": stats.num_host_blocks,
            "used_blocks": stats.num_used_host_blocks,
            "bytes": stats.num_host_blocks * per_block,
            "used_bytes": stats.num_used_host_blocks * per_block,
        },
        "requests": {
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "swapped": stats.num_swapped,
        },
        "sessions": sessions,
        "prefix_cache": {
            "queries": cache.prompt_tokens,
            "hits": cache.from_prefix_cache,
            "hit_rate": (
                cache.from_prefix_cache / cache.prompt_tokens if cache.prompt_tokens else 0.0
            ),
            "reuse_rate": cache.hit_rate,
        },
        "prefill_sources": {
            "computed": cache.computed,
            "session": cache.from_session,
            "prefix_cache": cache.from_prefix_cache,
            "host": cache.from_host,
            "store": cache.from_store,
            "recomputed": cache.recomputed,
        },
        "kv_store": kv_store_view(
            stats.kv_store, cache, state.settings.kv_store_path, state.settings.kv_store_bytes
        ),
        "evictions": {
            "offloads": cache.session_offloads,
            "drops": cache.session_drops,
            "restores": cache.session_restores,
        },
        "preemptions": {"swap": cache.preemptions_swap, "recompute": cache.preemptions_recompute},
        "kv_bytes_moved": (cache.blocks_to_host + cache.blocks_from_host) * per_block,
        "history": dataclasses.asdict(history.total()),
        "defaults": state.defaults.model_dump(),
        "replica": state.replica_id,
    }


def kv_store_view(
    store: KVStoreStats | None, cache: CacheStats, path: Path, max_bytes: int
) -> dict[str, Any]:
    """The KV store as operators see it (`enabled` false: no store; counters are blocks)."""
    if store is None:
        return {"enabled": False}
    return {
        "enabled": True,
        "path": str(path),
        "max_bytes": max_bytes,
        "blocks": store.num_blocks,
        "bytes": store.num_bytes,
        "hits": store.hits,
        "misses": store.misses,
        "skipped": store.skipped,
        "writes": store.writes,
        "evictions": store.evictions,
        "dropped": store.dropped,
        "pending_bytes": store.pending_bytes,
        "active": store.enabled,
        "disabled_reason": store.disabled_reason,
        "errors": [
            {"op": op, "reason": reason, "count": count}
            for (op, reason), count in sorted(store.errors.items())
        ],
        "write_seconds": store.write_seconds,
        "copy_seconds": store.copy_seconds,
        "blocks_queued": cache.blocks_to_store,
        "blocks_loaded": cache.blocks_from_store,
        "tokens_loaded": cache.from_store,
    }


def engine_view(info: SessionInfo, history: HistoryStats) -> dict[str, Any]:
    """A session's engine state as the admin API shows it, with its history counters."""
    return {
        "session_id": info.session_id,
        **occupancy(info),
        **dataclasses.asdict(info.budget),
        "history": dataclasses.asdict(history),
    }


def is_stateless(session_id: str) -> bool:
    return session_id.startswith(STATELESS_SESSION_PREFIX)


async def conversation(state: AppState, conversation_id: str) -> ConversationRecord:
    conv = await state.store.find_conversation(conversation_id)
    if conv is None:
        raise not_found(f"conversation {conversation_id!r}")
    return conv


async def engine_session(state: AppState, session_id: str) -> SessionInfo:
    """A stateless session as the engine holds it; 404 for one it does not know (never used,
    or gone with a restart)."""
    info = await state.runtime.engine_client.session_info(session_id)
    if info is None:
        raise not_found(f"session {session_id!r}")
    return info


def _engine_view(state: AppState, info: SessionInfo | None) -> dict[str, Any] | None:
    if info is None:
        return None
    return engine_view(info, state.runtime.history.session(info.session_id))


async def session(
    state: AppState, session_id: str, engine: SessionInfo | None = None
) -> dict[str, Any]:
    """A session's settings (as stored), what is in effect, its engine state (`engine` when
    the caller has it from the engine already, else asked for) and lease holder. `error`
    says why a turn would be refused (the stored settings do not fit together or with the
    defaults; `effective` then shows what the views fall back to); PUT repairs it."""
    if is_stateless(session_id):
        if engine is None:
            engine = await engine_session(state, session_id)
        return stateless_session(state, engine)
    conv = await conversation(state, session_id)
    planner = state.turns.planner
    effective = planner.session(conv)
    error = None
    try:
        check_session_settings(conv.overrides, {}, state.defaults.model_dump())
    except InvalidSessionSettings as e:
        error = {"param": e.field, "message": str(e)}
    if engine is None:
        engine = await state.runtime.engine_client.session_info(conv.id)
    return {
        "object": "session",
        "session_id": conv.id,
        "kind": "conversation",
        "conversation_id": conv.id,
        "owner": conv.owner,
        "settings": {f: getattr(conv, f) for f in OVERRIDE_FIELDS},
        "effective": {
            **effective.filled().model_dump(),
            "max_context_tokens": planner.context_budget(conv),
        },
        "error": error,
        "engine": _engine_view(state, engine),
        "lease_holder": await state.coord.lease_holder(lease_name(conv.id)),
    }


def stateless_session(state: AppState, info: SessionInfo) -> dict[str, Any]:
    """A stateless session: nothing stored, its budget the engine's (in effect from its next
    call)."""
    limit = state.runtime.max_model_len
    context = info.budget.max_context_tokens
    return {
        "object": "session",
        "session_id": info.session_id,
        "kind": "stateless",
        "conversation_id": None,
        "owner": None,
        "settings": {},
        "effective": {
            "max_context_tokens": min(limit, context) if context else limit,
            "max_kv_tokens": info.budget.max_kv_tokens,
            "retention_ttl_s": info.budget.retention_ttl_s,
            "retention_priority": info.budget.retention_priority,
        },
        "error": None,
        "engine": _engine_view(state, info),
        "lease_holder": None,
    }


async def update_session(state: AppState, session_id: str, body: SessionSettings) -> dict[str, Any]:
    """Store the settings on the conversation (they survive restarts) and give the engine
    the new budget: it applies at the session's next turn. The settings are checked as they
    will be, stored and new together over the defaults (400 naming the field, nothing
    written). A stateless session takes only a budget (update_stateless). Answers once the
    engine has the budget, with the session as the engine then holds it."""
    if is_stateless(session_id):
        return await update_stateless(state, session_id, body)
    conv = await conversation(state, session_id)
    fields = body.model_dump(exclude_unset=True)
    if fields:
        check_session_settings(conv.overrides, fields, state.defaults.model_dump())
    updated = await state.store.update_conversation(conv.owner, conv.id, **fields)
    if updated is None:  # deleted meanwhile
        raise not_found(f"conversation {session_id!r}")
    info = await state.runtime.engine_client.set_session_budget(
        conv.id, state.turns.planner.session_budget(updated)
    )
    return await session(state, session_id, info)


STATELESS_SETTINGS = BUDGET_FIELDS  # the engine's SessionBudget: no history settings


async def update_stateless(
    state: AppState, session_id: str, body: SessionSettings
) -> dict[str, Any]:
    """Give a stateless session's engine session a new budget, from its next call: the fields
    set replace the current ones (null: the server default). Held in this process only, not
    stored: a restart forgets it. History settings do not apply (the client sends its whole
    history each call, nothing is planned): a value for one is a 400 naming the field (null,
    as an editor sends for every field left empty, is nothing to change)."""
    info = await engine_session(state, session_id)
    fields = body.model_dump(exclude_unset=True)
    for name, value in fields.items():
        if name not in STATELESS_SETTINGS and value is not None:
            raise invalid_request(
                f"{name} does not apply to a stateless session (its client sends the whole "
                f"history each call); it takes {', '.join(STATELESS_SETTINGS)}",
                name,
            )
    changes = {
        name: getattr(state.defaults, name) if fields[name] is None else fields[name]
        for name in STATELESS_SETTINGS
        if name in fields
    }
    budget = dataclasses.replace(info.budget, **changes)
    updated = await state.runtime.engine_client.set_session_budget(session_id, budget)
    if updated is None:  # closed meanwhile
        raise not_found(f"session {session_id!r}")
    return stateless_session(state, updated)


async def evict(state: AppState, session_id: str, offload: bool) -> dict[str, Any]:
    """Move the session's KV to the host pool (offload) or drop it; answers with the engine's
    answer: the session's state before and right after the eviction."""
    stateless = is_stateless(session_id)
    if not stateless:
        session_id = (await conversation(state, session_id)).id
    eviction = await state.runtime.engine_client.evict_session(session_id, offload=offload)
    if stateless and eviction.before is None:
        raise not_found(f"session {session_id!r}")
    after = None if eviction.after is None else eviction.after.state
    if not stateless and after in (None, SessionState.EMPTY):
        await state.leases.release(session_id)
    return {
        "object": "session.eviction",
        "session_id": session_id,
        "kind": "stateless" if stateless else "conversation",
        "conversation_id": None if stateless else session_id,
        "before": None if eviction.before is None else eviction.before.state.value,
        "state": None if after is None else after.value,
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
    defaults = state.defaults.model_copy(update=fields)
    defaults.policy()  # raises, naming the field, on a bad combination
    state.defaults = defaults
    return state.defaults.model_dump()
