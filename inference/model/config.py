"""ModelConfig: the architecture of a Llama-family checkpoint, read from its config.json.

Both Hugging Face config layouts are understood: `rope_theta` + `rope_scaling` (transformers 4)
and `rope_parameters` (transformers 5)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Per layer: the sliding-window size, or None for full attention.
    sliding_windows: tuple[int | None, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if len(self.sliding_windows) != self.num_layers:
            raise ModelLoadError("layer_types must name one attention type per layer")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        per_layer = attn + mlp + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise ModelLoadError(f"model directory {str(path)!r} does not exist")
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{config_path} is missing: not a Hugging Face model directory")
        try:
            data = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from None
        config = cls.from_hf_dict(data, source=str(config_path))
        generation_path = path / "generation_config.json"
        if generation_path.is_file():
            try:
                eos = json.loads(generation_path.read_text()).get("eos_token_id")
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"{generation_path} is not valid JSON: {e}") from None
            extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
            merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
            config = dataclasses.replace(config, eos_token_ids=merged)
        return config

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config") -> ModelConfig:
        def need(key: str) -> Any:
            if key not in d or d[key] is None:
                raise ModelLoadError(f"{source}: required field {key!r} is missing")
            return d[key]

        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        hidden = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        head_dim = d.get("head_dim") or hidden // num_heads
        num_layers = int(need("num_hidden_layers"))
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            mlp_bias = bool(d.get("mlp_bias", False))

        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype_name = d.get("dtype") or d.get("torch_dtype") or "float32"
        if dtype_name not in _DTYPES:
            raise ModelLoadError(f"{source}: dtype {dtype_name!r} is not supported")

        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(d, source),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_windows=_sliding_windows(d, model_type, num_layers, source),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=_DTYPES[dtype_name],
        )


def _rope_config(d: dict[str, Any], source: str) -> RopeConfig:
    params = d.get("rope_parameters")
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise ModelLoadError(f"{source}: rope_scaling of type {rope_type!r} needs 'factor'")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in params:
            raise ModelLoadError(f"{source}: rope_scaling of type 'llama3' needs {key!r}")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _sliding_windows(
    d: dict[str, Any], model_type: str, num_layers: int, source: str
) -> tuple[int | None, ...]:
    window = d.get("sliding_window")
    if model_type == "llama" or window is None:
        return (None,) * num_layers
    window = int(window)
    if model_type == "mistral":
        return (window,) * num_layers
    # qwen2: per-layer types (transformers 5) or use_sliding_window + max_window_layers (4).
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ModelLoadError(
                f"{source}: layer_types has {len(layer_types)} entries, "
                f"expected num_hidden_layers = {num_layers}"
            )
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if not d.get("use_sliding_window", False):
        return (None,) * num_layers
    first = int(d.get("max_window_layers", num_layers))
    return tuple(window if i >= first else None for i in range(num_layers))
