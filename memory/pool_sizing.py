"""Memory planner: how many tokens, blocks and sessions of a given context fit in a memory
budget, with the arithmetic shown. Pure arithmetic over a KVCacheSpec: no tensors, no torch
(`kvchat memory plan` answers before any model loads). What the engine measures at start-up
is in `kvchat.memory.kv_layout`."""

from __future__ import annotations

from dataclasses import dataclass

from .kv_spec import SCALE_BYTES, KVCacheSpec, cdiv


@dataclass(frozen=True)
class MemoryPlan:
    spec: KVCacheSpec
    weight_bytes: int
    memory_bytes: int | None
    utilization: float
    context_tokens: int | None

    @property
    def usable_bytes(self) -> int | None:
        """Memory x utilization - weights: what the KV pool may take (before the activation
        peak the engine measures at start-up)."""
        if self.memory_bytes is None:
            return None
        return max(0, int(self.memory_bytes * self.utilization) - self.weight_bytes)

    @property
    def num_blocks(self) -> int | None:
        usable = self.usable_bytes
        return None if usable is None else usable // self.spec.bytes_per_block

    @property
    def num_tokens(self) -> int | None:
        blocks = self.num_blocks
        return None if blocks is None else blocks * self.spec.block_size

    @property
    def blocks_per_session(self) -> int | None:
        if self.context_tokens is None:
            return None
        return cdiv(self.context_tokens, self.spec.block_size)

    @property
    def num_sessions(self) -> int | None:
        blocks, per = self.num_blocks, self.blocks_per_session
        if blocks is None or per is None:
            return None
        return blocks // per

    def lines(self) -> list[str]:
        s = self.spec
        elem = s.element_bytes
        out = [
            f"layers {s.num_layers}, kv heads {s.num_kv_heads}, head_dim {s.head_dim}, "
            f"kv cache dtype {s.kv_cache_dtype} ({s.storage_dtype_name}, {elem:g} B/element), "
            f"block size {s.block_size}",
            f"bytes per token = 2 x {s.num_layers} layers x {s.num_kv_heads} kv heads x "
            f"{s.head_dim} head_dim x {elem:g} B = {s.value_bytes_per_token:,} B",
        ]
        if s.is_quantized:
            per = "token and kv head" if s.scale_groups == 1 else "group of channels"
            out.append(
                f"  + scales: 2 x {s.num_layers} x {s.num_kv_heads} x {s.scale_groups} x "
                f"{SCALE_BYTES} B (one float16 per {per}) = {s.scale_bytes_per_token:,} B "
                f"-> {s.bytes_per_token:,} B per token"
            )
        out.append(
            f"bytes per block = {s.bytes_per_token:,} B x {s.block_size} tokens = "
            f"{s.bytes_per_block:,} B ({s.bytes_per_block / 2**20:.2f} MiB)"
        )
        out.append(f"weights = {self.weight_bytes:,} B ({self.weight_bytes / 2**30:.2f} GiB)")
        if self.memory_bytes is not None:
            assert self.usable_bytes is not None and self.num_blocks is not None
            out.append(
                f"KV pool = {self.memory_bytes / 2**30:.2f} GiB x {self.utilization} - weights "
                f"= {self.usable_bytes:,} B ({self.usable_bytes / 2**30:.2f} GiB)"
            )
            out.append(
                f"blocks = {self.usable_bytes:,} B / {s.bytes_per_block:,} B = "
                f"{self.num_blocks:,} blocks = {self.num_tokens:,} tokens"
            )
        blocks = self.blocks_per_session
        if self.context_tokens is not None and blocks is not None:
            out.append(
                f"one session of {self.context_tokens:,} tokens = "
                f"ceil({self.context_tokens:,} / {s.block_size}) = {blocks:,} "
                f"blocks = {blocks * s.bytes_per_block / 2**20:,.1f} MiB"
            )
            if self.num_sessions is not None:
                out.append(
                    f"sessions that fit = {self.num_blocks:,} / {self.blocks_per_session:,} = "
                    f"{self.num_sessions:,}"
                )
        return out


def parse_bytes(text: str) -> int:
    """'80GiB', '24 GB', '512MiB', '1e9' -> bytes."""
    units = {
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "b": 1,
    }
    t = text.strip().lower().replace(" ", "")
    number, factor = t, 1
    for unit, unit_factor in units.items():
        if t.endswith(unit):
            number, factor = t[: -len(unit)], unit_factor
            break
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size (use e.g. 80GiB, 24GB, 512MiB)") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return int(value * factor)
