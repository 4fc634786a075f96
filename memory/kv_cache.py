"""KVCache: the preallocated KV tensors (device pool, and host pool for offload/swap).

Layout: one tensor for all layers,
    kv:     [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
    scales: [num_layers, 2, num_blocks, block_size, num_kv_heads, num_groups] (quantized only)
so a block's whole KV (every layer) moves with one index along dim 2. int4 packs two channels
per byte (the last dim is head_dim / 2); every quantized cache keeps a float16 scale per
group of 32 channels (kernels.quant). A quantized cache holds keys
turned by `key_rotation`, and the model turns queries to match.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvchat.kernels.quant import group_size, key_rotation, scale_dtype

from .kv_spec import SCALE_BYTES, KVCacheSpec


class KVCache:
    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
        num_host_blocks: int = 0,
    ) -> None:
        self.spec = spec
        self.device = device
        # What keys are turned by before they are stored, queries before attention (None:
        # keys as they are).
        rotation = key_rotation(spec.head_dim) if spec.keys_rotated else None
        self.key_rotation = rotation.to(device) if rotation is not None else None
        self.kv, self.scales = self._allocate(num_blocks, device, pin=False)
        self.host_kv, self.host_scales = self._allocate(
            num_host_blocks, torch.device("cpu"), pin=device.type == "cuda"
        )

    def _allocate(
        self, num_blocks: int, device: torch.device, pin: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = self.spec
        shape = (s.num_layers, 2, num_blocks, s.block_size, s.num_kv_heads, s.stored_head_dim)
        # Zeroed, not empty: masked attention lanes multiply probabilities of 0 by these values.
        kv = torch.zeros(shape, dtype=s.storage_dtype, device=device, pin_memory=pin)
        scales = None
        if s.is_quantized:
            dtype = scale_dtype(s.storage_dtype)
            # KVCacheSpec counts these bytes without torch: the two must agree.
            assert dtype.itemsize == SCALE_BYTES
            assert s.head_dim // group_size(s.storage_dtype, s.head_dim) == s.scale_groups
            groups = (*shape[:-1], s.scale_groups)
            scales = torch.zeros(groups, dtype=dtype, device=device, pin_memory=pin)
        return kv, scales

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    @property
    def num_host_blocks(self) -> int:
        return self.host_kv.shape[2]

    def layer(
        self, index: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(key_cache, value_cache, key_scales, value_scales) of one layer, as kernels take them."""
        k, v = self.kv[index, 0], self.kv[index, 1]
        if self.scales is None:
            return k, v, None, None
        return k, v, self.scales[index, 0], self.scales[index, 1]

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Device-to-device block copy (copy-on-write)."""
        self._copy(self.kv, self.scales, src, self.kv, self.scales, dst)

    def swap_out(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> None:
        self._copy(self.kv, self.scales, device_ids, self.host_kv, self.host_scales, host_ids)

    def swap_in(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> None:
        self._copy(self.host_kv, self.host_scales, host_ids, self.kv, self.scales, device_ids)

    def block_bytes(
        self, ids: Sequence[int], on_host: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Copies (on the CPU, as bytes) of whole blocks of the device pool, or of the host
        pool when `on_host`: per block (kv [layers, 2, block_size, kv_heads, head bytes],
        scales [layers, 2, block_size, kv_heads, group bytes] or None). The KV store writes them."""
        if not ids:
            return []
        kv, scales = (self.host_kv, self.host_scales) if on_host else (self.kv, self.scales)
        index = torch.tensor(list(ids), dtype=torch.long, device=kv.device)
        # One copy, blocks first: each block's bytes are a contiguous slice of it.
        kv_bytes = _bytes(kv).movedim(2, 0).index_select(0, index).to("cpu")
        scale_bytes = None
        if scales is not None:
            scale_bytes = _bytes(scales).movedim(2, 0).index_select(0, index).to("cpu")
        return [
            (kv_bytes[i], None if scale_bytes is None else scale_bytes[i]) for i in range(len(ids))
        ]

    def write_block(self, block_id: int, kv: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Fill one device block from bytes shaped as `block_bytes` gives them."""
        _bytes(self.kv)[:, :, block_id].copy_(kv.to(self.kv.device))
        if self.scales is not None and scales is not None:
            _bytes(self.scales)[:, :, block_id].copy_(scales.to(self.kv.device))

    def block_byte_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """The shapes `block_bytes` gives a block's kv and scales."""
        shape = _bytes(self.kv).shape
        kv = (shape[0], shape[1], *shape[3:])
        if self.scales is None:
            return kv, None
        s = _bytes(self.scales).shape
        return kv, (s[0], s[1], *s[3:])

    @staticmethod
    def _copy(
        src_kv: torch.Tensor,
        src_scales: torch.Tensor | None,
        src_ids: Sequence[int],
        dst_kv: torch.Tensor,
        dst_scales: torch.Tensor | None,
        dst_ids: Sequence[int],
    ) -> None:
        """Copy whole blocks (every layer, K and V, and their scales) along dim 2.

        Through a byte view: index_copy_ has no kernel for every storage dtype on every device
        (float8 on the CPU), and a block copy never needs to know what the bytes mean."""
        assert len(src_ids) == len(dst_ids)
        if not src_ids:
            return
        src = torch.tensor(list(src_ids), dtype=torch.long, device=src_kv.device)
        dst = torch.tensor(list(dst_ids), dtype=torch.long, device=dst_kv.device)
        pairs = [(src_kv, dst_kv)]
        if src_scales is not None and dst_scales is not None:
            pairs.append((src_scales, dst_scales))
        # Host-to-device may overlap (the stream orders it before the kernels that read it);
        # device-to-host must not: the CPU reads the result right away.
        non_blocking = dst_kv.device.type == "cuda"
        for src_t, dst_t in pairs:
            moved = _bytes(src_t).index_select(2, src).to(dst_t.device, non_blocking=non_blocking)
            _bytes(dst_t).index_copy_(2, dst, moved)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The same storage seen as uint8 (the last dim grows by the element size)."""
    return t.view(torch.uint8)
