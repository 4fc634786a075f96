"""The Hugging Face config a GGUF's metadata describes: config.json from `general.architecture`
and the `<arch>.*` keys (llama.cpp's names), generation_config.json from `tokenizer.ggml.*`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np

from ..errors import GGUFImportError

# general.architecture -> the transformers class that runs it
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# Llama 3.1's rope scaling travels as a tensor of per-frequency divisors, not as metadata.
ROPE_FREQS = "rope_freqs.weight"


def hf_config(
    metadata: Mapping[str, Any], tensors: Mapping[str, gguf.ReaderTensor], dtype: str
) -> dict[str, Any]:
    """config.json for the model the metadata describes."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(
            f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )

    def need(key: str) -> Any:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            raise GGUFImportError(f"metadata {arch}.{key} is missing")
        if not isinstance(value, int | float):
            raise GGUFImportError(f"metadata {arch}.{key} must be one number, got {value!r}")
        return value

    if "token_embd.weight" not in tensors:
        raise GGUFImportError("tensor token_embd.weight is missing")
    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    num_kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv") or num_heads)
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // num_heads)
    rotary_dim = metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise GGUFImportError(
            f"{arch}.rope.dimension_count is {rotary_dim}, not the head size {head_dim}: "
            "partial rotary embeddings are not supported"
        )
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(metadata.get(f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(metadata, arch, tensors, theta, head_dim),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if arch == "mistral":
        config["sliding_window"] = metadata.get(f"{arch}.attention.sliding_window")
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return config


def _rope_scaling(
    metadata: Mapping[str, Any],
    arch: str,
    tensors: Mapping[str, gguf.ReaderTensor],
    theta: float,
    head_dim: int,
) -> dict[str, Any] | None:
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if ROPE_FREQS in tensors:
        freqs = gguf.quants.dequantize(tensors[ROPE_FREQS].data, tensors[ROPE_FREQS].tensor_type)
        return llama3_rope_scaling(np.asarray(freqs, dtype=np.float64), theta, head_dim)
    if scaling == "none":
        return None
    if scaling == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    raise GGUFImportError(
        f"{arch}.rope.scaling.type {scaling!r} is not supported (supported: none, linear)"
    )


def llama3_rope_scaling(freqs: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Llama 3's rope_scaling, recognised from the divisors llama.cpp's converter stored: the
    largest divisor is the factor; the other parameters are Llama 3.1's, checked to fit."""
    factor, low, high, original = float(freqs.max()), 1.0, 4.0, 8192
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    expected = np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, between)
    )
    if freqs.shape != expected.shape or not np.allclose(freqs, expected, rtol=1e-3):
        raise GGUFImportError(
            f"tensor {ROPE_FREQS} holds rope frequency factors that are not Llama 3's "
            "scaling; this rope scaling is not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    eos_ids = [
        metadata[f"tokenizer.ggml.{role}_token_id"]
        for role in ("eos", "eot", "eom")
        if f"tokenizer.ggml.{role}_token_id" in metadata
    ]
    return {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos_ids)),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
