"""Paged decode attention: one query token per sequence over its block table.

Triton kernel (flash-decoding): grid (num_seqs, num_kv_heads, num_splits). A program takes
the GROUP query heads that share one KV head as a [GROUP_PAD, HEAD_DIM_PAD] tile, walks its
split's share of the key tiles the query can see ([BLOCK_N tokens, HEAD_DIM_PAD], BLOCK_N a
multiple of block_size, so one tile spans whole KV blocks) with an online softmax in
float32, and either writes the normalized output (one split) or a partial output and its
log-sum-exp to a float32 workspace that `_decode_reduce_kernel` combines.

Quantized caches (`kernels.quant`: scale caches [num_blocks, block_size, num_kv_heads,
num_groups]) are dequantized inside the loop. int4 codes are unpacked from their bytes first
(low nibble channel 2j, high nibble 2j + 1, each code + 8) into a tile in channel order.
- One scale per (token, head) vector (int8, fp8 e4m3, and int4 when head_dim is not a
  multiple of its group size): the raw codes are converted to the query dtype (exactly:
  |int8| <= 127, |int4| <= 7 and e4m3 values fit bf16/fp16) and the scales multiply the
  scores (K) and the probabilities (V), which is the same sum as dequantizing each element
  first, at one multiply per key instead of one per element.
- Several scale groups per vector (int4, groups of 32 channels): a scale no longer factors
  out of the dot, so each element is multiplied by its group's scale (gathered per channel)
  in float32 before the tile is converted to the query dtype for the dots (exact for a
  float32 query; a bf16 one rounds each dequantized element to 8 bits, far finer than the
  int4 step).

"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ._attention_common import (
    LOG2E,
    _dot,
    _key_tile_span,
    _tile_start,
    check_paged_attention_args,
    dot_mode,
)
from ._paged import compute_dtype_for, gather_rows, visible
from .quant import is_packed, is_quantized


def paged_decode_attention_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim (// 2 int4)]
    value_cache: torch.Tensor,  # same shape as key_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, -1 padded
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    scale: float,
    *,
    sliding_window: int | None = None,
    num_sink_tokens: int = 0,
    # [num_blocks, block_size, num_kv_heads, num_groups], quantized caches only
    key_scale_cache: torch.Tensor | None = None,
    value_scale_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
) -> torch.Tensor:
    """Torch reference (and the CPU path where kvchat's C++ kernel does not apply: a window or
    sinks; see `torch_ops.StepDecode`): all sequences at once, padded to the longest."""
    plan = plan_decode_gather(
        block_tables,
        seq_lens,
        key_cache.shape[1],
        query.shape[0],
        sliding_window,
        num_sink_tokens,
    )
    return paged_decode_attention_gathered(
        query,
        key_cache,
        value_cache,
        plan,
        scale,
        key_scale_cache=key_scale_cache,
        value_scale_cache=value_scale_cache,
        out=out,
    )


@dataclass(frozen=True)
class DecodeGather:
    """What the torch decode attention needs besides the cache: the pool rows each sequence
    reads and the keys it sees. The same for every layer of a step (per window setting)."""

    block_ids: torch.Tensor  # [num_seqs * num_blocks] int64, padding read as block 0
    mask: torch.Tensor  # [num_seqs, 1, 1, num_blocks * block_size] bool
    num_seqs: int


def plan_decode_gather(
    block_tables: torch.Tensor,  # [>= num_seqs, max_blocks_per_seq] int32, -1 padded
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    block_size: int,
    num_seqs: int,
    sliding_window: int | None = None,
    num_sink_tokens: int = 0,
) -> DecodeGather:
    """Blocks up to the longest context, and the causal/window/sink mask over them."""
    device = block_tables.device
    if num_seqs == 0:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return DecodeGather(empty, torch.empty((0, 1, 1, 0), dtype=torch.bool, device=device), 0)
    max_len = int(seq_lens.max())
    num_blocks_used = (max_len + block_size - 1) // block_size
    table = block_tables[:num_seqs, :num_blocks_used]
    lens = seq_lens.to(torch.long).view(num_seqs, 1, 1)
    key_pos = torch.arange(num_blocks_used * block_size, device=device).view(1, 1, -1)
    mask = visible(lens - 1, key_pos, sliding_window, num_sink_tokens) & (key_pos < lens)
    return DecodeGather(table.reshape(-1).long().clamp_min(0), mask.unsqueeze(1), num_seqs)


def paged_decode_attention_gathered(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    plan: DecodeGather,
    scale: float,
    *,
    key_scale_cache: torch.Tensor | None = None,
    value_scale_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's attention for a planned gather."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    dtype = compute_dtype_for(query)
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    assert plan.num_seqs == num_seqs, "the plan was made for another batch"
    # [S, L, Hkv, D]
    k = gather_rows(key_cache, key_scale_cache, plan.block_ids, dtype).view(
        num_seqs, -1, num_kv_heads, head_dim
    )
    v = gather_rows(value_cache, value_scale_cache, plan.block_ids, dtype).view(
        num_seqs, -1, num_kv_heads, head_dim
    )
    # The query heads of one KV head play the part of SDPA's query positions, so GQA needs
    # no copies of K and V: q [S, Hkv, G, D] against k, v [S, Hkv, L, D].
    q = (query if query.dtype == dtype else query.to(dtype)).view(
        num_seqs, num_kv_heads, group, head_dim
    )
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.mask, scale=scale
    )  # [S, Hkv, G, D]; mask [S, 1, 1, L]
    out.copy_(o.reshape(num_seqs, num_heads, head_dim))
    return out


# --------------------------------------------------------------------------- decode kernels


@triton.jit
def _load_int4_codes(
    cache_ptr,
    offs_row,  # [BLOCK_N] int64: offset of each token's (slot, kv head) bytes in the cache
    mask_n,  # [BLOCK_N] bool: the visible keys
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """[BLOCK_N, HEAD_DIM_PAD] int8 codes in [-7, 7] of a packed int4 cache, channels in
    order; 0 for the invisible keys and the padding channels."""
    # Byte j holds channel 2j (low nibble) and 2j + 1 (high nibble), each as code + 8.
    # Masked bytes read as 0x88, two zero codes, so the invisible keys and the padding
    # dequantize to 0 whatever their scale (a V row of NaNs would poison p @ v).
    offs_b = tl.arange(0, HEAD_DIM_PAD // 2)
    packed = tl.load(
        cache_ptr + offs_row[:, None] + offs_b[None, :],
        mask=mask_n[:, None] & (offs_b < HEAD_DIM // 2)[None, :],
        other=0x88,
    )  # [BLOCK_N, HEAD_DIM_PAD // 2] uint8
    low = (packed & 0xF).to(tl.int8) - 8
    high = (packed >> 4).to(tl.int8) - 8
    # [.., j] and [.., j] -> [.., 2j] and [.., 2j + 1]: a join along a new minor axis and a
    # reshape, within each thread's registers.
    return tl.interleave(low, high)


@triton.jit
def _scale_offsets(
    block_ids, offs_key, kv_head, stride_sb, stride_st, stride_sh, BLOCK_SIZE: tl.constexpr
):
    """[BLOCK_N] int64 offsets of the keys' first scale (group 0) in a scale cache."""
    offs_scale = block_ids.to(tl.int64) * stride_sb + (offs_key % BLOCK_SIZE) * stride_st
    offs_scale += kv_head * stride_sh
    return offs_scale


@triton.jit
def _scale_groups(
    codes,  # [BLOCK_N, HEAD_DIM_PAD] stored values, channels in order
    scale_ptr,
    offs_scale,  # [BLOCK_N] int64, from _scale_offsets
    mask_n,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SCALE_GROUP_SIZE: tl.constexpr,
):
    """Dequantize a tile whose vectors have several scale groups: the scales do not factor
    out of the dots then, so each element is multiplied by its group's scale, gathered per
    channel (the group stride is 1). In float32, where code * scale is exact (a float16
    scale times an int4 code), before the caller converts to the query dtype."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    group_scale = tl.load(
        scale_ptr + offs_scale[:, None] + offs_d[None, :] // SCALE_GROUP_SIZE,
        mask=mask_n[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    ).to(tl.float32)
    return codes.to(tl.float32) * group_scale


@triton.jit
def _paged_decode_kernel(
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; uint8 head_dim // 2 int4
    value_cache_ptr,  # same shape and strides as key_cache
    key_scale_ptr,  # [num_blocks, block_size, num_kv_heads, num_groups] (quantized only)
    value_scale_ptr,  # same shape and strides as key_scale
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32, -1 padded
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, head_dim], written here when not IS_SPLIT
    part_out_ptr,  # [num_seqs, num_heads, num_splits, HEAD_DIM_PAD] float32 workspace
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] float32, log2 domain
    qk_scale,  # softmax scale * log2(e)
    sliding_window,
    num_sink_tokens,
    num_splits,
    stride_qs,
    stride_qh,  # query; head_dim stride is 1
    stride_cb,
    stride_ct,
    stride_ch,  # key/value cache; the stored-channel stride is 1
    stride_sb,
    stride_st,
    stride_sh,  # key/value scale cache; the group stride is 1
    stride_bts,  # block_tables; block stride is 1
    stride_os,
    stride_oh,  # out; head_dim stride is 1
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16 so tl.dot gets a full M tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_N: tl.constexpr,  # tokens per key tile, a multiple of BLOCK_SIZE
    HAS_WINDOW: tl.constexpr,
    IS_QUANTIZED: tl.constexpr,
    PACKED: tl.constexpr,  # int4: two codes per stored byte
    SCALE_GROUP_SIZE: tl.constexpr,  # channels per scale; HEAD_DIM: one scale per vector
    IS_SPLIT: tl.constexpr,
    DOT_MODE: tl.constexpr,
):
    # One scale per vector (int8, fp8, one-group int4) multiplies the scores and the
    # probabilities, one multiply per key; several groups (int4) scale each element.
    PER_VECTOR_SCALE: tl.constexpr = IS_QUANTIZED and SCALE_GROUP_SIZE == HEAD_DIM
    GROUPED_SCALES: tl.constexpr = IS_QUANTIZED and SCALE_GROUP_SIZE < HEAD_DIM
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - 1
    num_sink_tiles, window_first_tile, num_tiles = _key_tile_span(
        q_pos, q_pos, seq_len, sliding_window, num_sink_tokens, BLOCK_N, HAS_WINDOW
    )
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    t_begin = split * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    q = tl.load(
        query_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )  # [GROUP_PAD, HEAD_DIM_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for t in range(t_begin, t_end):
        offs_key = _tile_start(t, num_sink_tiles, window_first_tile, BLOCK_N) + offs_n
        # Visible keys only are loaded: blocks outside the window may be freed (-1).
        mask_n = offs_key <= q_pos
        if HAS_WINDOW:
            mask_n = mask_n & ((offs_key > q_pos - sliding_window) | (offs_key < num_sink_tokens))
        block_ids = tl.load(block_table + offs_key // BLOCK_SIZE, mask=mask_n, other=0)
        offs_slot = block_ids.to(tl.int64) * stride_cb + (offs_key % BLOCK_SIZE) * stride_ct
        # The unpacked path is the one int8/fp8 and unquantized caches always took; PACKED
        # and GROUPED_SCALES (constexprs) add the int4 steps without touching it.
        if PACKED:
            offs_row = offs_slot + kv_head * stride_ch
            k = _load_int4_codes(key_cache_ptr, offs_row, mask_n, HEAD_DIM, HEAD_DIM_PAD)
        else:
            offs_kv = offs_slot[:, None] + kv_head * stride_ch + offs_d[None, :]
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k = tl.load(key_cache_ptr + offs_kv, mask=mask_kv, other=0.0)
        if GROUPED_SCALES:
            offs_scale = _scale_offsets(
                block_ids, offs_key, kv_head, stride_sb, stride_st, stride_sh, BLOCK_SIZE
            )
            k = _scale_groups(
                k, key_scale_ptr, offs_scale, mask_n, HEAD_DIM, HEAD_DIM_PAD, SCALE_GROUP_SIZE
            )
        k = k.to(q.dtype)
        s = _dot(q, tl.trans(k), DOT_MODE)  # [GROUP_PAD, BLOCK_N]
        if PER_VECTOR_SCALE:
            offs_scale = _scale_offsets(
                block_ids, offs_key, kv_head, stride_sb, stride_st, stride_sh, BLOCK_SIZE
            )
            k_scale = tl.load(key_scale_ptr + offs_scale, mask=mask_n, other=0.0)
            s = s * k_scale.to(tl.float32)[None, :]
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PACKED:
            v = _load_int4_codes(value_cache_ptr, offs_row, mask_n, HEAD_DIM, HEAD_DIM_PAD)
        else:
            v = tl.load(value_cache_ptr + offs_kv, mask=mask_kv, other=0.0)
        if GROUPED_SCALES:
            v = _scale_groups(
                v, value_scale_ptr, offs_scale, mask_n, HEAD_DIM, HEAD_DIM_PAD, SCALE_GROUP_SIZE
            )
        v = v.to(q.dtype)
        if PER_VECTOR_SCALE:
            v_scale = tl.load(value_scale_ptr + offs_scale, mask=mask_n, other=0.0)
            p = p * v_scale.to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, DOT_MODE)
        m_i = m_new

    # An empty split (or an empty context) has l_i == 0: output 0, log-sum-exp -inf.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if IS_SPLIT:
        row = (seq * num_heads + heads) * num_splits + split  # [GROUP_PAD]
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=mask_g)
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], o, mask=mask_g[:, None]
        )
    else:
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=mask_g[:, None] & mask_d[None, :],
        )


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,  # [num_seqs, num_heads, num_splits, HEAD_DIM_PAD] float32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] float32, log2 domain
    out_ptr,  # [num_seqs, num_heads, head_dim]
    num_splits,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    row = (seq * tl.num_programs(1) + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + row, mask=mask_s, other=float("-inf"))  # [NUM_SPLITS_PAD]
    m = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    part = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    total = tl.sum(weight, axis=0)
    o = tl.sum(weight[:, None] * part, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


# --------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel (tile width and Triton's knobs)."""

    block_n: int  # tokens per key tile, a power of two >= block_size
    num_warps: int = 4
    num_stages: int = 2


# Split-K sizing: aim for WAVES programs per SM, but give each split at least
# MIN_TOKENS_PER_SPLIT keys and use at most MAX_SPLITS splits.
_WAVES = 4
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, -1 padded
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    scale: float,
    *,
    sliding_window: int | None = None,
    num_sink_tokens: int = 0,
    key_scale_cache: torch.Tensor | None = None,
    value_scale_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton paged decode attention (same contract as `paged_decode_attention_ref`; an
    empty context gives 0). `num_splits` (split-K over the visible keys) defaults to a
    choice from the block-table width and the device's SM count; it needs no host sync."""
    check_paged_attention_args(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        sliding_window,
        num_sink_tokens,
        key_scale_cache,
        value_scale_cache,
        out,
    )
    if query.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"query has {query.shape[0]} sequences but seq_lens has {seq_lens.shape[0]}"
        )
    config = default_decode_config(query.dtype, key_cache.shape[1], query.shape[2])
    return paged_decode_attention_with_config(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale,
        config,
        sliding_window=sliding_window,
        num_sink_tokens=num_sink_tokens,
        key_scale_cache=key_scale_cache,
        value_scale_cache=value_scale_cache,
        out=out,
        num_splits=num_splits,
    )


def default_decode_config(query_dtype: torch.dtype, block_size: int, head_dim: int) -> DecodeConfig:
    """Chosen on an H200 with bench/gpu_kernels.py --sweep (Llama-3-8B shapes). bf16 KV
    reaches 87-104% of the copy bandwidth at batch >= 32, context >= 4k. int8/fp8 KV are
    fastest with the same tile but reach only ~45-57% (about bf16's wall time): converting
    the codes to bf16 in the loop bounds them, not memory. Tried there and slower: a 64-row
    query tile (wgmma), V loaded transposed, fp16 dots with per-tile V-scale normalization.
    int4 (unpacking, per-group scales) takes the same tiles; it has not been swept."""
    if query_dtype == torch.float32:
        config = DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    elif head_dim <= 128:
        config = DecodeConfig(block_n=128, num_warps=4, num_stages=3)
    else:
        config = DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    return replace(config, block_n=max(config.block_n, block_size))


def default_num_splits(
    num_seqs: int, num_kv_heads: int, max_visible_keys: int, device: torch.device
) -> int:
    """Enough splits that num_seqs * num_kv_heads * splits programs fill the device."""
    want = triton.cdiv(_WAVES * _sm_count(device), max(num_seqs * num_kv_heads, 1))
    useful = triton.cdiv(max(max_visible_keys, 1), _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, useful, _MAX_SPLITS))


def paged_decode_attention_with_config(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    config: DecodeConfig,
    *,
    sliding_window: int | None = None,
    num_sink_tokens: int = 0,
    key_scale_cache: torch.Tensor | None = None,
    value_scale_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`paged_decode_attention` with explicit launch parameters (benchmarks sweep these);
    arguments are assumed checked."""
    # head_dim from the query: an int4 cache stores head_dim // 2 bytes per vector.
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if config.block_n % block_size or config.block_n & (config.block_n - 1):
        raise ValueError(
            f"block_n must be a power-of-two multiple of block_size "
            f"{block_size}, got {config.block_n}"
        )
    if num_splits is None:
        max_visible = block_tables.shape[1] * block_size  # an upper bound, no host sync
        if sliding_window is not None:
            max_visible = min(max_visible, sliding_window + num_sink_tokens + config.block_n)
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_visible, query.device)
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    head_dim_pad = triton.next_power_of_2(head_dim)
    quantized = is_quantized(key_cache.dtype)
    if quantized:
        assert key_scale_cache is not None and value_scale_cache is not None
        k_scale, v_scale = key_scale_cache, value_scale_cache
        scale_strides = key_scale_cache.stride()[:3]  # the group stride is 1 (checked)
        scale_group_size = head_dim // key_scale_cache.shape[3]
    else:
        k_scale, v_scale = key_cache, value_cache  # unused placeholders
        scale_strides = (0, 0, 0)
        scale_group_size = head_dim
    is_split = num_splits > 1
    if is_split:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        k_scale,
        v_scale,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        sliding_window if sliding_window is not None else 0,
        num_sink_tokens,
        num_splits,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        *scale_strides,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        HAS_WINDOW=sliding_window is not None,
        IS_QUANTIZED=quantized,
        PACKED=is_packed(key_cache.dtype),
        SCALE_GROUP_SIZE=scale_group_size,
        IS_SPLIT=is_split,
        DOT_MODE=dot_mode(query),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if is_split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim_pad * num_splits >= 2048 else 2,
        )
    return out


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
