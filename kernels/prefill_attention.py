"""Paged prefill / extend attention: a sequence's new tokens attend to its cached prefix
(any number of blocks, possibly shared with other sequences) and causally to each other.

Triton kernel: grid (query tiles of all sequences, num_kv_heads). A query tile is BLOCK_Q new
tokens of one sequence times the GROUP query heads of one KV head, flattened into
BLOCK_M = BLOCK_Q * GROUP_PAD rows (row = token * GROUP_PAD + head), so each K/V tile loaded
serves the whole head group. The launcher maps program ids to (sequence, first token) with a
few torch ops on the device (no host sync); programs past the last tile exit. The key loop
visits only tiles that some query of the tile can see (causal end, sliding window, sinks;
see `_key_tile_span`) with an online softmax in float32.

Quantized caches (kernels.quant) are dequantized in the loop. Their scale caches are
[num_blocks, block_size, num_kv_heads, num_groups], one scale per group of
head_dim // num_groups channels. With one group (int8, fp8, int4 at a head_dim that does not
divide by 32) the scale is constant along the dot's reduction, so the codes go into the dots
and the scales multiply the scores (K) and the probabilities (V) after, as in the decode
kernel. With several groups (int4) it is not: each K/V tile is dequantized element by element
(codes times the scale of their channel's group) before its dot. int4 codes are stored two
per byte; the kernel loads [BLOCK_N, HEAD_DIM_PAD // 2] bytes and interleaves their low and
high nibbles back into channel order.
"""

from __future__ import annotations

from dataclasses import dataclass

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
from ._paged import compute_dtype_for, gather_kv, visible
from .quant import INT4_OFFSET, is_packed, is_quantized

# A @triton.jit function may read a module global only as a constexpr (the interpreter lets
# a plain int through; compiling does not).
_INT4_OFFSET = tl.constexpr(INT4_OFFSET)


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences back to back
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim (/ 2 int4)]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, -1 padded
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence in query
    scale: float,
    *,
    sliding_window: int | None = None,
    num_sink_tokens: int = 0,
    key_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads, groups]
    value_scale_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Torch reference (and the CPU path where kvchat's C++ kernel does not apply: see
    `torch_ops.StepPrefill`): one sequence at a time. The new tokens' K/V must already be in
    the cache (the cache write runs first)."""
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    dtype = compute_dtype_for(query)
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks_used = (seq_len + block_size - 1) // block_size
        table = block_tables[i, :num_blocks_used]
        k = gather_kv(key_cache, key_scale_cache, table, dtype)[:seq_len]  # [L, Hkv, D]
        v = gather_kv(value_cache, value_scale_cache, table, dtype)[:seq_len]
        q = query[q_start:q_end].to(dtype)  # [Q, H, D]
        if sliding_window is None and query.device.type == "cpu":
            # [1, H, Q, D] over [1, Hkv, L, D]: the CPU flash kernel takes the head groups
            # as they are (no copies of K and V per query head)
            o = causal_attention_cpu(
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                scale,
            )[0]
            out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
            continue
        if q_len == seq_len and sliding_window is None:
            # A whole sequence, plain causal attention: no mask to build or read.
            mask, causal = None, True
        else:
            query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).view(-1, 1)
            key_pos = torch.arange(seq_len, device=query.device).view(1, -1)
            mask = visible(query_pos, key_pos, sliding_window, num_sink_tokens)  # [Q, L]
            causal = False
        # [1, H, Q, D] x [1, H, L, D] (4-D: SDPA's fused CPU kernel; 3-D takes the unfused
        # one): each KV head serves `group` consecutive query heads.
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0),
            v.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
        )[0]
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
    return out


def causal_attention_cpu(
    q: torch.Tensor,  # [1, H, Q, D]: the last Q of the L tokens
    k: torch.Tensor,  # [1, Hkv, L, D], H a multiple of Hkv (consecutive query heads share one)
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk's Q new tokens over all L tokens of their sequence, with no
    mask: the L - Q keys before the chunk, which every new token sees, in one unmasked call;
    the chunk's own keys, a square causal block (the kernel skips the tiles above its
    diagonal), in another; the two merged by their log-sum-exps. A mask of the same shape is
    read by the kernel at every tile, and none of its tiles are skipped."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    past = k.shape[2] - q.shape[2]
    own, own_lse = flash(q, k[:, :, past:], v[:, :, past:], 0.0, True, scale=scale)
    if past == 0:
        return own
    before, before_lse = flash(q, k[:, :, :past], v[:, :, :past], 0.0, False, scale=scale)
    lse = torch.logaddexp(before_lse, own_lse).unsqueeze(-1)  # [1, H, Q, 1] float32
    merged = before.float() * (before_lse.unsqueeze(-1) - lse).exp()
    merged += own.float() * (own_lse.unsqueeze(-1) - lse).exp()
    return merged.to(q.dtype)


@triton.jit
def _load_kv_tile(ptrs, mask, PACKED: tl.constexpr):
    """A K or V tile as stored, masked entries 0: ptrs [BLOCK_N, HEAD_DIM_PAD] of values, or
    (PACKED) [BLOCK_N, HEAD_DIM_PAD // 2] bytes of int4 codes -> [BLOCK_N, HEAD_DIM_PAD]
    int8 codes in [-7, 7], in channel order."""
    if PACKED:
        packed = tl.load(ptrs, mask=mask, other=_INT4_OFFSET * 0x11)  # both nibbles: code 0
        lo = (packed & 0xF).to(tl.int8) - _INT4_OFFSET  # channels 0, 2, 4, ...
        hi = (packed >> 4).to(tl.int8) - _INT4_OFFSET  # channels 1, 3, 5, ...
        tile = tl.interleave(lo, hi)
    else:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def _scale_offsets(block_ids, offs_key, kv_head, stride_sb, stride_st, stride_sh, BLOCK_SIZE):
    """[BLOCK_N] offsets of the keys' (block, slot, kv head) rows in the scale caches."""
    offs_scale = block_ids.to(tl.int64) * stride_sb + (offs_key % BLOCK_SIZE) * stride_st
    return offs_scale + kv_head * stride_sh


@triton.jit
def _group_scales(scale_ptr, offs_scale, mask_kv, offs_d, GROUP_SIZE: tl.constexpr):
    """[BLOCK_N, HEAD_DIM_PAD] float32 scale of every channel (its group's: groups are
    contiguous and their stride is 1), 0 where mask_kv is False."""
    scales = tl.load(
        scale_ptr + offs_scale[:, None] + (offs_d // GROUP_SIZE)[None, :],
        mask=mask_kv,
        other=0.0,
    )
    return scales.to(tl.float32)


@triton.jit
def _paged_prefill_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim (/ 2 when PACKED)]
    value_cache_ptr,  # same shape and strides as key_cache
    # [num_blocks, block_size, num_kv_heads, head_dim // GROUP_SIZE] (quantized caches only):
    # float32 for int8/fp8, float16 for int4
    key_scale_ptr,
    value_scale_ptr,  # same shape and strides as key_scale
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32, -1 padded
    seq_lens_ptr,  # [num_seqs] int32, context including the new tokens
    query_start_loc_ptr,  # [num_seqs + 1] int32
    tile_seq_ptr,  # [num_programs] int32, the tile's sequence; >= num_seqs: no tile
    tile_q_start_ptr,  # [num_programs] int32, the tile's first new token within its sequence
    out_ptr,  # [num_tokens, num_heads, head_dim]
    qk_scale,  # softmax scale * log2(e)
    sliding_window,
    num_sink_tokens,
    num_seqs,
    stride_qt,
    stride_qh,  # query; head_dim stride is 1
    stride_cb,
    stride_ct,
    stride_ch,  # key/value cache; stored-channel stride is 1
    stride_sb,
    stride_st,
    stride_sh,  # key/value scale cache; group stride is 1
    stride_bts,  # block_tables; block stride is 1
    stride_ot,
    stride_oh,  # out; head_dim stride is 1
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # new tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile = BLOCK_Q * GROUP_PAD
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_N: tl.constexpr,  # tokens per key tile, a multiple of BLOCK_SIZE
    HAS_WINDOW: tl.constexpr,
    IS_QUANTIZED: tl.constexpr,
    PACKED: tl.constexpr,  # int4: two codes per stored byte
    GROUP_SIZE: tl.constexpr,  # channels per scale; HEAD_DIM: one scale per vector
    DOT_MODE: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + pid)
    if seq >= num_seqs:
        return
    q_tile_start = tl.load(tile_q_start_ptr + pid)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    cached_len = seq_len - q_len  # the prefix already in the cache before these tokens

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    tok = q_tile_start + offs_m // GROUP_PAD  # [BLOCK_M] new-token index within the sequence
    g = offs_m % GROUP_PAD
    heads = kv_head * GROUP + g
    mask_m = (tok < q_len) & (g < GROUP)
    mask_d = offs_d < HEAD_DIM
    q_pos = cached_len + tok  # [BLOCK_M] absolute positions

    q = tl.load(
        query_ptr
        + (q_begin + tok).to(tl.int64)[:, None] * stride_qt
        + heads[:, None] * stride_qh
        + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]

    q_pos_lo = cached_len + q_tile_start
    q_pos_hi = tl.minimum(q_pos_lo + BLOCK_Q - 1, seq_len - 1)
    num_sink_tiles, window_first_tile, num_tiles = _key_tile_span(
        q_pos_lo, q_pos_hi, seq_len, sliding_window, num_sink_tokens, BLOCK_N, HAS_WINDOW
    )

    # Stored channels of a K/V vector: HEAD_DIM values, or HEAD_DIM // 2 bytes of int4 codes.
    if PACKED:
        offs_c = tl.arange(0, HEAD_DIM_PAD // 2)
        mask_c = offs_c < HEAD_DIM // 2
    else:
        offs_c = offs_d
        mask_c = mask_d
    # Several scales per vector (int4 groups): scale K/V element by element before the dots;
    # one per vector: scale the scores and the probabilities after them.
    GROUPED: tl.constexpr = IS_QUANTIZED and GROUP_SIZE < HEAD_DIM

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for t in range(0, num_tiles):
        offs_key = _tile_start(t, num_sink_tiles, window_first_tile, BLOCK_N) + offs_n
        # Keys some row of the tile sees; only those are loaded (blocks outside every row's
        # window may be freed, -1 in the table).
        mask_n = offs_key <= q_pos_hi
        if HAS_WINDOW:
            mask_n = mask_n & (
                (offs_key > q_pos_lo - sliding_window) | (offs_key < num_sink_tokens)
            )
        block_ids = tl.load(block_table + offs_key // BLOCK_SIZE, mask=mask_n, other=0)
        offs_slot = block_ids.to(tl.int64) * stride_cb + (offs_key % BLOCK_SIZE) * stride_ct
        offs_kv = offs_slot[:, None] + kv_head * stride_ch + offs_c[None, :]
        mask_kv = mask_n[:, None] & mask_c[None, :]

        k = _load_kv_tile(key_cache_ptr + offs_kv, mask_kv, PACKED)
        if GROUPED:
            # The scale changes along the dot's reduction: dequantize the tile first.
            offs_scale = _scale_offsets(
                block_ids, offs_key, kv_head, stride_sb, stride_st, stride_sh, BLOCK_SIZE
            )
            mask_scale = mask_n[:, None] & mask_d[None, :]
            k = k.to(tl.float32) * _group_scales(
                key_scale_ptr, offs_scale, mask_scale, offs_d, GROUP_SIZE
            )
        k = k.to(q.dtype)
        s = _dot(q, tl.trans(k), DOT_MODE)  # [BLOCK_M, BLOCK_N]
        if IS_QUANTIZED and not GROUPED:
            # One scale per key vector: it multiplies the key's whole score.
            offs_scale = _scale_offsets(
                block_ids, offs_key, kv_head, stride_sb, stride_st, stride_sh, BLOCK_SIZE
            )
            k_scale = tl.load(key_scale_ptr + offs_scale, mask=mask_n, other=0.0)
            s = s * k_scale.to(tl.float32)[None, :]
        seen = mask_n[None, :] & (offs_key[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            seen = seen & (
                (offs_key[None, :] > q_pos[:, None] - sliding_window)
                | (offs_key[None, :] < num_sink_tokens)
            )
        s = tl.where(seen, s * qk_scale, float("-inf"))

        # A row may see nothing in this tile (window): keep its state, no NaN from -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(value_cache_ptr + offs_kv, mask_kv, PACKED)
        if GROUPED:
            v = v.to(tl.float32) * _group_scales(
                value_scale_ptr, offs_scale, mask_scale, offs_d, GROUP_SIZE
            )
        v = v.to(q.dtype)
        if IS_QUANTIZED and not GROUPED:
            # One scale per value vector: it multiplies that key's probability instead.
            v_scale = tl.load(value_scale_ptr + offs_scale, mask=mask_n, other=0.0)
            p = p * v_scale.to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, DOT_MODE)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + (q_begin + tok).to(tl.int64)[:, None] * stride_ot
        + heads[:, None] * stride_oh
        + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel."""

    block_m: int  # rows per tile (tokens x padded head group), a power of two >= 16
    block_n: int  # tokens per key tile, a power of two >= block_size
    num_warps: int = 4
    num_stages: int = 2


def default_prefill_config(dtype: torch.dtype, block_size: int, head_dim: int) -> PrefillConfig:
    if dtype == torch.float32:
        return PrefillConfig(block_m=64, block_n=max(32, block_size), num_warps=4)
    if head_dim <= 128:  # measured on an H200 (bench/gpu_kernels.py --sweep)
        return PrefillConfig(block_m=64, block_n=max(64, block_size), num_warps=4)
    return PrefillConfig(block_m=64, block_n=max(32, block_size), num_warps=4)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences back to back
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim (/ 2 int4)]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, -1 padded
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence in query
    scale: float,
    *,
    sliding_window: int | None = None,
    num_sink_tokens: int = 0,
    key_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads, groups]
    value_scale_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Triton paged prefill attention (same contract as `paged_prefill_attention_ref`);
    query_start_loc[-1] must equal num_tokens (not checked: that would sync)."""
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
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}] int32, "
            f"got {tuple(query_start_loc.shape)} {query_start_loc.dtype}"
        )
    if query_start_loc.device != query.device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device}, query on {query.device}")
    config = default_prefill_config(query.dtype, key_cache.shape[1], query.shape[2])
    return paged_prefill_attention_with_config(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        config,
        sliding_window=sliding_window,
        num_sink_tokens=num_sink_tokens,
        key_scale_cache=key_scale_cache,
        value_scale_cache=value_scale_cache,
        out=out,
    )


def paged_prefill_attention_with_config(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    config: PrefillConfig,
    *,
    sliding_window: int | None = None,
    num_sink_tokens: int = 0,
    key_scale_cache: torch.Tensor | None = None,
    value_scale_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_prefill_attention` with explicit launch parameters; arguments assumed checked."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if config.block_n % block_size or config.block_n & (config.block_n - 1):
        raise ValueError(
            f"block_n must be a power-of-two multiple of block_size "
            f"{block_size}, got {config.block_n}"
        )
    group_pad = triton.next_power_of_2(group)
    block_m = max(config.block_m, group_pad, 16)
    block_q = block_m // group_pad
    tile_seq, tile_q_start = _query_tiles(query_start_loc, num_tokens, block_q)

    quantized = is_quantized(key_cache.dtype)
    k_scale = key_scale_cache if quantized else key_cache  # placeholders when unquantized
    v_scale = value_scale_cache if quantized else value_cache
    if quantized:
        assert key_scale_cache is not None
        # [num_blocks, block_size, num_kv_heads, num_groups]; the group stride is 1 (checked).
        scale_strides = key_scale_cache.stride()[:3]
        group_size = head_dim // key_scale_cache.shape[3]
    else:
        scale_strides = (0, 0, 0)
        group_size = head_dim
    _paged_prefill_kernel[(tile_seq.shape[0], num_kv_heads)](
        query,
        key_cache,
        value_cache,
        k_scale,
        v_scale,
        block_tables,
        seq_lens,
        query_start_loc,
        tile_seq,
        tile_q_start,
        out,
        scale * LOG2E,
        sliding_window if sliding_window is not None else 0,
        num_sink_tokens,
        num_seqs,
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
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        HAS_WINDOW=sliding_window is not None,
        IS_QUANTIZED=quantized,
        PACKED=is_packed(key_cache.dtype),
        GROUP_SIZE=group_size,
        DOT_MODE=dot_mode(query),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _query_tiles(
    query_start_loc: torch.Tensor, num_tokens: int, block_q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Program id -> (sequence, first new token) of its query tile, on the device.

    The grid is sized by an upper bound known without a sync: sum(ceil(q_len / block_q))
    <= num_tokens // block_q + num_seqs. Programs past the last tile get sequence num_seqs.
    """
    num_seqs = query_start_loc.shape[0] - 1
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()  # [num_seqs]
    tiles = (q_lens + block_q - 1) // block_q
    tiles_end = torch.cumsum(tiles, 0)  # [num_seqs] inclusive
    num_programs = num_tokens // block_q + num_seqs
    pids = torch.arange(num_programs, device=query_start_loc.device)
    tile_seq = torch.searchsorted(tiles_end, pids, right=True)  # [num_programs] in [0, S]
    first_tile = (tiles_end - tiles)[tile_seq.clamp(max=num_seqs - 1)]
    tile_q_start = (pids - first_tile) * block_q
    return tile_seq.to(torch.int32), tile_q_start.to(torch.int32)
