"""Random-weight Hugging Face checkpoints written with save_pretrained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Scaled-up random weights keep logits well separated, so greedy parity is decided by the
# implementation, not by near-ties between equally likely tokens.
INIT_STD = 0.08


def hf_model_class(model_type: str) -> Any:
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[model_type]


def build_hf_model(model_dir: Path, model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A random-weight transformers model saved with save_pretrained; returns the model (eval)."""
    config_cls, model_cls = hf_model_class(model_type)
    kwargs: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=INIT_STD,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                p.normal_(0, INIT_STD)
            else:
                p.normal_(0, INIT_STD)
    model.save_pretrained(model_dir)
    return model
