"""CacheStats: counters of where prefill KV came from and what the memory manager did."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


@dataclass
class CacheStats:
    """Monotonic counters (tokens unless named otherwise).

    Every prompt token admitted is counted once in `prompt_tokens` and once in exactly one
    of: computed, from_session, from_prefix_cache, from_host, from_store. Tokens recomputed after a
    preemption or a dropped session are counted again as computed.
    """

    prompt_tokens: int = 0
    computed: int = 0
    from_session: int = 0
    from_prefix_cache: int = 0
    from_host: int = 0
    from_store: int = 0  # loaded from the KV store (disk) instead of recomputed
    recomputed: int = 0  # tokens computed again after a preemption
    session_offloads: int = 0
    session_drops: int = 0
    session_restores: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    cow_copies: int = 0  # blocks copied on write
    blocks_to_host: int = 0  # blocks copied device -> host (offloads, swap-outs)
    blocks_from_host: int = 0  # blocks copied host -> device (restores, swap-ins)
    blocks_to_store: int = 0  # blocks queued for the KV store (write-behind)
    blocks_from_store: int = 0  # blocks loaded from the KV store into the device pool
    # Retention (memory.retention): turns whose session's KV was on the device, on the host,
    # or on disk when they came; sessions brought up ahead of their turn, and of those the
    # ones their turn used and the ones that left the device unused; blocks such prefetches
    # moved; holds broken under pressure; admissions that first waited on held sessions.
    session_hits_device: int = 0
    session_hits_host: int = 0
    session_hits_disk: int = 0
    prefetches: int = 0
    prefetches_used: int = 0
    prefetches_wasted: int = 0
    prefetch_blocks_from_host: int = 0
    prefetch_blocks_from_store: int = 0
    holds_broken: int = 0
    admissions_held_back: int = 0

    @property
    def reused(self) -> int:
        return self.from_session + self.from_prefix_cache + self.from_host + self.from_store

    @property
    def hit_rate(self) -> float:
        return self.reused / self.prompt_tokens if self.prompt_tokens else 0.0

    def snapshot(self) -> dict[str, float]:
        data: dict[str, float] = dict(asdict(self))
        data["reused"] = self.reused
        data["hit_rate"] = self.hit_rate
        return data


@dataclass
class KVStoreStats:
    """The KV store (kvchat.memory.kv_store): monotonic counters, and its size as this process last
    saw it (other processes sharing its directory write and evict too).

    errors counts every fault the store caught, by (op, reason): op is what it was doing
    (`open`, `scan`, `read`, `verify`, `write`, `rename`, `remove`), reason the errno's name
    (`EROFS`, `ENOSPC`, `EISDIR`, ...) or what a verification found (`checksum`, `tokens`,
    `shape`, `format`, ...). `enabled` turns false while a store that keeps failing is off
    (`disabled_reason` says why); serving goes on without it."""

    hits: int = 0  # blocks loaded
    misses: int = 0  # lookups that found no usable file
    skipped: int = 0  # files found but not used (corrupt, partial, another model's)
    writes: int = 0  # blocks written
    write_seconds: float = 0.0  # the writer thread's time
    copy_seconds: float = 0.0  # the engine thread's: copying blocks out for the writer
    evictions: int = 0  # files removed to stay under the cap
    dropped: int = 0  # queued copies dropped unwritten (the queue at its cap, or the store off)
    num_blocks: int = 0
    num_bytes: int = 0
    pending_bytes: int = 0  # copies queued for the writer
    errors: dict[tuple[str, str], int] = field(default_factory=dict)
    enabled: bool = True
    disabled_reason: str | None = None

    def copy(self) -> KVStoreStats:
        return replace(self, errors=dict(self.errors))

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())


@dataclass
class HistoryStats:
    """What history planning did (per session, and summed over all of them; the service
    counts them: app.ops.history_counters).

    trims: trim events (the prompt's first kept message moved); dropped_tokens: prompt tokens
    those events removed; summaries / summary_tokens: running summaries made and the tokens
    generated for them; summaries_extracted: those extracted from the dropped user messages
    instead (no generation, or a generated one failed its checks); tool_results_capped: tool
    results cut to their cap in a prompt (counted per turn); window_turns: turns that ran in sink +
    window mode.
    """

    trims: int = 0
    dropped_tokens: int = 0
    summaries: int = 0
    summary_tokens: int = 0
    summaries_extracted: int = 0
    tool_results_capped: int = 0
    window_turns: int = 0

    def add(self, other: HistoryStats) -> None:
        for key, value in asdict(other).items():
            setattr(self, key, getattr(self, key) + value)
