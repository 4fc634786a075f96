"""Config parsing and weight loading: every error names the field or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvchat.inference.errors import ModelLoadError
from kvchat.inference.model.config import ModelConfig
from kvchat.inference.model.weights import load_weights, unexpected_tensors
from kvchat_testing.hf_models import build_hf_model

BASE: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_head_dim_is_derived_or_taken_as_given() -> None:
    assert ModelConfig.from_hf_dict(BASE).head_dim == 8
    assert ModelConfig.from_hf_dict({**BASE, "head_dim": 16}).head_dim == 16


def test_transformers_4_and_5_rope_layouts_parse_alike() -> None:
    v4 = {
        **BASE,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    v5 = {
        **BASE,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    assert ModelConfig.from_hf_dict(v4).rope == ModelConfig.from_hf_dict(v5).rope
    legacy = {**BASE, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert ModelConfig.from_hf_dict(legacy).rope.factor == 4.0


def test_sliding_windows_per_model_type() -> None:
    mistral = ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": 32})
    assert mistral.sliding_windows == (32, 32)
    qwen_v5 = ModelConfig.from_hf_dict(
        {
            **BASE,
            "model_type": "qwen2",
            "sliding_window": 16,
            "layer_types": ["full_attention", "sliding_attention"],
        }
    )
    assert qwen_v5.sliding_windows == (None, 16)
    qwen_off = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "sliding_window": 16})
    assert qwen_off.sliding_windows == (None, None)
    assert qwen_off.qkv_bias and not qwen_off.o_bias
    llama = ModelConfig.from_hf_dict({**BASE, "sliding_window": 16})
    assert llama.sliding_windows == (None, None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported"),
        ({"hidden_size": None}, "'hidden_size' is missing"),
        ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "'yarn' is not supported"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs 'factor'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs 'low_freq_factor'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_config_errors_name_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        ModelConfig.from_hf_dict({**BASE, **change})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    build_hf_model(path, "llama", seed=4)
    return path


def copy_with(saved: Path, dest: Path, edit: Any) -> Path:
    shutil.copytree(saved, dest)
    tensors = load_file(dest / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def test_missing_tensor_is_named(saved: Path, tmp_path: Path) -> None:
    path = copy_with(saved, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    config = ModelConfig.from_dir(path)
    message = r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"
    with pytest.raises(ModelLoadError, match=message):
        load_weights(path, config, torch.float32, torch.device("cpu"))


def test_wrong_shape_is_named_with_both_shapes(saved: Path, tmp_path: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 128)

    path = copy_with(saved, tmp_path / "m", shrink)
    config = ModelConfig.from_dir(path)
    with pytest.raises(ModelLoadError) as err:
        load_weights(path, config, torch.float32, torch.device("cpu"))
    assert "'model.layers.0.self_attn.k_proj.weight' has shape (16, 128)" in str(err.value)
    assert "expected (64, 128)" in str(err.value)


def test_extra_tensors_are_reported(saved: Path, tmp_path: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(32)

    path = copy_with(saved, tmp_path / "m", add)
    assert unexpected_tensors(path, ModelConfig.from_dir(path)) == [
        "model.layers.0.self_attn.q_norm.weight"
    ]


def test_sharded_checkpoint_loads_the_same_tensors(saved: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(saved, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    config = ModelConfig.from_dir(saved)
    single = load_weights(saved, config, torch.float32, torch.device("cpu"))
    sharded = load_weights(tmp_path, config, torch.float32, torch.device("cpu"))
    assert single.keys() == sharded.keys()
    for name in single:
        assert torch.equal(single[name], sharded[name]), name


def test_missing_shard_is_named(saved: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(saved).save_pretrained(tmp_path, max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"shard {shard.name}, which is missing"):
        load_weights(tmp_path, ModelConfig.from_dir(tmp_path), torch.float32, torch.device("cpu"))
