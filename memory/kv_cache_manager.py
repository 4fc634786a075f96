"""KVCacheManager: every movement of KV between blocks, for running sequences and, between
turns, sessions: allocation, prefix-cache reuse, copy-on-write, commit and release, and the
host tier (swap out / swap in of preempted sequences, offload / restore of idle sessions),
and the disk tier (memory.kv_store: full blocks written behind each finished stream, loaded on
a prefix-cache miss).

It owns the device pool, the host pool and the KV tensors; callers (the scheduler, the session
store) decide *what* moves and *when*, never *how*. State (`KVState`) is kept apart from that
policy."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .block_pool import BlockPool
from .kv_spec import cdiv
from .prefix_cache import PrefixCache, hash_block
from .stats import CacheStats

if TYPE_CHECKING:  # the tensors are only ever handed in: this module imports no torch
    from .kv_cache import KVCache
    from .kv_store import KVStore


HOLE = -1  # a block table entry whose block was released (fell out of a sink + window)


@dataclass(frozen=True)
class KVWindow:
    """Sink + window attention for one stream (StreamingLLM): from position `start` on, each
    token attends to the first `num_sinks` positions and the last `size` ones (itself
    included), so blocks that fall out of both are released and the stream holds a flat
    amount of KV however long it grows. Tokens before `start` attend to everything."""

    num_sinks: int
    size: int
    start: int

    @property
    def exact_tokens(self) -> int:
        """Positions before this see every earlier token: their KV equals full attention's."""
        return max(self.start, self.num_sinks + self.size)

    @classmethod
    def for_budget(cls, max_kv_tokens: int, block_size: int, num_sinks: int) -> KVWindow | None:
        """The window that keeps a stream within ceil(max_kv_tokens / block_size) blocks:
        full attention while it fits, then the sink blocks and a window of k*block_size + 1
        tokens (which touches at most k + 1 blocks). None when the budget leaves no room for
        a window block."""
        k = cdiv(max_kv_tokens, block_size) - cdiv(num_sinks, block_size) - 1
        if k < 1:
            return None
        return cls(num_sinks=num_sinks, size=k * block_size + 1, start=max_kv_tokens)

    def applies(self, position: int) -> bool:
        return position >= self.start


@dataclass
class KVState:
    """One token stream's KV, in the device pool or (swapped out / offloaded) on the host.

    block_ids: its device block table, in order (empty while on the host); HOLE where a
        block fell out of the stream's sink + window and was released.
    host_block_ids: its host block table while swapped out or offloaded.
    block_hashes: chain hashes of its leading full, computed blocks (kept on the host too, so
        a restore can take blocks the prefix cache still holds instead of copying them).
    num_computed_tokens: how many leading tokens have their KV in those blocks.
    """

    salt: str | None = None
    block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def is_on_host(self) -> bool:
        return bool(self.host_block_ids)

    @property
    def held_block_ids(self) -> list[int]:
        """Device blocks actually held (holes left out)."""
        return [b for b in self.block_ids if b != HOLE]

    @property
    def has_holes(self) -> bool:
        return HOLE in self.block_ids

    def leading_tokens(self, block_size: int) -> int:
        """Computed tokens before the first hole: the KV a reader can take as a prefix."""
        if HOLE not in self.block_ids:
            return self.num_computed_tokens
        return min(self.num_computed_tokens, self.block_ids.index(HOLE) * block_size)


@dataclass(frozen=True)
class Restored:
    """Where the tokens of a restore came from: copied from host, or still in the pool."""

    from_host: int = 0
    from_prefix_cache: int = 0


@dataclass
class CopyTimes:
    """Blocks copied onto the device from each lower tier, and the seconds it took (the
    retention policy's reload rates are these, once there are enough of them)."""

    host_blocks: int = 0
    host_s: float = 0.0
    store_blocks: int = 0
    store_s: float = 0.0


class KVCacheError(RuntimeError):
    """A KV movement could not be made (an internal invariant broke); never a user error."""


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        kv: KVCache | None,
        block_size: int,
        enable_prefix_caching: bool,
        host_pool: BlockPool | None = None,
        stats: CacheStats | None = None,
        store: KVStore | None = None,
    ) -> None:
        self.pool = pool
        self.store = store
        self.host_pool = host_pool if host_pool is not None else BlockPool(0)
        self.stats = stats if stats is not None else CacheStats()
        self.kv = kv
        self.block_size = block_size
        self.prefix_cache = PrefixCache(pool, block_size, enable_prefix_caching)
        self.copy_times = CopyTimes()

    # -- allocation ---------------------------------------------------------------------------

    def cdiv_blocks(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

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
        if copied and not self.make_writable(state, state.num_computed_tokens):
            raise KVCacheError("copy-on-write found no free block; reserve_slots was not checked")
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

    def load_from_store(self, state: KVState, token_ids: Sequence[int]) -> int:
        """After `match_prefix`: load the next full blocks from the KV store into free device
        blocks (registered, so the prefix cache finds them next), as long as the store has
        them and blocks are free, leaving at least the last token to compute. Returns the
        number of tokens loaded."""
        store = self.store
        bs = self.block_size
        if store is None or not self.prefix_cache.enabled or state.num_computed_tokens % bs:
            return 0
        index = state.num_computed_tokens // bs
        if index != len(state.block_ids) or index != len(state.block_hashes):
            return 0
        kv = self._kv()
        loaded = 0
        start = time.perf_counter()
        while (index + 1) * bs <= len(token_ids) - 1 and self.pool.can_allocate(1):
            chunk = token_ids[index * bs : (index + 1) * bs]
            parent = state.block_hashes[-1] if state.block_hashes else None
            block_hash = hash_block(parent, chunk, state.salt)
            hit = self.pool.lookup(block_hash, chunk)
            if hit is not None:  # computed by another stream since match_prefix looked
                self.pool.incref(hit)
                block_id = hit
            else:
                data = store.load(block_hash, chunk)
                if data is None:
                    break
                (block_id,) = self.pool.allocate(1)
                kv.write_block(block_id, data.kv, data.scales)
                self.pool.register(block_id, block_hash, chunk)
                self.stats.blocks_from_store += 1
                loaded += bs
            state.block_ids.append(block_id)
            state.block_hashes.append(block_hash)
            state.num_computed_tokens += bs
            index += 1
        if loaded:
            self.copy_times.store_blocks += loaded // bs
            self.copy_times.store_s += time.perf_counter() - start
        return loaded

    def persist(self, state: KVState, token_ids: Sequence[int]) -> int:
        """Queue the stream's hashed blocks that the KV store does not hold yet (its copy is
        taken now; the writing is the store's thread's). Returns how many were queued."""
        store = self.store
        if store is None or not state.block_hashes or not store.is_enabled:
            return 0
        from .kv_store import BlockData  # torch: only reached when a store exists

        on_host = state.is_on_host
        table = state.host_block_ids if on_host else state.block_ids
        bs = self.block_size
        wanted = [
            (i, h)
            for i, h in enumerate(state.block_hashes)
            if i < len(table) and table[i] != HOLE and not store.knows(h)
        ]
        if not wanted:
            return 0
        began = time.perf_counter()
        copies = self._kv().block_bytes([table[i] for i, _ in wanted], on_host)
        store.put(
            [
                BlockData(h, tuple(token_ids[i * bs : (i + 1) * bs]), kv, scales)
                for (i, h), (kv, scales) in zip(wanted, copies)
            ]
        )
        store.note_copy(time.perf_counter() - began)
        self.stats.blocks_to_store += len(wanted)
        return len(wanted)

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

    def commit(
        self,
        state: KVState,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        shareable_tokens: int | None = None,
    ) -> None:
        """Record that the first `num_computed_tokens` of `token_ids` now have KV; full blocks
        (within `shareable_tokens`, when given: KV computed under a window is not what full
        attention computes, so it is never shared) get hashed and become findable."""
        assert num_computed_tokens <= len(state.block_ids) * self.block_size
        state.num_computed_tokens = num_computed_tokens
        hashable = num_computed_tokens
        if shareable_tokens is not None:
            hashable = min(hashable, shareable_tokens)
        self.prefix_cache.extend_hashes(
            state.block_ids, state.block_hashes, token_ids, hashable, state.salt
        )

    def release_out_of_window(self, state: KVState, window: KVWindow, next_position: int) -> int:
        """Release the blocks that no query from `next_position` on can see (past the sink
        blocks, wholly before the window of that position); their table entries become HOLE.
        Returns how many blocks were released."""
        bs = self.block_size
        first_window_position = next_position - window.size + 1
        released = 0
        for index in range(cdiv(window.num_sinks, bs), len(state.block_ids)):
            if (index + 1) * bs > first_window_position:
                break
            block_id = state.block_ids[index]
            if block_id != HOLE:
                self.pool.decref(block_id)
                state.block_ids[index] = HOLE
                released += 1
        return released

    def truncate(self, state: KVState, num_tokens: int) -> None:
        """Keep the KV of the first `num_tokens` tokens; release the blocks past them."""
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(state.block_ids):
            self.pool.release([b for b in state.block_ids[keep:] if b != HOLE])
            del state.block_ids[keep:]
        del state.block_hashes[num_tokens // self.block_size :]
        state.num_computed_tokens = min(state.num_computed_tokens, num_tokens)

    def free(self, state: KVState) -> None:
        """Release everything the stream holds, on the device and on the host."""
        self.pool.release(state.held_block_ids)
        self.host_pool.release(state.host_block_ids)
        state.block_ids.clear()
        state.host_block_ids.clear()
        state.block_hashes.clear()
        state.num_computed_tokens = 0

    def hand_over(self, src: KVState, dst: KVState) -> None:
        """Move every block reference (device and host) and the progress from `src` to the
        empty `dst`; `src` is left empty. No data moves."""
        assert not dst.block_ids and not dst.host_block_ids
        dst.block_ids, src.block_ids = src.block_ids, []
        dst.host_block_ids, src.host_block_ids = src.host_block_ids, []
        dst.block_hashes, src.block_hashes = src.block_hashes, []
        dst.num_computed_tokens, src.num_computed_tokens = src.num_computed_tokens, 0

    # -- the host tier ---------------------------------------------------------------------------

    def swap_out(self, state: KVState) -> None:
        """Copy the stream's device blocks to host blocks and free the device blocks. Its hashes
        and progress are kept. The caller made sure the host pool has room (and that the table
        has no holes: a windowed stream is recomputed instead)."""
        assert not state.host_block_ids, "already on the host"
        assert not state.has_holes, "a stream with released blocks cannot be swapped"
        blocks = state.block_ids
        host_ids = self.host_pool.allocate(len(blocks))
        self._kv().swap_out(blocks, host_ids)
        self.stats.blocks_to_host += len(blocks)
        self.pool.release(blocks)
        state.block_ids = []
        state.host_block_ids = host_ids

    def swap_in(self, state: KVState) -> None:
        """Copy a swapped-out stream's host blocks back into fresh device blocks (the caller made
        sure they are free) and free the host blocks."""
        host_ids = state.host_block_ids
        assert not state.block_ids and host_ids, "not on the host"
        device_ids = self.pool.allocate(len(host_ids))
        self._copy_in(host_ids, device_ids)
        self.host_pool.release(host_ids)
        state.host_block_ids = []
        state.block_ids = device_ids

    def restore(
        self,
        src: KVState,
        token_ids: Sequence[int],
        num_tokens: int,
        dst: KVState,
        make_room: Callable[[int], bool],
    ) -> Restored:
        """Bring the first `num_tokens` tokens of the offloaded stream `src` (whose tokens are
        `token_ids`) into the empty `dst`: blocks the prefix cache still holds are taken as they
        are, the rest copied from host (never recomputed). `make_room(n)` is asked for device
        blocks when the pool is short; the restore stops early where it says no. The host blocks
        are released and `src` is left empty."""
        assert not dst.block_ids and not dst.host_block_ids
        bs = self.block_size
        hashes = src.block_hashes
        copies: list[tuple[int, int]] = []  # (host block, device block)
        from_cache = restored = 0
        for i in range(cdiv(num_tokens, bs)):
            end = min(num_tokens, (i + 1) * bs)
            chained = i < len(hashes) and len(dst.block_hashes) == i
            if chained:
                hit = self.pool.lookup(hashes[i], token_ids[i * bs : (i + 1) * bs])
                if hit is not None:
                    self.pool.incref(hit)
                    dst.block_ids.append(hit)
                    dst.block_hashes.append(hashes[i])
                    from_cache += end - i * bs
                    restored = end
                    continue
            if not self.pool.can_allocate(1) and not make_room(1):
                break
            (device_block,) = self.pool.allocate(1)
            copies.append((src.host_block_ids[i], device_block))
            dst.block_ids.append(device_block)
            if chained:
                dst.block_hashes.append(hashes[i])
            restored = end
        if copies:
            self._copy_in([h for h, _ in copies], [d for _, d in copies])
        self.free(src)
        dst.num_computed_tokens = restored
        del dst.block_hashes[restored // bs :]
        return Restored(from_host=restored - from_cache, from_prefix_cache=from_cache)

    def _copy_in(self, host_ids: list[int], device_ids: list[int]) -> None:
        """Host blocks copied into device blocks, counted and timed."""
        start = time.perf_counter()
        self._kv().swap_in(host_ids, device_ids)
        self.copy_times.host_s += time.perf_counter() - start
        self.copy_times.host_blocks += len(host_ids)
        self.stats.blocks_from_host += len(host_ids)

    def _kv(self) -> KVCache:
        if self.kv is None:
            raise KVCacheError("this manager has no KV tensors to move")
        return self.kv
