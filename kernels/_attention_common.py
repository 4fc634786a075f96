"""Pieces both Triton attention kernels share: how tl.dot runs, which key tiles a query can
see (window and sinks), and the argument checks of the launchers."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .quant import cache_head_dim, group_size, is_quantized, scale_dtype

LOG2E = math.log2(math.e)

# --------------------------------------------------------------------------- jit helpers

# How tl.dot runs (a compile-time constant): 16-bit operands on the tensor cores, float32
# in IEEE precision (not tf32), or 16-bit operands upcast to float32 first, for Triton's
# interpreter, whose bf16 dot multiplies the raw uint16 bit patterns.
DOT_NATIVE, DOT_IEEE, DOT_UPCAST = 0, 1, 2


@triton.jit
def _dot(a, b, DOT_MODE: tl.constexpr):
    if DOT_MODE == 0:
        c = tl.dot(a, b)
    elif DOT_MODE == 1:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return c


@triton.jit
def _key_tile_span(
    q_pos_lo,
    q_pos_hi,
    seq_len,
    sliding_window,
    num_sink_tokens,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Key tiles that queries at positions [q_pos_lo, q_pos_hi] can see, as a virtual range
    0..num_tiles: index t is tile t below num_sink_tiles, else tile
    t - num_sink_tiles + window_first_tile. Tiles between the sinks and the window are
    never visited."""
    end_tile = tl.cdiv(tl.minimum(q_pos_hi + 1, seq_len), BLOCK_N)
    if HAS_WINDOW:
        num_sink_tiles = tl.minimum(tl.cdiv(num_sink_tokens, BLOCK_N), end_tile)
        first_key = tl.maximum(q_pos_lo - sliding_window + 1, 0)
        window_first_tile = tl.maximum(first_key // BLOCK_N, num_sink_tiles)
        num_tiles = num_sink_tiles + tl.maximum(end_tile - window_first_tile, 0)
    else:
        num_sink_tiles = 0
        window_first_tile = 0
        num_tiles = end_tile
    return num_sink_tiles, window_first_tile, num_tiles


@triton.jit
def _tile_start(t, num_sink_tiles, window_first_tile, BLOCK_N: tl.constexpr):
    """First key position of virtual tile t (see _key_tile_span)."""
    tile = tl.where(t < num_sink_tiles, t, t - num_sink_tiles + window_first_tile)
    return tile * BLOCK_N


# --------------------------------------------------------------------------- host helpers


def dot_mode(query: torch.Tensor) -> int:
    if query.dtype == torch.float32:
        return DOT_IEEE
    if query.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return DOT_UPCAST
    return DOT_NATIVE


_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_cache_pair(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale_cache: torch.Tensor | None,
    value_scale_cache: torch.Tensor | None,
) -> set[torch.device]:
    """Checks every kernel makes of the paged cache: K and V of one shape, dtype and strides
    with a contiguous head_dim; for a quantized cache, scale caches
    [num_blocks, block_size, num_kv_heads, num_groups] (kernels.quant: float16, groups of
    SCALE_GROUP_SIZE channels) sharing strides. Returns the devices
    involved."""
    if key_cache.dim() != 4:
        raise ValueError(
            "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache {tuple(value_cache.shape)} {value_cache.dtype} must "
            f"match key_cache {tuple(key_cache.shape)} {key_cache.dtype}"
        )
    if value_cache.stride() != key_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError(
            "key_cache and value_cache must share strides with a contiguous "
            f"head_dim, got {key_cache.stride()} and {value_cache.stride()}"
        )
    devices = {key_cache.device, value_cache.device}
    if not is_quantized(key_cache.dtype):
        return devices
    if key_scale_cache is None or value_scale_cache is None:
        raise ValueError(f"a {key_cache.dtype} cache needs key_scale_cache and value_scale_cache")
    head_dim = cache_head_dim(key_cache)
    shape = (*key_cache.shape[:3], head_dim // group_size(key_cache.dtype, head_dim))
    dtype = scale_dtype(key_cache.dtype)
    for name, s in (("key_scale_cache", key_scale_cache), ("value_scale_cache", value_scale_cache)):
        if s.shape != shape or s.dtype != dtype:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads, num_groups] = "
                f"{shape} {dtype}, got {tuple(s.shape)} {s.dtype}"
            )
        if s.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous groups, got strides {s.stride()}")
        devices.add(s.device)
    if value_scale_cache.stride() != key_scale_cache.stride():
        raise ValueError(
            "key_scale_cache and value_scale_cache must share strides, got "
            f"{key_scale_cache.stride()} and {value_scale_cache.stride()}"
        )
    return devices


def check_paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
    num_sink_tokens: int,
    key_scale_cache: torch.Tensor | None,
    value_scale_cache: torch.Tensor | None,
    out: torch.Tensor | None,
) -> None:
    """Validate the arguments both attention kernels share; ValueError says what to fix."""
    if query.dim() != 3 or query.dtype not in _QUERY_DTYPES or query.stride(-1) != 1:
        raise ValueError(
            "query must be [tokens, num_heads, head_dim] float16/bfloat16/float32 with a "
            f"contiguous head_dim, got {tuple(query.shape)} {query.dtype} "
            f"strides {query.stride()}"
        )
    devices = check_cache_pair(key_cache, value_cache, key_scale_cache, value_scale_cache)
    _, block_size, num_kv_heads, _ = key_cache.shape
    head_dim = cache_head_dim(key_cache)
    num_heads = query.shape[1]
    if query.shape[2] != head_dim or head_dim > 256:
        raise ValueError(
            f"query head_dim {query.shape[2]} must equal the cache's {head_dim} and be at most 256"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if block_size & (block_size - 1) or block_size > 256:
        raise ValueError(f"block_size must be a power of two <= 256, got {block_size}")
    quantized = is_quantized(key_cache.dtype)
    if not quantized and key_cache.dtype != query.dtype:
        raise ValueError(
            f"an unquantized cache must hold the query dtype {query.dtype}, got {key_cache.dtype}"
        )
    devices |= {t.device for t in (query, block_tables, seq_lens)}
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_seqs < 0 or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"seq_lens must be [num_seqs] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
        )
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] < num_seqs
        or block_tables.dtype not in (torch.int32, torch.int64)
        or block_tables.stride(-1) != 1
    ):
        raise ValueError(
            f"block_tables must be [num_seqs >= {num_seqs}, max_blocks_per_seq] int32 with "
            f"contiguous rows, got {tuple(block_tables.shape)} {block_tables.dtype} "
            f"strides {block_tables.stride()}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if num_sink_tokens < 0:
        raise ValueError(f"num_sink_tokens must be >= 0, got {num_sink_tokens}")
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
            raise ValueError(
                f"out must be {tuple(query.shape)} {query.dtype} with a contiguous "
                f"head_dim, got {tuple(out.shape)} {out.dtype}"
            )
        devices.add(out.device)
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
