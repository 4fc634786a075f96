"""Loading Llama-family weights from safetensors (single file or sharded), with checks that
name the offending tensor."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ModelLoadError
from .config import ModelConfig

# Present in some checkpoints, never needed: rotary tables are recomputed.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by its Hugging Face name."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, out_features in (
            ("q_proj", config.q_size),
            ("k_proj", config.kv_size),
            ("v_proj", config.kv_size),
        ):
            shapes[p + f"self_attn.{name}.weight"] = (out_features, h)
            if config.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out_features,)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.q_size)
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        if config.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (i,)
            shapes[p + "mlp.up_proj.bias"] = (i,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
    return shapes


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index_path} is not a valid safetensors index: {e}") from None
        files = {name: model_dir / file for name, file in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise ModelLoadError(f"{index_path} names shard {path.name}, which is missing")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(
            f"{model_dir} has no model.safetensors or model.safetensors.index.json"
        )
    with safe_open(single, framework="pt") as f:
        # safe_open is not a dict: keys() is its only listing.
        return {name: single for name in f.keys()}  # noqa: SIM118


def load_weights(
    model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """All tensors the model needs, cast to `dtype` on `device`, keyed by Hugging Face name."""
    model_dir = Path(model_dir)
    files = _weight_files(model_dir)
    shapes = expected_shapes(config)
    missing = [name for name in shapes if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{model_dir}: tensor {missing[0]!r} is missing{more}")

    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                t = f.get_tensor(name)
                if tuple(t.shape) != shapes[name]:
                    raise ModelLoadError(
                        f"{path.name}: tensor {name!r} has shape {tuple(t.shape)}, "
                        f"expected {shapes[name]} from config.json"
                    )
                cast = t.to(device=device, dtype=dtype)
                # A tensor already in the wanted dtype and device may be a view of the mapped
                # file; a copy owns its memory, so no small tensor kept later (a norm's weight)
                # keeps the whole file's pages resident.
                tensors[name] = cast if cast is not t else t.clone()
    if config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def unexpected_tensors(model_dir: str | Path, config: ModelConfig) -> list[str]:
    """Tensors in the checkpoint the model does not use (a sign of a config mismatch)."""
    files = _weight_files(Path(model_dir))
    shapes = expected_shapes(config)
    return sorted(
        name
        for name in files
        if name not in shapes
        and not name.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_word_embeddings and name == "lm_head.weight")
    )
