"""Configuration of the KV memory: pool size, block size, cache dtype, sessions and budgets."""

from __future__ import annotations

from dataclasses import dataclass, field

from .kv_spec import KV_CACHE_DTYPES

RETENTION_MODES = ("lru", "pinned", "predictive")


class MemoryConfigError(ValueError):
    """A memory setting a user gave is out of range; the message names the field."""


@dataclass(frozen=True)
class SessionBudget:
    """What one session may use.

    max_kv_tokens: how many tokens of KV it may keep pinned between turns (None: no cap).
    max_context_tokens: its prompt budget; the history planner trims to it (None: the model's).
    retention_ttl_s: how long after each turn its KV is held (soft; None: as the retention
        policy predicts); a client's `prompt_cache_retention` or an operator's setting.
    retention_priority: an operator's rank of the session, 0-100 (None: 50).
    """

    max_kv_tokens: int | None = None
    max_context_tokens: int | None = None
    retention_ttl_s: float | None = None
    retention_priority: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_kv_tokens", "max_context_tokens", "retention_ttl_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise MemoryConfigError(f"{name} must be >= 0 or unset, got {value}")
        if self.retention_priority is not None and not 0 <= self.retention_priority <= 100:
            raise MemoryConfigError(
                f"retention_priority must be in 0-100 or unset, got {self.retention_priority}"
            )


@dataclass(frozen=True)
class RetentionConfig:
    """The policy's settings.

    mode: lru | pinned | predictive.
    horizon_s: per tier, how far ahead a return counts (a session's KV on the device is worth
        keeping for a return within a minute; on the host, within ten).
    prior_weight: how many observed gaps a prior counts as when it is blended with them.
    agent_hold_s / typing_hold_s: how long a session that ended in tool calls, or whose user
        typed, is held (soft).
    hold_weight: how many times over a held session's value counts.
    prefetch_horizon_s / prefetch_probability: a session not on the device is brought up when
        its next turn is at least this likely within the horizon (or its user is typing).
    prefill_s_per_token, host_bytes_per_s, disk_bytes_per_s: what reloading costs, until the
        engine has measured it (prefill steps' time per token, on the CPU; the seconds its
        copies from host and loads from the KV store took).
    """

    mode: str = "predictive"
    horizon_s: tuple[float, float, float] = (60.0, 600.0, 86_400.0)  # device, host, disk
    prior_weight: float = 4.0
    agent_hold_s: float = 30.0
    typing_hold_s: float = 20.0
    hold_weight: float = 1_000.0
    prefetch_horizon_s: float = 10.0
    prefetch_probability: float = 0.25
    prefetch_interval_s: float = 0.25
    prefill_s_per_token: float = 0.5e-3
    host_bytes_per_s: float = 4e9
    disk_bytes_per_s: float = 1e9

    def __post_init__(self) -> None:
        if self.mode not in RETENTION_MODES:
            raise MemoryConfigError(
                f"retention must be one of {', '.join(RETENTION_MODES)}, got {self.mode!r}"
            )
        if len(self.horizon_s) != 3 or min(self.horizon_s) <= 0:
            raise MemoryConfigError("retention horizons must be three positive seconds")
        if not 0.0 < self.prefetch_probability <= 1.0:
            raise MemoryConfigError("prefetch_probability must be in (0, 1]")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache settings. The number of blocks is measured at start-up (see KVCacheLayout),
    never written back here.

    kv_cache_bytes: pool size on CPU (and on CUDA when set, overriding the utilization rule).
    gpu_memory_utilization: on CUDA, pool = utilization x total - peak after a profiling pass.
    num_blocks_override: exact number of blocks (tests, benchmarks).
    host_cache_bytes: host memory for offloaded sessions and swapped-out sequences.
    kv_store_dir / kv_store_bytes: the KV store on disk (memory.kv_store): where, and its
    byte cap (0 or no directory: no store).
    watermark_low / watermark_high: when free blocks fall below low x pool, idle sessions are
    offloaded or dropped (the retention policy's order) until high x pool is free again.
    retention: the retention policy's settings (memory.retention).
    """

    block_size: int = 16
    kv_cache_dtype: str = "auto"
    # A quantized cache stores keys turned by an orthogonal matrix (kernels.quant.key_rotation),
    # which spreads their outlier channels before quantization; False stores them as they are.
    rotate_keys: bool = True
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_blocks_override: int | None = None
    host_cache_bytes: int = 0
    kv_store_dir: str | None = None
    kv_store_bytes: int = 0
    enable_prefix_caching: bool = True
    enable_sessions: bool = True
    max_pinned_sessions: int | None = None
    watermark_low: float = 0.05
    watermark_high: float = 0.15
    default_budget: SessionBudget = SessionBudget()
    # Which idle session's KV stays where (memory.retention); tests and the engine's own
    # callers get today's `pinned` unless they ask.
    retention: RetentionConfig = field(default_factory=lambda: RetentionConfig(mode="pinned"))
    # A turn that would outgrow its session's max_kv_tokens runs with sink + window attention
    # (this many first tokens kept, StreamingLLM's 4) instead of holding more KV.
    window_sink_tokens: int = 4

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise MemoryConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise MemoryConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise MemoryConfigError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise MemoryConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise MemoryConfigError(
                f"num_blocks_override must be >= 1, got {self.num_blocks_override}"
            )
        if self.host_cache_bytes < 0:
            raise MemoryConfigError(f"host_cache_bytes must be >= 0, got {self.host_cache_bytes}")
        if self.kv_store_bytes < 0:
            raise MemoryConfigError(f"kv_store_bytes must be >= 0, got {self.kv_store_bytes}")
        if self.max_pinned_sessions is not None and self.max_pinned_sessions < 0:
            raise MemoryConfigError(
                f"max_pinned_sessions must be >= 0, got {self.max_pinned_sessions}"
            )
        if self.window_sink_tokens < 0:
            raise MemoryConfigError(
                f"window_sink_tokens must be >= 0, got {self.window_sink_tokens}"
            )
        if not 0.0 <= self.watermark_low <= self.watermark_high <= 1.0:
            raise MemoryConfigError(
                "watermarks must satisfy 0 <= watermark_low <= watermark_high <= 1, got "
                f"{self.watermark_low} and {self.watermark_high}"
            )
