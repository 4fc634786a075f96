"""Tokenizer files written for tests."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers


def write_hf_tokenizer(model_dir: Path) -> None:
    """A tiny byte-level BPE trained on ASCII, so any non-ASCII char is 2-4 byte tokens."""
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["hello world", "the quick brown fox jumps over the lazy dog", "a chat server"]
    tokenizer.train_from_iterator(corpus * 20, trainer)
    tokenizer.save(str(model_dir / "tokenizer.json"))


# The merges of the small Llama-3 vocabulary the template tests build.
LLAMA3_MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world"]
