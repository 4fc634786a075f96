"""GPU check and benchmark of the paged-attention Triton kernels.

    python bench/gpu_kernels.py [--quick] [--sweep] [--out FILE.md]   # on a CUDA machine
    python bench/gpu_kernels.py --dry-run                             # CPU, interpreter

1. Correctness: every kernel against its torch reference on the device (fresh random
   inputs; float32, bf16, int8 and fp8 caches, and int4 for the cache write; several shapes,
   with and without a window).
2. Device-to-device copy bandwidth (a large clone; bytes read + written): the ceiling.
3. Decode attention, Llama-3-8B-like shapes (32 query heads, 8 KV heads, head_dim 128,
   block 16), batch x context grid, bf16 and fp8 KV: median time (triton.testing.do_bench),
   achieved bandwidth (KV + scales + q + out bytes) as a fraction of the copy bandwidth,
   and torch's scaled_dot_product_attention on the same K/V laid out contiguously.
4. Prefill attention for a few shapes: TFLOP/s (visible query-key pairs only), SDPA beside.
5. --sweep: decode/prefill launch configurations on a few shapes (to choose defaults).

--dry-run runs the same code on tiny shapes with the Triton interpreter and a one-shot CPU
timer, so the script is known to work before GPU time is spent; its numbers mean nothing.
Imports only torch, triton, numpy, the stdlib and this repo's `kernels` package.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

# First: on a machine without CUDA this sets TRITON_INTERPRET, which Triton reads when it is
# imported (its own @jit helpers, tl.max among them, must be interpreted too).
import kvchat.kernels  # noqa: F401

# isort: split
import numpy as np
import torch
import triton

from kvchat.kernels.cache_write import write_kv_cache, write_kv_cache_ref
from kvchat.kernels.decode_attention import (
    DecodeConfig,
    default_decode_config,
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_with_config,
)
from kvchat.kernels.prefill_attention import (
    PrefillConfig,
    default_prefill_config,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    paged_prefill_attention_with_config,
)
from kvchat.kernels.quant import (
    INT4_OFFSET,
    dequantize,
    group_size,
    is_packed,
    is_quantized,
    min_scale,
    quant_max,
    scale_dtype,
)

FP8 = torch.float8_e4m3fn
DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int8: "int8",
    FP8: "fp8",
    torch.uint8: "int4",  # two codes a byte
}
# Llama-3-8B attention shape.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
MAX_KV_BYTES = 40e9


def stored_shape(shape: tuple[int, ...], cache_dtype: torch.dtype) -> tuple[int, ...]:
    """[..., head_dim] -> the cache tensor's [..., stored]: head_dim // 2 bytes for int4."""
    return (*shape[:-1], shape[-1] // 2) if is_packed(cache_dtype) else shape


def scale_shape(shape: tuple[int, ...], cache_dtype: torch.dtype) -> tuple[int, ...]:
    """[..., head_dim] -> the scale cache's [..., num_groups]."""
    return (*shape[:-1], shape[-1] // group_size(cache_dtype, shape[-1]))


def kv_bytes_per_channel(cache_dtype: torch.dtype, head_dim: int) -> float:
    """Bytes one channel of one cached K (or V) vector takes, its share of scales included."""
    elem = torch.empty(0, dtype=cache_dtype).element_size()
    if not is_quantized(cache_dtype):
        return float(elem)
    scale_bytes = torch.empty(0, dtype=scale_dtype(cache_dtype)).element_size()
    stored = elem / 2 if is_packed(cache_dtype) else float(elem)
    return stored + scale_bytes / group_size(cache_dtype, head_dim)


# --------------------------------------------------------------------------- inputs


@dataclass
class Paged:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_scale_cache: torch.Tensor | None
    value_scale_cache: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    def caches(self, f64: bool = False) -> dict:
        ks, vs = self.key_scale_cache, self.value_scale_cache
        if not f64:
            return dict(
                key_cache=self.key_cache,
                value_cache=self.value_cache,
                key_scale_cache=ks,
                value_scale_cache=vs,
            )
        if ks is None or vs is None:
            return dict(key_cache=self.key_cache.double(), value_cache=self.value_cache.double())
        return dict(
            key_cache=self.key_cache,
            value_cache=self.value_cache,
            key_scale_cache=ks.double(),
            value_scale_cache=vs.double(),
        )

    def tables(self) -> dict:
        return dict(block_tables=self.block_tables, seq_lens=self.seq_lens)


def random_paged(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    device: torch.device,
    *,
    values: str = "normal",
    shared_prefix_blocks: int = 0,
) -> Paged:
    """A shuffled block pool holding every sequence's blocks. values="normal" quantizes
    random normals with the reference (for checks); "fast" fills random codes (timing)."""
    blocks = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    ids = torch.randperm(num_blocks, device=device).to(torch.int32)
    width = max(blocks)
    starts = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)
    # Row i takes ids[start_i : start_i + blocks_i]; -1 past its end.
    cols = torch.arange(width, device=device)
    start_t = torch.tensor(starts, device=device)
    count_t = torch.tensor(blocks, device=device)
    gather = (start_t[:, None] + cols[None, :]).clamp(max=num_blocks - 1)
    block_tables = torch.where(cols[None, :] < count_t[:, None], ids[gather], -1)
    block_tables = block_tables.to(torch.int32).contiguous()
    if shared_prefix_blocks:
        block_tables[1, :shared_prefix_blocks] = block_tables[0, :shared_prefix_blocks]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    if values == "fast":
        if is_quantized(cache_dtype):
            stored = stored_shape(shape, cache_dtype)

            # Codes 0..125 with a random sign: finite for int8 and fp8 alike (and any byte is
            # two valid int4 nibbles).
            def codes() -> torch.Tensor:
                raw = torch.randint(0, 126, stored, dtype=torch.uint8, device=device)
                raw |= torch.randint(0, 2, stored, dtype=torch.uint8, device=device) << 7
                return raw if is_packed(cache_dtype) else raw.view(cache_dtype)

            def scales() -> torch.Tensor:
                groups = scale_shape(shape, cache_dtype)
                return (torch.rand(groups, device=device) * 0.01).to(scale_dtype(cache_dtype))

            return Paged(codes(), codes(), scales(), scales(), block_tables, seq_lens_t)
        return Paged(
            torch.randn(shape, dtype=cache_dtype, device=device),
            torch.randn(shape, dtype=cache_dtype, device=device),
            None,
            None,
            block_tables,
            seq_lens_t,
        )
    key = torch.randn(shape, device=device) * torch.exp(
        0.5 * torch.randn(shape[:3] + (1,), device=device)
    )
    value = torch.randn(shape, device=device)
    if not is_quantized(cache_dtype):
        return Paged(
            key.to(cache_dtype), value.to(cache_dtype), None, None, block_tables, seq_lens_t
        )
    kc = torch.empty(stored_shape(shape, cache_dtype), dtype=cache_dtype, device=device)
    vc = torch.empty_like(kc)
    ks = torch.empty(scale_shape(shape, cache_dtype), dtype=scale_dtype(cache_dtype), device=device)
    vs = torch.empty_like(ks)
    slots = torch.arange(num_blocks * block_size, device=device)
    write_kv_cache_ref(
        key.view(-1, num_kv_heads, head_dim),
        value.view(-1, num_kv_heads, head_dim),
        kc,
        vc,
        slots,
        ks,
        vs,
    )
    return Paged(kc, vc, ks, vs, block_tables, seq_lens_t)


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


# --------------------------------------------------------------------------- correctness


@dataclass(frozen=True)
class Check:
    kernel: str
    case: str
    error: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.error <= self.bound


def _guarded(kernel: str, label: str, bound: float, fn: Callable[[], float]) -> Check:
    """Run one check; an exception (a compile error, say) is a failure, not the end."""
    try:
        return Check(kernel, label, fn(), bound)
    except Exception as err:  # a failed check is reported; the others go on
        message = " ".join(str(err).split())[:300]
        return Check(kernel, f"{label} **{type(err).__name__}: {message}**", float("inf"), bound)


def check_cache_write(device: torch.device, shapes: list[tuple[int, int, int]]) -> list[Check]:
    """Bit-exact agreement (0 mismatched bytes) with quant.py's formula evaluated with IEEE
    division; and, for quantized caches, within one quantization step of write_kv_cache_ref
    run on this device (torch on CUDA divides by the Python scalar QMAX as a multiplication
    by its reciprocal, so its scales can differ from amax / QMAX in the last bit)."""
    checks = []
    for cache_dtype, in_dtype in [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.int8, torch.bfloat16),
        (torch.int8, torch.float32),
        (FP8, torch.float32),
        (FP8, torch.bfloat16),
        (torch.uint8, torch.bfloat16),  # int4
        (torch.uint8, torch.float32),
    ]:
        for shape in shapes:
            label = (
                f"{DTYPE_NAMES[in_dtype]}->{DTYPE_NAMES[cache_dtype]} T{shape[0]} "
                f"Hkv{shape[1]} D{shape[2]}"
            )
            try:
                exact, steps = _cache_write_errors(shape, in_dtype, cache_dtype, device)
            except Exception as err:  # a failed check is reported; the others go on
                checks.append(
                    Check(
                        "cache_write",
                        f"{label} **{type(err).__name__}: {' '.join(str(err).split())[:300]}**",
                        float("inf"),
                        0,
                    )
                )
                continue
            checks.append(
                Check("cache_write", f"{label}: mismatched bytes vs IEEE formula", exact, 0.0)
            )
            if steps is not None:
                checks.append(
                    Check(
                        "cache_write",
                        f"{label}: quantization steps from the device's torch ref",
                        steps,
                        1.0,
                    )
                )
    return checks


def _cache_write_errors(
    shape: tuple[int, int, int],
    in_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    device: torch.device,
) -> tuple[float, float | None]:
    num_tokens, num_kv_heads, head_dim = shape
    mag = torch.exp(3 * torch.randn(num_tokens, num_kv_heads, 1, device=device))
    key = (torch.randn(shape, device=device) * mag).to(in_dtype)
    value = torch.randn(shape, device=device).to(in_dtype)
    num_blocks = triton.cdiv(num_tokens, 16) + 2
    slots = torch.randperm(num_blocks * 16, device=device)[:num_tokens]
    slots[::7] = -1
    quantized = is_quantized(cache_dtype)
    full = (num_blocks, 16, num_kv_heads, head_dim)
    # -100 (156 as a uint8) is no code the quantizers write; nor is a -1 scale.
    pool = [
        torch.full(stored_shape(full, cache_dtype), -100.0, device=device).to(cache_dtype)
        for _ in range(2)
    ]
    if quantized:
        groups = scale_shape(full, cache_dtype)
        pool += [
            torch.full(groups, -1.0, dtype=scale_dtype(cache_dtype), device=device)
            for _ in range(2)
        ]
    ieee_pool = [t.clone() for t in pool]
    ref_pool = [t.clone() for t in pool]
    write_kv_cache(key, value, pool[0], pool[1], slots, *pool[2:])
    write_kv_cache_ref(key, value, ref_pool[0], ref_pool[1], slots, *ref_pool[2:])
    if not quantized:
        return _mismatched_bytes(pool, ref_pool), None
    keep = slots >= 0
    flat = slots[keep]
    for x, cache, scales in (
        (key, ieee_pool[0], ieee_pool[2]),
        (value, ieee_pool[1], ieee_pool[3]),
    ):
        codes, scale = _quantize_ieee(x[keep], cache_dtype)
        cache.view(-1, num_kv_heads, codes.shape[-1])[flat] = codes
        scales.view(-1, num_kv_heads, scale.shape[-1])[flat] = scale
    group = group_size(cache_dtype, head_dim)
    steps = 0.0
    for c, s, rc, rs in (
        (pool[0], pool[2], ref_pool[0], ref_pool[2]),
        (pool[1], pool[3], ref_pool[1], ref_pool[3]),
    ):
        deq = dequantize(c, s, torch.float32)
        ref = dequantize(rc, rs, torch.float32)
        per_channel = rs.float().repeat_interleave(group, dim=-1)
        if cache_dtype == torch.int8:
            step = per_channel
        elif is_packed(cache_dtype):
            # One code step; and a float16 scale one ulp (2**-10 relative at most) off the
            # reference's moves a code of up to 7 by 7 * 2**-10 of a step on top of that.
            step = per_channel * (1 + 7 * 2.0**-10)
        else:  # one e4m3 ulp: 2**-3 relative, 2**-9 (subnormal spacing) times the scale
            step = torch.maximum(ref.abs() * 2.0**-3, per_channel * 2.0**-9)
        steps = max(steps, float(((deq - ref).abs() / step).max()))
    return _mismatched_bytes(pool, ieee_pool), steps


def _quantize_ieee(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """quant.quantize with scale = amax / QMAX rounded once (computed in float64 and rounded
    to float32, as IEEE division does short of a double rounding), then, for int4, rounded to
    its float16 scale dtype, which the codes divide by."""
    qmax = quant_max(cache_dtype)
    t, h, d = x.shape
    g = group_size(cache_dtype, d)
    x32 = x.float().view(t, h, d // g, g)
    scale = (x32.abs().amax(dim=-1).double() / qmax).float().clamp_min(min_scale(cache_dtype))
    scale = scale.to(scale_dtype(cache_dtype))
    scaled = (x32 / scale.float().unsqueeze(-1)).clamp(-qmax, qmax).view(t, h, d)
    if cache_dtype == torch.int8:
        codes = scaled.round().to(torch.int8)
    elif is_packed(cache_dtype):  # channel 2j in the low nibble, 2j + 1 in the high one
        nibbles = (scaled.round() + INT4_OFFSET).to(torch.uint8)
        codes = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    else:
        codes = scaled.to(FP8)
    return codes, scale


def _mismatched_bytes(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return float(
        sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(got, want))
    )


@dataclass(frozen=True)
class AttnCase:
    query: torch.dtype
    cache: torch.dtype
    head_dim: int
    group: int
    block_size: int
    lens: tuple[int, ...]
    window: int | None = None
    sinks: int = 0
    num_splits: int | None = None

    def label(self) -> str:
        win = f" win{self.window}+{self.sinks}" if self.window else ""
        splits = f" splits{self.num_splits}" if self.num_splits else ""
        return (
            f"q {DTYPE_NAMES[self.query]} kv {DTYPE_NAMES[self.cache]} D{self.head_dim} "
            f"G{self.group} bs{self.block_size} lens{list(self.lens)}{win}{splits}"
        )

    def bound(self) -> float:
        return 1e-4 if self.query == torch.float32 else 1.5e-2


def attention_cases(dry_run: bool) -> list[AttnCase]:
    if dry_run:
        lens: tuple[int, ...] = (1, 15, 16, 17, 70)
        return [
            AttnCase(torch.float32, torch.float32, 64, 4, 16, lens),
            AttnCase(torch.bfloat16, torch.bfloat16, 80, 8, 16, lens, 24, 2, 3),
            AttnCase(torch.float32, torch.int8, 128, 1, 32, lens, num_splits=2),
            AttnCase(torch.bfloat16, FP8, 64, 4, 16, lens, 40),
        ]
    lens = (1, 15, 16, 17, 300, 2049, 5000)
    return [
        AttnCase(torch.float32, torch.float32, 128, 4, 16, lens),
        AttnCase(torch.float32, torch.float32, 64, 1, 64, lens, 700, 4, 7),
        AttnCase(torch.bfloat16, torch.bfloat16, 128, 4, 16, lens),
        AttnCase(torch.bfloat16, torch.bfloat16, 80, 8, 32, lens, 1000, 4),
        AttnCase(torch.float16, torch.float16, 96, 2, 16, lens, num_splits=16),
        AttnCase(torch.bfloat16, torch.bfloat16, 256, 4, 16, lens),
        AttnCase(torch.bfloat16, torch.int8, 128, 4, 16, lens),
        AttnCase(torch.float32, torch.int8, 64, 8, 32, lens, 500, 0, 5),
        AttnCase(torch.bfloat16, FP8, 128, 4, 16, lens, 256, 4),
        AttnCase(torch.float32, FP8, 128, 4, 16, lens),
        AttnCase(torch.float16, FP8, 32, 4, 8, lens),
    ]


def check_attention(device: torch.device, dry_run: bool) -> list[Check]:
    checks = []
    for case in attention_cases(dry_run):
        checks.append(
            _guarded("decode", case.label(), case.bound(), partial(_decode_error, case, device))
        )
        q_lens = [min(n, 3 * case.block_size + 5) for n in case.lens]
        checks.append(
            _guarded(
                "prefill",
                case.label() + f" new{q_lens}",
                case.bound(),
                partial(_prefill_error, case, q_lens, device),
            )
        )
    return checks


def _decode_error(case: AttnCase, device: torch.device) -> float:
    num_kv_heads = 2
    paged = random_paged(
        list(case.lens),
        num_kv_heads,
        case.head_dim,
        case.block_size,
        case.cache,
        device,
        shared_prefix_blocks=1,
    )
    window: dict[str, Any] = dict(sliding_window=case.window, num_sink_tokens=case.sinks)
    scale = case.head_dim**-0.5
    query = torch.randn(len(case.lens), num_kv_heads * case.group, case.head_dim, device=device).to(
        case.query
    )
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(
        query,
        scale=scale,
        out=out,
        num_splits=case.num_splits,
        **paged.tables(),
        **paged.caches(),
        **window,
    )
    ref = paged_decode_attention_ref(
        query.double(), scale=scale, **paged.tables(), **paged.caches(f64=True), **window
    )
    return max_rel_err(out, ref)


def _prefill_error(case: AttnCase, q_lens: list[int], device: torch.device) -> float:
    """Each sequence's last q_lens[i] tokens are new."""
    num_kv_heads = 2
    paged = random_paged(
        list(case.lens),
        num_kv_heads,
        case.head_dim,
        case.block_size,
        case.cache,
        device,
        shared_prefix_blocks=1,
    )
    window: dict[str, Any] = dict(sliding_window=case.window, num_sink_tokens=case.sinks)
    scale = case.head_dim**-0.5
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32, device=device)
    query = torch.randn(sum(q_lens), num_kv_heads * case.group, case.head_dim, device=device).to(
        case.query
    )
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(
        query,
        scale=scale,
        out=out,
        query_start_loc=qsl,
        **paged.tables(),
        **paged.caches(),
        **window,
    )
    ref = paged_prefill_attention_ref(
        query.double(),
        scale=scale,
        query_start_loc=qsl,
        **paged.tables(),
        **paged.caches(f64=True),
        **window,
    )
    return max_rel_err(out, ref)


# --------------------------------------------------------------------------- timing


def make_timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn: do_bench on CUDA; one call on the CPU (dry run)."""
    if device.type == "cuda":
        return lambda fn: float(
            triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        )

    def once(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return once


def copy_bandwidth(device: torch.device, timer, num_bytes: int) -> float:
    """Bytes/s of a device-to-device clone (read + write)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = timer(partial(dst.copy_, src))
    return 2 * num_bytes / (ms * 1e-3)


def contiguous_kv(paged: Paged, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K/V as [B, Hkv, L, D] for SDPA, gathered one sequence at a time."""
    shape = (batch, NUM_KV_HEADS, context, HEAD_DIM)
    k = torch.empty(shape, dtype=paged.key_cache.dtype, device=paged.key_cache.device)
    v = torch.empty_like(k)
    num_blocks = context // BLOCK_SIZE
    for b in range(batch):
        ids = paged.block_tables[b, :num_blocks].long()
        k[b] = paged.key_cache[ids].reshape(context, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1)
        v[b] = paged.value_cache[ids].reshape(context, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1)
    return k, v


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q [B, H, 1, D]; k, v [B, Hkv, L, D]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


@dataclass
class DecodeRow:
    batch: int
    context: int
    kv: str
    splits: int
    ms: float
    bytes: float
    sdpa_ms: float | None = None
    graph_ms: float | None = None  # replayed from a CUDA graph (no Python launch cost)


def time_decode(
    device: torch.device,
    timer,
    batches: list[int],
    contexts: list[int],
    kv_dtypes: list[torch.dtype],
    with_sdpa: bool,
) -> list[DecodeRow]:
    rows = []
    scale = HEAD_DIM**-0.5
    for kv_dtype in kv_dtypes:
        channel_bytes = kv_bytes_per_channel(kv_dtype, HEAD_DIM)  # scales included
        for batch in batches:
            for context in contexts:
                kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * channel_bytes
                if kv_bytes > MAX_KV_BYTES:
                    continue
                paged = random_paged(
                    [context] * batch,
                    NUM_KV_HEADS,
                    HEAD_DIM,
                    BLOCK_SIZE,
                    kv_dtype,
                    device,
                    values="fast",
                )
                query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
                out = torch.empty_like(query)
                splits = default_num_splits(
                    batch, NUM_KV_HEADS, paged.block_tables.shape[1] * BLOCK_SIZE, device
                )
                ms = timer(
                    partial(
                        paged_decode_attention,
                        query,
                        scale=scale,
                        out=out,
                        **paged.tables(),
                        **paged.caches(),
                    )
                )
                io_bytes = kv_bytes + 2 * query.numel() * query.element_size()
                row = DecodeRow(batch, context, DTYPE_NAMES[kv_dtype], splits, ms, io_bytes)
                if device.type == "cuda" and ms < 0.25:  # may be launch-bound: GPU time alone
                    row.graph_ms = _graph_ms(
                        partial(
                            paged_decode_attention,
                            query,
                            scale=scale,
                            out=out,
                            **paged.tables(),
                            **paged.caches(),
                        )
                    )
                if with_sdpa and not is_quantized(kv_dtype):
                    row.sdpa_ms = _time_sdpa_decode(timer, paged, query, batch, context, scale)
                rows.append(row)
                print(
                    f"  decode {row.kv} B{batch} L{context}: {ms * 1e3:.1f} µs"
                    + (f", SDPA {row.sdpa_ms * 1e3:.1f} µs" if row.sdpa_ms else ""),
                    flush=True,
                )
                del paged
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _graph_ms(fn: Callable[[], object]) -> float | None:
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))
    except Exception as err:  # capture can fail; the plain timing still stands
        print(f"CUDA graph timing failed: {type(err).__name__}: {str(err)[:120]}")
        return None


def _time_sdpa_decode(
    timer, paged: Paged, query: torch.Tensor, batch: int, context: int, scale: float
) -> float | None:
    try:
        k, v = contiguous_kv(paged, batch, context)
        q4 = query.unsqueeze(2)  # [B, H, 1, D]
        return timer(partial(sdpa_decode, q4, k, v, scale))
    except (torch.cuda.OutOfMemoryError, RuntimeError) as err:  # no backend / no memory
        print(f"SDPA B{batch} L{context}: {type(err).__name__}: {str(err)[:120]}")
        return None


@dataclass
class PrefillShape:
    batch: int
    new: int
    cached: int
    window: int | None = None

    def label(self) -> str:
        win = f", window {self.window}" if self.window else ""
        return f"B{self.batch} new {self.new} after {self.cached}{win}"

    def flops(self) -> float:
        """4 * H * D per visible query-key pair (QK^T and PV)."""
        pos = np.arange(self.cached, self.cached + self.new, dtype=np.float64)
        keys = pos + 1
        if self.window is not None:
            keys = np.minimum(keys, self.window)
        return float(4 * NUM_HEADS * HEAD_DIM * self.batch * keys.sum())


def time_prefill(
    device: torch.device, timer, shapes: list[PrefillShape], with_sdpa: bool
) -> list[tuple[PrefillShape, float, float | None]]:
    rows = []
    scale = HEAD_DIM**-0.5
    for shape in shapes:
        lens = [shape.cached + shape.new] * shape.batch
        paged = random_paged(
            lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, device, values="fast"
        )
        query = torch.randn(
            shape.batch * shape.new, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device
        )
        qsl = torch.arange(0, shape.batch + 1, dtype=torch.int32, device=device) * shape.new
        out = torch.empty_like(query)
        ms = timer(
            partial(
                paged_prefill_attention,
                query,
                scale=scale,
                out=out,
                query_start_loc=qsl,
                sliding_window=shape.window,
                **paged.tables(),
                **paged.caches(),
            )
        )
        sdpa_ms = None
        if with_sdpa and shape.cached == 0 and shape.window is None:
            k, v = contiguous_kv(paged, shape.batch, shape.new)
            q4 = query.view(shape.batch, shape.new, NUM_HEADS, HEAD_DIM).transpose(1, 2)
            sdpa_ms = timer(
                partial(
                    torch.nn.functional.scaled_dot_product_attention,
                    q4,
                    k,
                    v,
                    is_causal=True,
                    scale=scale,
                    enable_gqa=True,
                )
            )
        rows.append((shape, ms, sdpa_ms))
    return rows


def sweep(device: torch.device, timer, copy_bw: float, dry_run: bool) -> list[str]:
    """Decode and prefill launch configurations on a few shapes (the default marked *)."""
    lines = ["| op | shape | config | µs | % copy BW or TFLOP/s |", "|---|---|---|---|---|"]
    scale = HEAD_DIM**-0.5
    unquantized = [DecodeConfig(bn, w, s) for bn, w, s in [(128, 4, 3), (64, 4, 3)]]
    quantized = [
        DecodeConfig(bn, w, s)
        for bn, w, s in [(128, 4, 3), (128, 4, 2), (64, 4, 3), (64, 4, 2), (128, 8, 3)]
    ]
    decode_shapes = [(2, 48, torch.bfloat16, unquantized[:2]), (2, 48, FP8, quantized[:2])]
    if not dry_run:
        decode_shapes = [
            (32, 4096, torch.bfloat16, unquantized),
            (32, 8192, FP8, quantized),
            (128, 2048, FP8, quantized),
            (1, 32768, FP8, quantized),
            (32, 8192, torch.int8, quantized),
        ]
    for batch, context, kv_dtype, configs in decode_shapes:
        paged = random_paged(
            [context] * batch, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, kv_dtype, device, values="fast"
        )
        query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(query)
        io_bytes = (
            2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kv_bytes_per_channel(kv_dtype, HEAD_DIM)
        )
        base = default_num_splits(batch, NUM_KV_HEADS, context, device)
        default = default_decode_config(torch.bfloat16, BLOCK_SIZE, HEAD_DIM)
        for config in configs:
            split_choices = [base] if is_quantized(kv_dtype) else sorted({max(1, base // 2), base})
            for splits in split_choices:
                ms = timer(
                    partial(
                        paged_decode_attention_with_config,
                        query,
                        scale=scale,
                        config=config,
                        out=out,
                        num_splits=splits,
                        **paged.tables(),
                        **paged.caches(),
                    )
                )
                mark = "*" if config == default and splits == base else ""
                lines.append(
                    f"| decode | B{batch} L{context} {DTYPE_NAMES[kv_dtype]} | "
                    f"{mark}bn{config.block_n} w{config.num_warps} "
                    f"s{config.num_stages} splits{splits} | "
                    f"{ms * 1e3:.1f} | {100 * io_bytes / (ms * 1e-3) / copy_bw:.1f}% |"
                )
                print(lines[-1], flush=True)
        del paged
    shape = PrefillShape(1, 64, 0) if dry_run else PrefillShape(1, 4096, 0)
    paged = random_paged(
        [shape.new], NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, device, values="fast"
    )
    query = torch.randn(shape.new, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    qsl = torch.tensor([0, shape.new], dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    prefill_configs = [
        PrefillConfig(bm, bn, w, s)
        for bm, bn, w, s in [
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (128, 64, 8, 3),
            (128, 128, 8, 3),
            (64, 32, 4, 3),
        ]
    ]
    for prefill_config in prefill_configs[: 2 if dry_run else None]:
        ms = timer(
            partial(
                paged_prefill_attention_with_config,
                query,
                scale=scale,
                config=prefill_config,
                out=out,
                query_start_loc=qsl,
                **paged.tables(),
                **paged.caches(),
            )
        )
        lines.append(
            f"| prefill | {shape.label()} bf16 | "
            f"bm{prefill_config.block_m} bn{prefill_config.block_n} "
            f"w{prefill_config.num_warps} s{prefill_config.num_stages} | {ms * 1e3:.1f} | "
            f"{shape.flops() / (ms * 1e-3) / 1e12:.1f} TFLOP/s |"
        )
    return lines


# --------------------------------------------------------------------------- report


def header(device: torch.device, args: argparse.Namespace) -> list[str]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = (
            f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
        )
    else:
        gpu = f"none (CPU {platform.processor() or platform.machine()}, Triton interpreter)"
    mode = "dry run" if args.dry_run else ("quick" if args.quick else "full")
    return [
        "# Paged-attention kernels: GPU check and benchmark",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- device: {gpu}",
        f"- torch {torch.__version__}, triton {triton.__version__}, numpy {np.__version__}, "
        f"python {platform.python_version()}",
        f"- mode: {mode}; timings: triton.testing.do_bench median (warmup 25 ms, rep 100 ms)",
        f"- decode shapes: {NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head_dim "
        f"{HEAD_DIM}, block {BLOCK_SIZE}, bf16 query",
        f"- default configs: decode {default_decode_config(torch.bfloat16, BLOCK_SIZE, HEAD_DIM)}"
        f"; prefill {default_prefill_config(torch.bfloat16, BLOCK_SIZE, HEAD_DIM)}",
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller timing grid")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configs")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU / interpreter, tiny shapes: check that the script works",
    )
    parser.add_argument("--out", type=Path, help="write the markdown report here too")
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        parser.error("no CUDA device: run with --dry-run")
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(int(time.time()))  # fresh inputs every run
    timer = make_timer(device)
    started = time.perf_counter()
    report = header(device, args)

    def emit(lines: list[str]) -> None:
        report.extend(lines)
        print("\n".join(lines), flush=True)
        if args.out:  # rewritten after every section, so a cut-off run keeps what it had
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(report) + "\n")

    print("\n".join(report), flush=True)
    checks = check_cache_write(
        device, [(37, 3, 80)] if args.dry_run else [(37, 3, 80), (1000, 8, 128), (300, 2, 64)]
    )
    checks += check_attention(device, args.dry_run)
    failed = [c for c in checks if not c.ok]
    emit(
        [
            "## Correctness against the torch references",
            "",
            "| kernel | case | error | bound | result |",
            "|---|---|---|---|---|",
        ]
        + [
            f"| {c.kernel} | {c.case} | {c.error:.2e} | {c.bound:g} | "
            f"{'pass' if c.ok else '**FAIL**'} |"
            for c in checks
        ]
        + [
            "",
            f"{len(checks) - len(failed)}/{len(checks)} checks passed "
            f"({time.perf_counter() - started:.0f} s so far)",
            "",
        ]
    )

    copy_bw = copy_bandwidth(device, timer, 2 << 20 if args.dry_run else 4 << 30)
    emit([f"Device-to-device copy bandwidth (read + write): **{copy_bw / 1e9:.0f} GB/s**", ""])

    if args.sweep or args.dry_run:
        try:
            emit(
                ["## Launch-config sweep", ""] + sweep(device, timer, copy_bw, args.dry_run) + [""]
            )
        except Exception:
            traceback.print_exc()

    if args.dry_run:
        batches, contexts, shapes = (
            [1, 2],
            [16, 48],
            [PrefillShape(2, 40, 24), PrefillShape(1, 64, 0)],
        )
    elif args.quick:
        batches, contexts = [1, 32, 128], [2048, 8192, 32768]
        shapes = [PrefillShape(1, 4096, 0), PrefillShape(8, 512, 3584)]
    else:
        batches, contexts = [1, 8, 32, 64, 128, 256], [512, 2048, 4096, 8192, 16384, 32768]
        shapes = [
            PrefillShape(1, 4096, 0),
            PrefillShape(4, 1024, 0),
            PrefillShape(1, 16384, 0),
            PrefillShape(8, 512, 3584),
            PrefillShape(1, 8192, 0, window=4096),
        ]
    try:
        rows = time_decode(device, timer, batches, contexts, [torch.bfloat16, FP8], with_sdpa=True)
    except Exception:  # keep the rest of the report
        traceback.print_exc()
        rows = []
    bf16_ms = {(r.batch, r.context): r.ms for r in rows if r.kv == "bf16"}
    lines = [
        "## Decode attention",
        "",
        "| batch | context | KV | splits | triton µs | GB/s | % of copy BW | "
        "CUDA-graph µs | SDPA bf16 µs | SDPA % of copy BW "
        "| triton speedup vs SDPA (fp8: vs bf16 triton) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gbs = r.bytes / (r.ms * 1e-3)
        if r.sdpa_ms is not None:
            sdpa = f"{r.sdpa_ms * 1e3:.1f} | {100 * r.bytes / (r.sdpa_ms * 1e-3) / copy_bw:.0f}%"
            speedup = f"{r.sdpa_ms / r.ms:.2f}x"
        else:
            sdpa = "- | -"
            ref = bf16_ms.get((r.batch, r.context))
            speedup = f"{ref / r.ms:.2f}x vs bf16" if r.kv != "bf16" and ref else "-"
        graph = f"{r.graph_ms * 1e3:.1f}" if r.graph_ms is not None else "-"
        lines.append(
            f"| {r.batch} | {r.context} | {r.kv} | {r.splits} | {r.ms * 1e3:.1f} | "
            f"{gbs / 1e9:.0f} | {100 * gbs / copy_bw:.0f}% | {graph} | {sdpa} | "
            f"{speedup} |"
        )
    big = [r for r in rows if r.kv == "bf16" and r.batch >= 32 and r.context >= 4096]
    if big:
        worst = min(r.bytes / (r.ms * 1e-3) / copy_bw for r in big)
        lines += [
            "",
            f"bf16 decode at batch >= 32, context >= 4k: worst {100 * worst:.0f}% of "
            "copy bandwidth (goal 70%).",
        ]
    emit(lines + [""])

    try:
        prefill = time_prefill(device, timer, shapes, with_sdpa=True)
    except Exception:
        traceback.print_exc()
        prefill = []
    lines = [
        "## Prefill attention (bf16)",
        "",
        "| shape | triton ms | TFLOP/s | SDPA causal ms | SDPA TFLOP/s |",
        "|---|---|---|---|---|",
    ]
    for shape, ms, sdpa_ms in prefill:
        tf = shape.flops() / (ms * 1e-3) / 1e12
        sdpa = (
            f"{sdpa_ms:.3f} | {shape.flops() / (sdpa_ms * 1e-3) / 1e12:.0f}"
            if sdpa_ms is not None
            else "- | -"
        )
        lines.append(f"| {shape.label()} | {ms:.3f} | {tf:.0f} | {sdpa} |")
    emit(lines + [""])

    emit(
        [
            f"Total {time.perf_counter() - started:.0f} s; "
            f"{'all checks passed' if not failed else f'{len(failed)} CHECKS FAILED'}."
        ]
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
