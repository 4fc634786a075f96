"""Importing a GGUF file (llama.cpp's format) as the Hugging Face model directory kvchat loads.

What is written: `config.json` and `generation_config.json` from the `<arch>.*` and
`tokenizer.ggml.*` metadata (see gguf_config); the weights dequantized (with the `gguf`
library) into the asked dtype as safetensors (`model.safetensors`, or shards with an index
past `SHARD_BYTES`), under their Hugging Face names, with llama.cpp's Q/K row permutation
undone for llama and mistral; `tokenizer.json` and `tokenizer_config.json` (see
gguf_tokenizer); `chat_template.jinja` from `tokenizer.chat_template`.

Everything is checked before a byte is written (architecture, tensor names, shapes and types),
and written into a temporary directory beside the target that is renamed into place at the
end, so a failure never leaves a half-written model."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import uuid
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

from ..errors import GGUFImportError
from .config import ModelConfig
from .gguf_config import ROPE_FREQS, generation_config, hf_config
from .gguf_tokenizer import build_tokenizer, special_token
from .weights import expected_shapes

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
    # Made with mkdir, not mkdtemp, so the model directory gets the umask's permissions.
    staging = model_dir.parent / f".{model_dir.name}.{uuid.uuid4().hex[:12]}.partial"
    staging.mkdir()
    try:
        _write_weights(staging, plan, DTYPES[dtype], progress)
        _write_json(staging / "config.json", config_dict)
        _write_json(staging / "generation_config.json", generation_config(metadata))
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


def _plan_tensors(
    config: ModelConfig, sources: Mapping[str, gguf.ReaderTensor], arch: str
) -> list[_PlannedTensor]:
    """Every tensor to write, checked against what the model needs (names, shapes, types)."""
    expected = expected_shapes(config)
    plan: list[_PlannedTensor] = []
    for gguf_name, source in sources.items():
        if gguf_name == ROPE_FREQS:
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
