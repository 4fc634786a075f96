"""Random-weight Llama-architecture models in Hugging Face format, made locally (no downloads):
`dev` for tests and laptops, `bench` (>= 100M parameters) for meaningful CPU timings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import save_file

from ..text.tokenizer_files import DEV_VOCAB_SIZE, dev_special_tokens, write_dev_tokenizer
from .config import ModelConfig
from .weights import expected_shapes


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int


PRESETS: dict[str, Preset] = {
    #                 hidden  ffn   layers heads kv  context
    "dev": Preset(256, 512, 2, 4, 2, 4096),
    "bench": Preset(768, 2048, 12, 12, 4, 8192),
}


def hf_config(preset: Preset) -> dict[str, object]:
    """The config.json of a preset: a Llama with GQA, tied embeddings, cl100k + ChatML vocab."""
    specials = dev_special_tokens()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": DEV_VOCAB_SIZE,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.hidden_size // preset.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": specials["<|im_end|>"],
        "pad_token_id": specials["<|endoftext|>"],
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def init_model(model_dir: str | Path, preset_name: str = "dev", seed: int = 0) -> ModelConfig:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer files."""
    if preset_name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset_name!r}")
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    config_dict = hf_config(PRESETS[preset_name])
    config = ModelConfig.from_hf_dict(config_dict)

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            std = float(cast(float, config_dict["initializer_range"]))
            t = torch.randn(shape, generator=generator) * std
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    generation = {
        "eos_token_id": [config_dict["eos_token_id"], dev_special_tokens()["<|endoftext|>"]],
        "pad_token_id": config_dict["pad_token_id"],
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_dev_tokenizer(path)
    return config
