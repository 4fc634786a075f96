"""KVCacheSpec: the shape and byte size of one token's KV, and the cache dtype names a user may
configure. Pure arithmetic, importing nothing heavy: the KV pool sizing, the settings and the
service's history planning use it without torch. The tensors it describes are in
`kvchat.memory.kv_cache`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# `auto` stores the model's dtype; int8 and fp8 store 1-byte values, int4 two 4-bit codes per
# byte, each with a float16 scale per group of SCALE_GROUP_SIZE channels (kernels.quant says
# how, and must agree with the numbers here).
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "int4")
QUANTIZED_STORAGE_NAMES = {"int8": "int8", "fp8": "float8_e4m3fn", "int4": "uint8"}
ELEMENTS_PER_BYTE = {"int8": 1, "fp8": 1, "int4": 2}
SCALE_BYTES = 2  # float16
SCALE_GROUP_SIZE = 32


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints: the blocks of `b` tokens that hold `a` tokens."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one token's KV: what the pool is made of."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    model_dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    rotate_keys: bool = True  # quantized caches store keys turned (kernels.quant.key_rotation)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype == "int4" and self.head_dim % 2:
            raise ValueError(f"an int4 KV cache needs an even head_dim, got {self.head_dim}")

    @property
    def is_quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def keys_rotated(self) -> bool:
        """Keys are stored turned by kernels.quant.key_rotation: a quantized cache, unless
        turned off, with a power-of-two head_dim."""
        d = self.head_dim
        return self.is_quantized and self.rotate_keys and d > 0 and d & (d - 1) == 0

    @property
    def storage_dtype(self) -> torch.dtype:
        """The element type of the cache tensors (the one member that imports torch: only the
        tensor side asks for it)."""
        from kvchat.kernels.quant import kv_storage_dtype

        return kv_storage_dtype(self.kv_cache_dtype, self.model_dtype)

    @property
    def storage_dtype_name(self) -> str:
        """The storage dtype as torch names it (`bfloat16`, `int8`, `float8_e4m3fn`)."""
        if self.is_quantized:
            return QUANTIZED_STORAGE_NAMES[self.kv_cache_dtype]
        return str(self.model_dtype).removeprefix("torch.")

    @property
    def element_bytes(self) -> float:
        """Bytes per stored channel: the model dtype's, 1, or 0.5 (int4)."""
        if self.is_quantized:
            return 1 / ELEMENTS_PER_BYTE[self.kv_cache_dtype]
        return float(self.model_dtype.itemsize)

    @property
    def stored_head_dim(self) -> int:
        """The cache tensors' last dim: head_dim, or head_dim / 2 packed (int4)."""
        if self.is_quantized:
            return self.head_dim // ELEMENTS_PER_BYTE[self.kv_cache_dtype]
        return self.head_dim

    @property
    def scale_groups(self) -> int:
        """Scales per (token, layer, K/V, KV head): head_dim / SCALE_GROUP_SIZE where it
        divides, else 1; 0 unquantized."""
        if not self.is_quantized:
            return 0
        if self.head_dim % SCALE_GROUP_SIZE == 0:
            return self.head_dim // SCALE_GROUP_SIZE
        return 1

    @property
    def value_bytes_per_token(self) -> int:
        """2 x layers x kv_heads x the stored head bytes."""
        per_head = self.stored_head_dim * (1 if self.is_quantized else self.model_dtype.itemsize)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def scale_bytes_per_token(self) -> int:
        """The scales of each token, layer, K/V and KV head (quantized caches only)."""
        if not self.is_quantized:
            return 0
        return 2 * self.num_layers * self.num_kv_heads * self.scale_groups * SCALE_BYTES

    @property
    def bytes_per_token(self) -> int:
        return self.value_bytes_per_token + self.scale_bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size
