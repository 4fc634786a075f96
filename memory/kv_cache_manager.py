"""KVCacheManager: the block-level life of token streams (running sequences and, between turns,
sessions): allocation, prefix-cache reuse, copy-on-write, commit and release.

State (`KVState`) is kept apart from the policy deciding when to call these (the scheduler)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .kv_cache import KVCache
from .prefix_cache import PrefixCache


@dataclass
class KVState:
    """One token stream's KV in the pool.

    block_ids: its block table, in order.
    block_hashes: chain hashes of its leading full, computed blocks.
    num_computed_tokens: how many leading tokens have their KV in those blocks.
    """

    salt: str | None = None
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, kv: KVCache | None, block_size: int, enable_prefix_caching: bool
    ) -> None:
        self.pool = pool
        self.kv = kv
        self.block_size = block_size
        self.prefix_cache = PrefixCache(pool, block_size, enable_prefix_caching)

    # -- allocation ---------------------------------------------------------------------------

    def num_new_blocks(self, state: KVState, num_total_tokens: int) -> int:
        """Blocks to add so the table has a slot for each of `num_total_tokens` tokens."""
        return max(0, cdiv(num_total_tokens, self.block_size) - len(state.block_ids))

    def needs_copy_on_write(self, state: KVState) -> bool:
        """Whether the block receiving the next computed token is shared or registered."""
        index = state.num_computed_tokens // self.block_size
        return index < len(state.block_ids) and not self.pool.is_writable(state.block_ids[index])

    def blocks_to_reserve(self, state: KVState, num_total_tokens: int) -> int:
        """Blocks `reserve_slots` takes to make room up to `num_total_tokens` tokens."""
        return self.num_new_blocks(state, num_total_tokens) + int(self.needs_copy_on_write(state))

    def reserve_slots(self, state: KVState, num_total_tokens: int) -> bool:
        """Copy-on-write the block receiving the next token if needed, then allocate slots up to
        `num_total_tokens`; the caller checked `blocks_to_reserve` are free. Returns whether a
        block was copied."""
        copied = self.needs_copy_on_write(state)
        if copied:
            assert self.make_writable(state, state.num_computed_tokens)
        self.allocate_slots(state, num_total_tokens)
        return copied

    def allocate_slots(self, state: KVState, num_total_tokens: int) -> None:
        need = self.num_new_blocks(state, num_total_tokens)
        if need:
            state.block_ids.extend(self.pool.allocate(need))

    # -- reuse ----------------------------------------------------------------------------------

    def match_prefix(self, state: KVState, token_ids: Sequence[int]) -> int:
        """Extend `state` with prefix-cache hits for the full blocks after its computed ones,
        leaving at least the last token to compute. Returns the number of tokens reused."""
        if state.num_computed_tokens % self.block_size:
            return 0
        start_block = state.num_computed_tokens // self.block_size
        if start_block != len(state.block_ids) or start_block != len(state.block_hashes):
            return 0
        parent = state.block_hashes[-1] if state.block_hashes else None
        hits, hashes = self.prefix_cache.match(
            token_ids, state.salt, start_block, parent, max_tokens=len(token_ids) - 1
        )
        state.block_ids.extend(hits)
        state.block_hashes.extend(hashes)
        reused = len(hits) * self.block_size
        state.num_computed_tokens += reused
        return reused

    def make_writable(self, state: KVState, position: int) -> bool:
        """Copy-on-write: make the block that will receive `position` exclusively ours and
        unregistered, copying its contents. Returns False when no block is free for the copy."""
        index = position // self.block_size
        if index >= len(state.block_ids) or self.pool.is_writable(state.block_ids[index]):
            return True
        if not self.pool.can_allocate(1):
            return False
        (fresh,) = self.pool.allocate(1)
        old = state.block_ids[index]
        if self.kv is not None:
            self.kv.copy_blocks([old], [fresh])
        state.block_ids[index] = fresh
        self.pool.decref(old)
        del state.block_hashes[index:]
        return True

    # -- progress and release ------------------------------------------------------------------

    def commit(self, state: KVState, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Record that the first `num_computed_tokens` of `token_ids` now have KV; full blocks
        get hashed and become findable."""
        assert num_computed_tokens <= len(state.block_ids) * self.block_size
        state.num_computed_tokens = num_computed_tokens
        self.prefix_cache.extend_hashes(
            state.block_ids, state.block_hashes, token_ids, num_computed_tokens, state.salt
        )

    def truncate(self, state: KVState, num_tokens: int) -> None:
        """Keep the KV of the first `num_tokens` tokens; release the blocks past them."""
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(state.block_ids):
            self.pool.release(state.block_ids[keep:])
            del state.block_ids[keep:]
        del state.block_hashes[num_tokens // self.block_size :]
        state.num_computed_tokens = min(state.num_computed_tokens, num_tokens)

    def free(self, state: KVState) -> None:
        self.pool.release(state.block_ids)
        state.block_ids.clear()
        state.block_hashes.clear()
        state.num_computed_tokens = 0
