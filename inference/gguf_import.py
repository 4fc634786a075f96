"""Importing a GGUF file (llama.cpp's format) as the Hugging Face model directory kvchat loads.

What is written: `config.json` and `generation_config.json` from the `<arch>.*` and
`tokenizer.ggml.*` metadata; the weights dequantized (with the `gguf` library) into the asked
dtype as safetensors (`model.safetensors`, or shards with an index past `SHARD_BYTES`), under
their Hugging Face names, with llama.cpp's Q/K row permutation undone for llama and mistral;
`tokenizer.json` and `tokenizer_config.json` (see gguf_tokenizer); `chat_template.jinja` from
`tokenizer.chat_template`.

Everything is checked before a byte is written (architecture, tensor names, shapes and types),
and written into a temporary directory beside the target that is renamed into place at the
end, so a failure never leaves a half-written model."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file
from tqdm import tqdm

from .errors import GGUFImportError
from .gguf_tokenizer import build_tokenizer, special_token
from .model_config import ModelConfig
from .weights import expected_shapes

# general.architecture -> the transformers class that runs it
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# llama.cpp's converter interleaves the rotary halves of Q and K rows for these (`permute`).
_PERMUTED_ARCHITECTURES = ("llama", "mistral")
TENSOR_TYPES = (
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
)  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARD_BYTES = 2 << 30

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama 3.1's rope scaling travels as a tensor of per-frequency divisors, not as metadata.
_ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class _PlannedTensor:
    source: gguf.ReaderTensor
    name: str  # the Hugging Face name
    shape: tuple[int, ...]  # the Hugging Face shape: GGUF lists dimensions innermost first
    num_heads_permuted: int | None  # undo llama.cpp's Q/K permutation over this many heads


def import_gguf(
    gguf_path: str | Path,
    model_dir: str | Path,
    *,
    dtype: str = "float32",
    replace: bool = False,
    progress: bool = False,
) -> ModelConfig:
    """Writes the GGUF at `gguf_path` as a model directory at `model_dir`; returns its config.

    `replace` swaps out an existing non-empty `model_dir` once the new one is complete."""
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    gguf_path, model_dir = Path(gguf_path), Path(model_dir)
    if model_dir.exists() and not replace and not _is_empty_dir(model_dir):
        raise GGUFImportError(f"{model_dir} exists and is not empty; pass --force to replace it")
    reader = _open(gguf_path)
    metadata = _read_metadata(reader, gguf_path)
    sources = {t.name: t for t in reader.tensors}
    config_dict = hf_config(metadata, sources, dtype)
    config = ModelConfig.from_hf_dict(config_dict, source=str(gguf_path))
    plan = _plan_tensors(config, sources, arch=metadata["general.architecture"])
    tokenizer = build_tokenizer(metadata)

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
    try:
        _write_weights(staging, plan, DTYPES[dtype], progress)
        _write_json(staging / "config.json", config_dict)
        _write_json(staging / "generation_config.json", _generation_config(metadata))
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", _tokenizer_config(metadata))
        template = metadata.get("tokenizer.chat_template")
        if isinstance(template, str):
            (staging / "chat_template.jinja").write_text(template, encoding="utf-8")
        _publish(staging, model_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return config


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
    if _ROPE_FREQS in tensors:
        freqs = gguf.quants.dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type)
        return _llama3_scaling(np.asarray(freqs, dtype=np.float64), theta, head_dim)
    if scaling == "none":
        return None
    if scaling == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    raise GGUFImportError(
        f"{arch}.rope.scaling.type {scaling!r} is not supported (supported: none, linear)"
    )


def _llama3_scaling(freqs: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
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
            f"tensor {_ROPE_FREQS} holds rope frequency factors that are not Llama 3's "
            "scaling; this rope scaling is not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def _plan_tensors(
    config: ModelConfig, sources: Mapping[str, gguf.ReaderTensor], arch: str
) -> list[_PlannedTensor]:
    """Every tensor to write, checked against what the model needs (names, shapes, types)."""
    expected = expected_shapes(config)
    plan: list[_PlannedTensor] = []
    for gguf_name, source in sources.items():
        if gguf_name == _ROPE_FREQS:
            continue
        name = _hf_name(gguf_name)
        if name is None or name not in expected:
            raise GGUFImportError(
                f"tensor {gguf_name} is not part of the {arch} model kvchat runs "
                f"({config.num_layers} layers, biases as the metadata implies)"
            )
        shape = tuple(int(n) for n in reversed(source.shape.tolist()))
        if shape != expected[name]:
            raise GGUFImportError(
                f"tensor {gguf_name} has shape {shape}, expected {expected[name]} from the "
                "GGUF's metadata"
            )
        if source.tensor_type not in TENSOR_TYPES:
            raise GGUFImportError(
                f"tensor {gguf_name} is of type {source.tensor_type.name}, which is not "
                f"supported (supported: {', '.join(t.name for t in TENSOR_TYPES)})"
            )
        heads = None
        if arch in _PERMUTED_ARCHITECTURES:
            if ".self_attn.q_proj." in name:
                heads = config.num_heads
            elif ".self_attn.k_proj." in name:
                heads = config.num_kv_heads
        plan.append(_PlannedTensor(source, name, shape, heads))
    written = {t.name for t in plan}
    missing = [name for name in expected if name not in written]
    if missing:
        raise GGUFImportError(f"tensor {missing[0]!r} is missing from the GGUF")
    return plan


def _hf_name(gguf_name: str) -> str | None:
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    return None


def dequantize(planned: _PlannedTensor, dtype: torch.dtype) -> torch.Tensor:
    """One tensor in Hugging Face layout: dequantized, unpermuted, cast to `dtype`."""
    source = planned.source
    values = gguf.quants.dequantize(source.data, source.tensor_type)
    if not values.flags.writeable:  # F32 comes as a view of the mapped file: torch gets a copy
        values = values.copy()
    if not np.isfinite(values).all():
        raise GGUFImportError(f"tensor {source.name} holds NaN or infinite values")
    t = torch.from_numpy(values).reshape(planned.shape)
    if planned.num_heads_permuted is not None:
        t = unpermute(t, planned.num_heads_permuted)
    return t.to(dtype).contiguous()


def unpermute(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`, which stores each head's rows [x0 .. x(d/2-1),
    y0 .. y(d/2-1)] (Hugging Face's rotate-half order) interleaved as [x0 y0 x1 y1 ..]."""
    # t: [num_heads * head_dim, ...] -> [num_heads, head_dim / 2, 2, ...] -> swap the middle two
    rest = t.shape[1:]
    return t.reshape(num_heads, -1, 2, *rest).transpose(1, 2).reshape(t.shape)


def _write_weights(
    model_dir: Path, plan: list[_PlannedTensor], dtype: torch.dtype, progress: bool
) -> None:
    shards: list[list[_PlannedTensor]] = [[]]
    shard_bytes = 0
    for planned in plan:
        size = math.prod(planned.shape) * dtype.itemsize
        if shards[-1] and shard_bytes + size > SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(planned)
        shard_bytes += size
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    bar = tqdm(total=len(plan), unit="tensor", desc="dequantizing", disable=not progress)
    with bar:
        for file_name, shard in zip(names, shards, strict=True):
            tensors = {}
            for planned in shard:
                tensors[planned.name] = dequantize(planned, dtype)
                bar.update()
            save_file(tensors, str(model_dir / file_name), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
        _write_json(model_dir / "model.safetensors.index.json", {"weight_map": weight_map})


def _generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
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


def _tokenizer_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    model = metadata.get("tokenizer.ggml.model")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special_token(metadata, "bos"),
        "eos_token": special_token(metadata, "eos"),
        "unk_token": special_token(metadata, "unknown"),
        "pad_token": special_token(metadata, "padding"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama")),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": metadata.get(f"{metadata['general.architecture']}.context_length"),
    }


def _open(path: Path) -> gguf.GGUFReader:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFImportError(f"cannot read {path}: {e.strerror}") from e
    if magic != b"GGUF":
        raise GGUFImportError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:
        # The reader maps every tensor up front, so a short file fails here.
        raise GGUFImportError(f"{path} is truncated or malformed ({e})") from e


def _read_metadata(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    try:
        return {name: field.contents() for name, field in reader.fields.items()}
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise GGUFImportError(f"{path}: malformed metadata ({e})") from e


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _publish(staging: Path, model_dir: Path) -> None:
    """Moves the finished `staging` directory to `model_dir`, replacing what is there."""
    if model_dir.exists() and not _is_empty_dir(model_dir):
        old = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.old.", dir=model_dir.parent))
        model_dir.rename(old / model_dir.name)
        staging.rename(model_dir)
        shutil.rmtree(old, ignore_errors=True)
        return
    if model_dir.exists():
        model_dir.rmdir()
    staging.rename(model_dir)
