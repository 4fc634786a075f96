"""KV memory: block pool, block tables, prefix cache, session pinning, budgets, and history
planning (which messages go into a prompt under a token budget).

This is the package's face: other packages import from here. Everything it names is pure
Python, so `import memory` (and the service's history planning with it) costs no torch; the
KV tensors (`memory.kv_cache`) are the engine's own business and are not part of the face.

What the engine builds from the modules behind it stays as it was: the pools' sizes measured
at start-up are a frozen KVCacheLayout (never written back into CacheConfig), and a prefix
cache hit is a block whose hash chains its parent's, its token ids and the tenant's salt,
confirmed by comparing the token ids."""

from .config import CacheConfig, MemoryConfigError, SessionBudget
from .history import (
    MIN_TOOL_RESULT_TOKENS,
    POLICIES,
    ContextLengthExceeded,
    ContextPlan,
    HistoryMessage,
    HistoryPolicy,
    HistoryPolicyError,
    InvalidHistoryError,
    SummaryState,
    merge_summary,
    plan_context,
)
from .kv_layout import KVCacheLayout
from .kv_spec import KV_CACHE_DTYPES, KVCacheSpec
from .planner import MemoryPlan, parse_bytes
from .sessions import SessionState
from .stats import CacheStats, HistoryStats

__all__ = [
    "KV_CACHE_DTYPES",
    "MIN_TOOL_RESULT_TOKENS",
    "POLICIES",
    "CacheConfig",
    "CacheStats",
    "ContextLengthExceeded",
    "ContextPlan",
    "HistoryMessage",
    "HistoryPolicy",
    "HistoryPolicyError",
    "HistoryStats",
    "InvalidHistoryError",
    "KVCacheLayout",
    "KVCacheSpec",
    "MemoryConfigError",
    "MemoryPlan",
    "SessionBudget",
    "SessionState",
    "SummaryState",
    "merge_summary",
    "parse_bytes",
    "plan_context",
]
