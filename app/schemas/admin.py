"""Responses of the operator routes (`/v1/admin/...`, app/api/admin.py), as
app/transports/operators.py builds them: memory, the engine, a session (a conversation's or a
stateless one), an eviction, the defaults of new sessions. The requests are SessionSettings
(app/session_settings.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvchat.app.schemas.conversations import StoredSessionSettings
from kvchat.app.session_settings import SessionSettings

# kvchat.memory.SessionState's values, and the retention policy's classes and tiers
# (memory/retention.py; tests/app/api/test_openapi.py checks they agree).
SessionStateName = Literal["empty", "resident", "offloaded", "stored", "active"]
SessionKind = Literal["conversation", "stateless"]
SessionClass = Literal["agent", "person"]
Tier = Literal["device", "host", "disk", "none"]


class HistoryCounters(BaseModel):
    """What history planning did (kvchat.memory.HistoryStats), for one session or summed."""

    trims: int
    dropped_tokens: int
    summaries: int
    summary_tokens: int
    summaries_extracted: int
    tool_results_capped: int
    window_turns: int


# -- GET /v1/admin/memory -------------------------------------------------------------------------


class SessionBudgetOut(BaseModel):
    max_kv_tokens: int | None
    max_context_tokens: int | None
    retention_ttl_s: float | None = Field(description="None: as the retention policy predicts.")
    retention_priority: int | None = Field(description="None: 50.")


# What the engine's retention policy makes of a session now (memory/retention.py), in the
# session views below.
SessionClassField = Annotated[
    SessionClass,
    Field(
        alias="class",
        description="agent: its last turn ended in tool calls (its client comes back within "
        "seconds); person: otherwise (a person reads the reply).",
    ),
]
TierField = Annotated[
    Tier, Field(description="Where its KV is: device, host, disk (the KV store) or none.")
]
NextTurnField = Annotated[
    float | None,
    Field(
        description="The predicted (median) wait for its next turn from now, in seconds; "
        "None: more likely never."
    ),
]
ValueField = Annotated[
    float,
    Field(
        description="Expected prefill seconds its KV saves, per byte, at its tier (counted many "
        "times over while held); the lowest moves down a tier first."
    ),
]
HeldField = Annotated[
    bool, Field(description="Held: mid tool call, its user typing, or inside its retention_ttl_s.")
]


class PinnedSession(BaseModel):
    """A session the engine holds, as `GET /v1/admin/memory` and `GET /v1/admin/sessions` list
    it."""

    session_id: str
    kind: SessionKind
    conversation_id: str | None = Field(description="None for a stateless session.")
    state: SessionStateName
    tier: TierField
    session_class: SessionClassField
    next_turn_s: NextTurnField
    value: ValueField
    held: HeldField
    tokens: int
    device_blocks: int
    host_blocks: int
    turns: int
    idle_seconds: float | None = Field(description="None while a turn of it runs.")
    budget: SessionBudgetOut
    history: HistoryCounters


class DevicePool(BaseModel):
    block_size: int
    num_blocks: int
    used_blocks: int
    pinned_blocks: int
    free_blocks: int
    cached_blocks: int
    usage: float
    bytes: int
    used_bytes: int
    tokens: int
    used_tokens: int
    allocated_tokens: int


class HostPool(BaseModel):
    num_blocks: int
    used_blocks: int
    bytes: int
    used_bytes: int


class RequestCounts(BaseModel):
    running: int
    waiting: int
    swapped: int


class PrefixCacheStats(BaseModel):
    queries: int
    hits: int
    hit_rate: float
    reuse_rate: float


class PrefillSources(BaseModel):
    computed: int
    session: int
    prefix_cache: int
    host: int
    store: int
    recomputed: int


class KVStoreError(BaseModel):
    op: str
    reason: str
    count: int


class KVStoreOff(BaseModel):
    """No KV store configured."""

    enabled: Literal[False]


class KVStoreOn(BaseModel):
    """The KV store (counters are blocks; `active` false while a failing store is off)."""

    enabled: Literal[True]
    path: str
    max_bytes: int
    blocks: int
    bytes: int
    hits: int
    misses: int
    skipped: int
    writes: int
    evictions: int
    dropped: int
    pending_bytes: int
    active: bool
    disabled_reason: str | None
    errors: list[KVStoreError]
    write_seconds: float
    copy_seconds: float
    blocks_queued: int
    blocks_loaded: int
    tokens_loaded: int


class EvictionCounts(BaseModel):
    offloads: int
    drops: int
    restores: int


class PreemptionCounts(BaseModel):
    swap: int
    recompute: int


class MemoryReportOut(BaseModel):
    """`GET /v1/admin/memory`."""

    object: Literal["memory"]
    kv_cache_dtype: str
    bytes_per_token: int
    pool: DevicePool
    host_pool: HostPool
    requests: RequestCounts
    sessions: list[PinnedSession]
    prefix_cache: PrefixCacheStats
    prefill_sources: PrefillSources
    kv_store: KVStoreOn | KVStoreOff
    evictions: EvictionCounts
    preemptions: PreemptionCounts
    kv_bytes_moved: int
    history: HistoryCounters
    defaults: SessionSettings
    replica: str


# -- GET /v1/admin/sessions -----------------------------------------------------------------------


class SessionList(BaseModel):
    """`GET /v1/admin/sessions`: every session this replica's engine knows."""

    object: Literal["list"]
    data: list[PinnedSession]


# -- GET /v1/admin/engine -------------------------------------------------------------------------


class CPUDescription(BaseModel):
    model: str
    isa: list[str]
    torch_capability: str
    torch_threads: int


class LinearPathRow(BaseModel):
    max_rows: int
    path: str


class LinearPlanOut(BaseModel):
    """The paths the linear layers take (kvchat.inference.model.linear_plan.LinearPlan.as_dict)."""

    dtype: str
    weights: Literal["plain", "onednn-prepacked"]
    decode_paths: list[LinearPathRow]
    prefill_path: str
    lm_head_decode_paths: list[LinearPathRow]
    probe_bytes: int
    probe_ms: dict[str, dict[str, float]] = Field(
        description="Candidate path -> {rows: ms per pass}; empty when not measured."
    )
    reason: str
    cached: bool
    cache_file: str | None


class EngineReport(BaseModel):
    """`GET /v1/admin/engine`."""

    object: Literal["engine"]
    model: str
    num_parameters: int
    dtype: str
    device: str
    attention_backend: str
    cpu: CPUDescription
    linear: LinearPlanOut


# -- /v1/admin/sessions/{id} ----------------------------------------------------------------------


class EngineSessionView(BaseModel):
    """A session's engine state, with its history counters."""

    session_id: str
    state: SessionStateName
    tier: TierField
    session_class: SessionClassField
    next_turn_s: NextTurnField
    value: ValueField
    held: HeldField
    tokens: int
    device_blocks: int
    host_blocks: int
    turns: int
    idle_seconds: float | None
    max_kv_tokens: int | None
    max_context_tokens: int | None
    retention_ttl_s: float | None
    retention_priority: int | None
    history: HistoryCounters


class NoStoredSettings(BaseModel):
    """A stateless session stores nothing: `{}`."""

    model_config = ConfigDict(extra="forbid")


class EffectiveSettings(BaseModel):
    """What a conversation's next turn runs with."""

    max_context_tokens: int
    max_kv_tokens: int | None
    history_policy: str
    high_watermark: float
    low_watermark: float
    max_tool_result_tokens: int | None
    max_summary_tokens: int
    retention_ttl_s: float | None = Field(description="None: as the retention policy predicts.")
    retention_priority: int | None = Field(description="None: 50.")


class StatelessEffectiveSettings(BaseModel):
    """What a stateless session's next call runs with (it takes a budget only)."""

    max_context_tokens: int
    max_kv_tokens: int | None
    retention_ttl_s: float | None = Field(description="None: as the retention policy predicts.")
    retention_priority: int | None = Field(description="None: 50.")


class SettingsError(BaseModel):
    """Why a turn would be refused: the stored settings do not fit together or with the
    defaults (`param` names the field)."""

    param: str
    message: str


class ConversationSession(BaseModel):
    object: Literal["session"]
    session_id: str
    kind: Literal["conversation"]
    conversation_id: str
    owner: str
    settings: StoredSessionSettings
    effective: EffectiveSettings
    error: SettingsError | None
    engine: EngineSessionView | None = Field(description="None: the engine holds no session.")
    lease_holder: str | None


class StatelessSession(BaseModel):
    object: Literal["session"]
    session_id: str
    kind: Literal["stateless"]
    conversation_id: None
    owner: None
    settings: NoStoredSettings
    effective: StatelessEffectiveSettings
    error: None
    engine: EngineSessionView
    lease_holder: None


AdminSession = Annotated[ConversationSession | StatelessSession, Field(discriminator="kind")]


class SessionEvictionOut(BaseModel):
    """`POST /v1/admin/sessions/{id}/evict`: the session's state before and right after."""

    object: Literal["session.eviction"]
    session_id: str
    kind: SessionKind
    conversation_id: str | None
    before: SessionStateName | None = Field(description="None: the engine did not know it.")
    state: SessionStateName | None
