"""The model directory check `kvchat serve` and `kvchat fleet` run before anything heavy."""

from __future__ import annotations

from pathlib import Path


def check_model(model_dir: Path) -> None:
    """What the service needs of a model directory, checked before anything heavy: its
    config and a tokenizer (errors name the file)."""
    from kvchat.inference import ModelConfig, ModelLoadError, load_tokenizer

    ModelConfig.from_dir(model_dir)
    if load_tokenizer(model_dir) is None:
        raise ModelLoadError(f"{model_dir} has no tokenizer files; the chat service needs one")
