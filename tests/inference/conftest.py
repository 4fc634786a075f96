"""Fixtures the inference tests share: the dev tokenizer (cl100k) and a small Llama-3 one."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from kvchat.inference.text.tokenizer import Tokenizer
from kvchat.inference.text.tokenizer_files import load_tokenizer, write_dev_tokenizer
from kvchat_testing.tokenizers import LLAMA3_MERGES


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("dev")
    write_dev_tokenizer(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def dev_tokenizer(dev_dir: Path) -> Tokenizer:
    tokenizer = load_tokenizer(dev_dir)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def llama3_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model_dir = tmp_path_factory.mktemp("llama3")
    tokens = [bytes([b]) for b in range(256)] + LLAMA3_MERGES
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (model_dir / "tokenizer.model").write_text("\n".join(lines) + "\n")
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer is not None
    return tokenizer
