"""The torch backend's ops: the references, with what every layer of a step derives from the
same metadata (gather rows, masks, which slots are padding) computed for the first layer only.

The model runner builds new metadata tensors for each step and hands the same objects to
every layer; the ops recognise them by identity (and, outside inference mode, by version, so
an in-place change is seen). Results equal the references' exactly: the same ops run, fewer
times.
"""

from __future__ import annotations

import torch

from .cache_write import write_kv_slots_ref
from .cpu_ops import load_cpu_ops
from .decode_attention import DecodeGather, paged_decode_attention_gathered, plan_decode_gather
from .prefill_attention import paged_prefill_attention_ref
from .quant import is_quantized


def _stamp(t: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """The tensor itself (held, so its id is not reused) and its version counter."""
    return t, None if t.is_inference() else t._version


def _same(stamp: tuple[torch.Tensor, int | None] | None, t: torch.Tensor) -> bool:
    return stamp is not None and stamp[0] is t and stamp == _stamp(t)


# Query dtypes (and scale dtypes) the C++ attention over a quantized cache takes.
_QUANTIZED_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCALE_DTYPES = (torch.float32, torch.float16)


def cpu_kernel_applies(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    sliding_window: int | None,
    num_sink_tokens: int,
    key_scale_cache: torch.Tensor | None,
) -> bool:
    """Whether kvchat's C++ attention kernels take this call: full attention on the CPU, where
    the ops could be built, over a plain cache of the query's dtype or an int8 / fp8 / int4
    cache with its scale cache (for a float32, bfloat16 or float16 query)."""
    if key_scale_cache is None:
        cache_fits = query.dtype == key_cache.dtype
    else:
        cache_fits = (
            is_quantized(key_cache.dtype)
            and key_scale_cache.dtype in _SCALE_DTYPES
            and query.dtype in _QUANTIZED_QUERY_DTYPES
        )
    return (
        sliding_window is None
        and num_sink_tokens == 0
        and cache_fits
        and query.device.type == "cpu"
        and load_cpu_ops()
    )


class StepDecode:
    """`paged_decode_attention_ref` with the gather plan made once per step (per window
    setting: layers may differ in sliding window). On the CPU, full attention runs kvchat's C++
    kernel instead (kernels/cpu_decode_attention.cpp: no gather, no mask; the same float32
    arithmetic, up to summation order), over a plain cache or a quantized one (each row
    decoded as it is read, no dequantized copy of the context)."""

    def __init__(self, use_cpu_kernel: bool = True) -> None:
        self.use_cpu_kernel = use_cpu_kernel
        self._tables: tuple[torch.Tensor, int | None] | None = None
        self._lens: tuple[torch.Tensor, int | None] | None = None
        self._plans: dict[tuple[int, int, int | None, int], DecodeGather] = {}

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        *,
        sliding_window: int | None = None,
        num_sink_tokens: int = 0,
        key_scale_cache: torch.Tensor | None = None,
        value_scale_cache: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.use_cpu_kernel and cpu_kernel_applies(
            query, key_cache, sliding_window, num_sink_tokens, key_scale_cache
        ):
            if out is None:
                out = torch.empty_like(query)
            if key_scale_cache is None:
                torch.ops.kvchat_cpu.decode_attention(
                    query, key_cache, value_cache, block_tables, seq_lens, scale, out
                )
            else:
                assert value_scale_cache is not None, "quantized cache needs its scale cache"
                torch.ops.kvchat_cpu.decode_attention_quantized(
                    query,
                    key_cache,
                    value_cache,
                    key_scale_cache,
                    value_scale_cache,
                    block_tables,
                    seq_lens,
                    scale,
                    out,
                )
            return out
        if not (_same(self._tables, block_tables) and _same(self._lens, seq_lens)):
            self._tables, self._lens, self._plans = _stamp(block_tables), _stamp(seq_lens), {}
        block_size = key_cache.shape[1]
        key = (query.shape[0], block_size, sliding_window, num_sink_tokens)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_decode_gather(
                block_tables,
                seq_lens,
                block_size,
                query.shape[0],
                sliding_window,
                num_sink_tokens,
            )
            self._plans[key] = plan
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


class StepPrefill:
    """`paged_prefill_attention_ref`, except on the CPU, where full attention runs kvchat's C++
    kernel (kernels/cpu_prefill_attention.cpp: the chunk's tokens against the cached prefix and
    causally against each other, read in place through the block table; the same float32
    arithmetic, up to summation order), 2-3x torch's flash kernel on a prefill; over a
    quantized cache its twin, which decodes each row as it is read where the reference
    dequantizes the whole context through torch first (2-2.5x the time of a plain cache's
    prefill on SmolLM2-135M)."""

    def __init__(self, use_cpu_kernel: bool = True) -> None:
        self.use_cpu_kernel = use_cpu_kernel

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        *,
        sliding_window: int | None = None,
        num_sink_tokens: int = 0,
        key_scale_cache: torch.Tensor | None = None,
        value_scale_cache: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.use_cpu_kernel and cpu_kernel_applies(
            query, key_cache, sliding_window, num_sink_tokens, key_scale_cache
        ):
            ops = torch.ops.kvchat_cpu
            scales: tuple[torch.Tensor, ...] = ()
            if key_scale_cache is None:
                op = ops.prefill_attention
                supported = ops.prefill_attention_supported(query.shape[-1])
            else:
                assert value_scale_cache is not None, "quantized cache needs its scale cache"
                op, scales = ops.prefill_attention_quantized, (key_scale_cache, value_scale_cache)
                supported = ops.prefill_attention_quantized_supported(query.shape[-1])
            if supported:
                if out is None:
                    out = torch.empty_like(query)
                op(query, key_cache, value_cache, *scales, block_tables, seq_lens, query_start_loc,
                   scale, out)  # fmt: skip
                return out
        return paged_prefill_attention_ref(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            sliding_window=sliding_window,
            num_sink_tokens=num_sink_tokens,
            key_scale_cache=key_scale_cache,
            value_scale_cache=value_scale_cache,
            out=out,
        )


class StepCacheWrite:
    """`write_kv_cache_ref` that looks for padding slots (-1) once per step: the check reads
    the slots back to the host."""

    def __init__(self) -> None:
        self._slots: tuple[torch.Tensor, int | None] | None = None
        self._keep: torch.Tensor | None = None  # [num_tokens] bool, None: no padding
        self._kept_slots: torch.Tensor | None = None  # [num_kept] int64

    def __call__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        key_scale_cache: torch.Tensor | None = None,
        value_scale_cache: torch.Tensor | None = None,
    ) -> None:
        if not _same(self._slots, slot_mapping):
            slots = slot_mapping.long()
            keep = slots >= 0
            self._slots = _stamp(slot_mapping)
            self._keep = None if bool(keep.all()) else keep
            self._kept_slots = slots if self._keep is None else slots[keep]
        assert self._kept_slots is not None
        if self._keep is not None:
            key, value = key[self._keep], value[self._keep]
        write_kv_slots_ref(
            key,
            value,
            key_cache,
            value_cache,
            self._kept_slots,
            key_scale_cache,
            value_scale_cache,
        )


def rotary_cache_write_cpu(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]
    cos: torch.Tensor,  # [T, 1, D]
    signed_sin: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T], -1 for padding
    num_heads: int,
    num_kv_heads: int,
    key_scale_cache: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """kernels/cpu_layer_ops.cpp's rotary_cache_write -> q [T, Hq, D]; None where it does not
    apply (a quantized cache, another dtype or device, no C++ ops), so the caller takes the
    separate ops."""
    if (
        key_scale_cache is not None
        or qkv.device.type != "cpu"
        or qkv.dtype != key_cache.dtype
        or not key_cache.is_contiguous()
        or not load_cpu_ops()
    ):
        return None
    q: torch.Tensor = torch.ops.kvchat_cpu.rotary_cache_write(
        qkv, cos, signed_sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads
    )
    return q
