"""Helpers shared by the torch reference paths: gathering KV out of the block pool and
deciding which keys a query sees."""

from __future__ import annotations

import torch

from .quant import cache_head_dim, dequantize, is_quantized


def compute_dtype_for(query: torch.Tensor) -> torch.dtype:
    """References accumulate in float32, or in float64 when handed float64 queries."""
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def gather_rows(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    scale_cache: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads, groups] or None
    block_ids: torch.Tensor,  # [n] int64, every id a valid block
    dtype: torch.dtype,
) -> torch.Tensor:
    """Blocks `block_ids` of the pool -> [n, block_size, num_kv_heads, head_dim] in `dtype`
    (dequantized for quantized caches)."""
    # Blocks as rows: index_select of rows is a memcpy per block on the CPU; advanced
    # indexing, or index_select of a 4-d tensor, goes element by element (2-3x slower).
    num_blocks, block_size, num_kv_heads, stored = cache.shape
    kv = cache.reshape(num_blocks, -1).index_select(0, block_ids)
    kv = kv.view(-1, block_size, num_kv_heads, stored)
    if is_quantized(cache.dtype):
        assert scale_cache is not None, "quantized cache needs its scale cache"
        num_groups = scale_cache.shape[-1]
        scales = scale_cache.reshape(num_blocks, -1).index_select(0, block_ids)
        scales = scales.view(-1, block_size, num_kv_heads, num_groups)
        if num_groups == 1 and stored == cache_head_dim(cache):  # one scale per vector
            return kv.to(dtype) * scales.to(dtype)
        return dequantize(kv, scales, dtype)
    return kv if kv.dtype == dtype else kv.to(dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    scale_cache: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads, groups] or None
    block_ids: torch.Tensor,  # [..., n] int; negative entries are padding (read as block 0)
    dtype: torch.dtype,
) -> torch.Tensor:
    """Gather blocks -> [..., n * block_size, num_kv_heads, head_dim] in `dtype`."""
    kv = gather_rows(cache, scale_cache, block_ids.reshape(-1).long().clamp_min(0), dtype)
    n = block_ids.shape[-1] * cache.shape[1]
    return kv.view(*block_ids.shape[:-1], n, cache.shape[2], cache_head_dim(cache))


def visible(
    query_pos: torch.Tensor,  # [..., q, 1] absolute positions of the queries
    key_pos: torch.Tensor,  # [..., 1, k] absolute positions of the keys
    sliding_window: int | None,
    num_sink_tokens: int,
) -> torch.Tensor:
    """[..., q, k] True where the key is visible: causal, and inside the window (the last
    `sliding_window` positions up to and including the query) or one of the first
    `num_sink_tokens` positions."""
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask = mask & ((key_pos > query_pos - sliding_window) | (key_pos < num_sink_tokens))
    return mask
