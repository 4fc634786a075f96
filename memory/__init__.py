"""KV memory: block pool, block tables, prefix cache, session pinning and budgets. (History
planning, which messages go into a prompt under a token budget, is the `history` package.)

This is the package's face: other packages import from here. Everything it names is pure
Python, so `import memory` costs no torch; the
KV tensors (`kvchat.memory.kv_cache`) are the engine's own business and are not part of the face.

What the engine builds from the modules behind it stays as it was: the pools' sizes measured
at start-up are a frozen KVCacheLayout (never written back into CacheConfig), and a prefix
cache hit is a block whose hash chains its parent's, its token ids and the tenant's salt,
confirmed by comparing the token ids."""

from .config import RETENTION_MODES, CacheConfig, MemoryConfigError, RetentionConfig, SessionBudget
from .kv_layout import KVCacheLayout
from .kv_spec import KV_CACHE_DTYPES, KVCacheSpec
from .pool_sizing import MemoryPlan, parse_bytes
from .retention import TURN_ENDS
from .sessions import SessionState
from .stats import CacheStats, HistoryStats, KVStoreStats

__all__ = [
    "KV_CACHE_DTYPES",
    "RETENTION_MODES",
    "TURN_ENDS",
    "CacheConfig",
    "CacheStats",
    "HistoryStats",
    "KVCacheLayout",
    "KVCacheSpec",
    "KVStoreStats",
    "MemoryConfigError",
    "MemoryPlan",
    "RetentionConfig",
    "SessionBudget",
    "SessionState",
    "parse_bytes",
]
