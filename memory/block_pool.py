"""BlockPool: bookkeeping for the preallocated KV blocks (no tensors here).

Every block has a ref count. Blocks with ref count 0 sit in a free queue ordered least
recently freed first; a free block that still carries a hash stays findable by the prefix
cache until the queue hands it out again, which is when its hash is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and registered in the prefix cache; a block with a hash is
    # immutable (its slots may not be written again) until it is handed out anew.
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free; callers check first."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not: all can be handed out."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out `num_blocks` blocks with ref count 1, evicting cached ones LRU-first."""
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_count == 0
            if block.block_hash is not None:
                self._forget(block)
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def decref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed more often than taken"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                # Nothing to find it by: hand it out before blocks that may still be hit.
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
            else:
                self._free[block_id] = None

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, last block first, so that when several become
        free a sequence's leading (most shareable) blocks are evicted last."""
        for block_id in reversed(block_ids):
            self.decref(block_id)

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The block registered under `block_hash` if its token ids also match."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(token_ids):
            return None
        return block_id

    def register(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> int:
        """Make a full block findable. If another block already holds the same content, the
        first one stays registered; returns the registered block id."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            assert block.block_hash == block_hash, "a hashed block was rewritten"
            return block_id
        existing = self._by_hash.get(block_hash)
        if existing is not None:
            return existing
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._by_hash[block_hash] = block_id
        return block_id

    def is_writable(self, block_id: int) -> bool:
        """Only a block held once and not registered may have its slots written."""
        block = self.blocks[block_id]
        return block.ref_count == 1 and block.block_hash is None

    def _forget(self, block: Block) -> None:
        assert block.block_hash is not None
        if self._by_hash.get(block.block_hash) == block.block_id:
            del self._by_hash[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def check_invariants(self) -> None:
        """Full consistency check (tests): O(num_blocks)."""
        for block in self.blocks:
            assert block.ref_count >= 0
            assert (block.ref_count == 0) == (block.block_id in self._free), block
            if block.block_hash is not None:
                assert self._by_hash.get(block.block_hash) == block.block_id
        for block_hash, block_id in self._by_hash.items():
            assert self.blocks[block_id].block_hash == block_hash
