"""Engine start-up: what is loaded and measured before the first step. The model's context
length, the KV spec, the KV pools' sizes (memory.kv_layout decides from what is measured here:
on CUDA one profiling pass of the largest step, as vLLM does), and the output rows that are no
token of the tokenizer."""

from __future__ import annotations

import torch

from kvchat.kernels import AttentionOps
from kvchat.kernels.quant import KEY_ROTATION_SEED
from kvchat.memory.config import CacheConfig
from kvchat.memory.kv_cache import KVCache
from kvchat.memory.kv_cache_manager import KVState
from kvchat.memory.kv_layout import DeviceMemory, KVCacheLayout, plan_kv_layout
from kvchat.memory.kv_spec import KVCacheSpec, cdiv
from kvchat.memory.kv_store import KVStore, store_fingerprint, weights_fingerprint

from ..errors import ModelLoadError
from ..model.config import ModelConfig
from ..model.model import LlamaModel
from ..model.runner import ModelRunner
from ..model.sampling_params import SamplingParams
from ..text.tokenizer import Tokenizer
from .scheduler import ScheduledBatch
from .sequence import Sequence


def kv_spec_for(model_config: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> KVCacheSpec:
    return KVCacheSpec(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=cache.block_size,
        model_dtype=dtype,
        kv_cache_dtype=cache.kv_cache_dtype,
        rotate_keys=cache.rotate_keys,
    )


def size_kv_pools(
    cache: CacheConfig,
    spec: KVCacheSpec,
    model: LlamaModel,
    ops: AttentionOps,
    profile_tokens: int,
    device: torch.device,
) -> KVCacheLayout:
    """The pools' sizes (see memory.kv_layout.plan_kv_layout); on CUDA the profiling pass (a
    step of `profile_tokens` prompt tokens) runs only when no size was given. A budget that
    holds no block is a ModelLoadError saying what to raise."""

    def measure() -> DeviceMemory:
        return profile_cuda_memory(model, spec, ops, profile_tokens, device)

    layout = plan_kv_layout(cache, spec.bytes_per_block, measure if device.type == "cuda" else None)
    if layout.num_blocks < 1:
        raise ModelLoadError(
            f"the KV cache budget holds no block of {layout.bytes_per_block} bytes; raise "
            "kv_cache_bytes"
        )
    return layout


def profile_cuda_memory(
    model: LlamaModel,
    spec: KVCacheSpec,
    ops: AttentionOps,
    num_tokens: int,
    device: torch.device,
) -> DeviceMemory:
    """As vLLM does: run the largest step once (`num_tokens` prompt tokens: the step's token
    budget, at most the model's context) in a scratch KV cache, and measure torch's peak
    without that scratch: what the KV pool must leave free."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free_before) - torch.cuda.memory_reserved(device)
    n = num_tokens
    scratch_blocks = cdiv(n, spec.block_size)
    scratch = KVCache(spec, scratch_blocks, device)
    runner = ModelRunner(model, scratch, ops, spec.block_size)
    seq = Sequence("profile", [0] * n, SamplingParams(max_tokens=1), n + 1)
    seq.kv = KVState(block_ids=list(range(scratch_blocks)))
    runner.execute(ScheduledBatch(seqs=[seq], num_new_tokens=[n], num_decode=0))
    torch.cuda.synchronize(device)
    scratch_bytes = scratch.kv.numel() * scratch.kv.element_size()
    peak = torch.cuda.max_memory_allocated(device) - scratch_bytes
    del scratch, runner
    torch.cuda.empty_cache()
    return DeviceMemory(total_bytes=total, peak_bytes=peak, non_torch_bytes=non_torch)


def open_kv_store(
    cache: CacheConfig, model_dir: str, spec: KVCacheSpec, kv: KVCache
) -> KVStore | None:
    """The KV store the cache settings ask for (None: no directory or a cap of 0), under a
    directory named by everything its bytes depend on: the weights, the model's dtype, the KV
    dtype, the block size and the KV's shape."""
    if not cache.kv_store_dir or cache.kv_store_bytes <= 0:
        return None
    kv_shape, scales_shape = kv.block_byte_shapes()
    layout: dict[str, object] = {}
    if spec.keys_rotated:  # keys turned by kernels.quant.key_rotation (its seed) when stored
        layout["key_rotation"] = KEY_ROTATION_SEED
    if spec.is_quantized:  # the scales' format: a store of another reads as garbage
        layout["scales"] = f"float16 x {spec.scale_groups} groups"
    fingerprint = store_fingerprint(
        weights_fingerprint(model_dir),
        {
            "model_dtype": str(spec.model_dtype),
            "kv_cache_dtype": cache.kv_cache_dtype,
            "storage_dtype": str(spec.storage_dtype),
            "block_size": spec.block_size,
            "kv_shape": kv_shape,
            "scales_shape": scales_shape,
            "format": 2,  # 2: every file carries its block hash and a checksum
            **layout,
        },
    )
    return KVStore(cache.kv_store_dir, fingerprint, cache.kv_store_bytes, kv_shape, scales_shape)


def invalid_token_mask(
    tokenizer: Tokenizer | None, vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[vocab] bool, True for output rows that are no token of the tokenizer: padding rows
    (checkpoints pad `vocab_size` past the tokenizer, e.g. to a multiple of 64) and gaps in
    the tokenizer's id range. They are never sampled: an id the tokenizer cannot decode
    must not reach the output processor. None when every row is a token."""
    if tokenizer is None:
        return None
    unknown = [i for i in range(vocab_size) if not tokenizer.is_known_id(i)]
    if not unknown:
        return None
    if len(unknown) == vocab_size:
        raise ModelLoadError(
            f"the tokenizer knows none of the model's {vocab_size} output ids; wrong tokenizer?"
        )
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[unknown] = True
    return mask.to(device)
