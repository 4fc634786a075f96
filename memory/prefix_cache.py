"""Prefix cache: full blocks found by a hash chain, shared across sequences and sessions.

A full block's hash chains its parent block's hash with its own token ids; the first block
of a stream mixes in a salt (the tenant), so one tenant's blocks can never be found from
another's prompts. A hit is confirmed by comparing token ids, never trusted on the hash alone.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from .block_pool import BlockPool


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], salt: str | None) -> bytes:
    """sha256 of (parent hash, token ids); the first block mixes in the salt instead of a
    parent. No salt and the empty salt are different tenants."""
    h = hashlib.sha256()
    if parent_hash is None:
        h.update(b"kvchat-root\x00")
        if salt is None:
            h.update(b"\x00")
        else:
            encoded = salt.encode()
            h.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    else:
        h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, enabled: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled

    def match(
        self,
        token_ids: Sequence[int],
        salt: str | None,
        start_block: int,
        parent_hash: bytes | None,
        max_tokens: int,
    ) -> tuple[list[int], list[bytes]]:
        """Look up the full blocks of `token_ids` from `start_block` on (whose parent hash is
        `parent_hash`) as long as they hit and stay within `max_tokens`. Takes a reference on
        every hit; returns (block_ids, hashes)."""
        hits: list[int] = []
        hashes: list[bytes] = []
        if not self.enabled:
            return hits, hashes
        bs = self.block_size
        index = start_block
        while (index + 1) * bs <= max_tokens:
            chunk = token_ids[index * bs : (index + 1) * bs]
            block_hash = hash_block(parent_hash, chunk, salt)
            block_id = self.pool.lookup(block_hash, chunk)
            if block_id is None:
                break
            self.pool.incref(block_id)
            hits.append(block_id)
            hashes.append(block_hash)
            parent_hash = block_hash
            index += 1
        return hits, hashes

    def hash_chain(
        self, token_ids: Sequence[int], salt: str | None, num_blocks: int | None = None
    ) -> list[bytes]:
        """Chain hashes of the leading full blocks of `token_ids` (at most `num_blocks`)."""
        bs = self.block_size
        count = len(token_ids) // bs
        if num_blocks is not None:
            count = min(count, num_blocks)
        hashes: list[bytes] = []
        parent = None
        for index in range(count):
            parent = hash_block(parent, token_ids[index * bs : (index + 1) * bs], salt)
            hashes.append(parent)
        return hashes

    def next_block_hash(
        self, block_hashes: Sequence[bytes], token_ids: Sequence[int], salt: str | None
    ) -> bytes | None:
        """Hash of the full block that follows the hashed ones, if `token_ids` fill it."""
        bs = self.block_size
        index = len(block_hashes)
        if (index + 1) * bs > len(token_ids):
            return None
        parent = block_hashes[-1] if block_hashes else None
        return hash_block(parent, token_ids[index * bs : (index + 1) * bs], salt)

    def extend_hashes(
        self,
        block_ids: Sequence[int],
        block_hashes: list[bytes],
        token_ids: Sequence[int],
        num_computed_tokens: int,
        salt: str | None,
    ) -> None:
        """Hash (and, when enabled, register) every block that has become full and computed
        since the last call; `block_hashes` is extended in place."""
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(block_ids))
        for index in range(len(block_hashes), num_full):
            parent = block_hashes[index - 1] if index > 0 else None
            chunk = token_ids[index * bs : (index + 1) * bs]
            block_hash = hash_block(parent, chunk, salt)
            block_hashes.append(block_hash)
            if self.enabled:
                self.pool.register(block_ids[index], block_hash, chunk)
