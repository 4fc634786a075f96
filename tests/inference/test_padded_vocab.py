"""Checkpoints with more output rows than tokenizer ids (padded vocabularies, gaps in the id
range): those rows are never sampled, and on the rows that are tokens kvchat matches
transformers (which is told to suppress the same ids)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.inference.text.tokenizer_files import (
    DEV_VOCAB_SIZE,
    load_tokenizer,
    write_dev_tokenizer,
)
from kvchat.memory.config import CacheConfig
from kvchat_testing.hf_models import build_hf_model
from kvchat_testing.parity import LOGITS_ATOL, LogitsRecorder

NUM_NEW_TOKENS = 24
HF_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def write_gappy_tokenizer_json(model_dir: Path) -> None:
    """A byte-level BPE of 296 ids, then a gap, then special tokens at 400..402."""
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["hello world", "the quick brown fox jumps"] * 20, trainer)
    data = json.loads(tokenizer.to_str())
    for i, content in enumerate(HF_SPECIALS):
        data["model"]["vocab"][content] = 400 + i
    data["added_tokens"] = [
        {
            "id": 400 + i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, content in enumerate(HF_SPECIALS)
    ]
    (model_dir / "tokenizer.json").write_text(json.dumps(data))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))


def make_padded_model(
    path: Path, model_type: str, vocab_size: int, write_tokenizer: Any, **overrides: Any
) -> tuple[Any, list[int], list[int]]:
    """A random model whose unknown output rows would win every greedy step if sampled.

    The greedy trajectory with the unknown ids suppressed does not depend on those rows, so
    after computing it, unknown row j becomes 3 x the row of the token chosen at step j: its
    logit then beats the real choice at that step. Returns (model, prompt, unknown ids)."""
    model = build_hf_model(path, model_type, seed=3, vocab_size=vocab_size, **overrides)
    write_tokenizer(path)
    tokenizer = load_tokenizer(path)
    assert tokenizer is not None
    unknown = [i for i in range(vocab_size) if not tokenizer.is_known_id(i)]
    assert len(unknown) >= NUM_NEW_TOKENS
    known = [i for i in range(min(vocab_size, 296)) if tokenizer.is_known_id(i)]
    g = torch.Generator().manual_seed(11)
    prompt = [known[i] for i in torch.randint(0, len(known), (19,), generator=g).tolist()]
    trajectory = hf_greedy(model, prompt, unknown)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        for j, token in enumerate(trajectory):
            head[unknown[j]] = 3.0 * head[token]
    model.save_pretrained(path)
    write_tokenizer(path)
    return model, prompt, unknown


def hf_greedy(model: Any, prompt: list[int], suppress: list[int]) -> list[int]:
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            suppress_tokens=suppress,
        )[0, len(prompt) :].tolist()


def engine_for(path: Path) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(block_size=16, num_blocks_override=32),
        )
    )


CASES = [
    # (id, model_type, padded vocab_size, tokenizer writer, overrides)
    (
        "llama-cl100k-padded-100352",
        "llama",
        100352,
        write_dev_tokenizer,
        dict(hidden_size=64, intermediate_size=128, head_dim=32, tie_word_embeddings=True),
    ),
    (
        "qwen2-tokenizer-json-gaps-512",
        "qwen2",
        512,
        write_gappy_tokenizer_json,
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_unknown_rows_are_never_sampled_and_parity_holds(case: Any, tmp_path: Path) -> None:
    _, model_type, vocab_size, write_tokenizer, overrides = case
    model, prompt, unknown = make_padded_model(
        tmp_path, model_type, vocab_size, write_tokenizer, **overrides
    )
    engine = engine_for(tmp_path)
    recorder = LogitsRecorder(engine.sampler)
    engine.sampler = recorder  # type: ignore[assignment]
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out = engine.generate([prompt], params)[0]
    generated = out.output_token_ids or []
    assert len(generated) == NUM_NEW_TOKENS
    assert not set(generated) & set(unknown)

    known = torch.ones(vocab_size, dtype=torch.bool)
    known[unknown] = False
    with torch.no_grad():
        hf_logits = model(torch.tensor([prompt + generated])).logits[0].float()
    for step, ours in enumerate(recorder.logits):
        # Unmasked, an unknown row would have won this step: the mask is what keeps it out.
        assert int(ours[0].argmax()) in set(unknown)
        theirs = hf_logits[len(prompt) - 1 + step]
        err = (ours[0][known] - theirs[known]).abs().max().item()
        assert err <= LOGITS_ATOL, f"step {step}: logits differ by {err:.2e}"
    assert generated == hf_greedy(model, prompt, unknown)
    # Decodable end to end: the text is the tokenizer's decoding of the ids.
    assert engine.tokenizer is not None
    assert out.text == engine.tokenizer.decode(generated)


def test_sampling_at_temperature_never_picks_an_unknown_row(tmp_path: Path) -> None:
    _, model_type, vocab_size, write_tokenizer, overrides = CASES[1]
    _, prompt, unknown = make_padded_model(
        tmp_path, model_type, vocab_size, write_tokenizer, **overrides
    )
    engine = engine_for(tmp_path)
    params = [
        SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=2.0, seed=s, ignore_eos=True)
        for s in range(8)
    ]
    outs = engine.generate([prompt] * 8, params)
    sampled = {t for o in outs for t in o.output_token_ids or []}
    assert len(sampled) > 20 and not sampled & set(unknown)


def test_kvchat_generate_on_a_padded_dev_model(tmp_path: Path) -> None:
    """The command line on a cl100k model padded to 100,352 rows (a multiple of 64)."""
    _, model_type, vocab_size, write_tokenizer, overrides = CASES[0]
    make_padded_model(tmp_path, model_type, vocab_size, write_tokenizer, **overrides)
    result = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "kvchat.app.cli",
            "generate",
            "--model",
            str(tmp_path),
            "--prompt",
            "Hello there",
            "--chat",
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["token_ids"]) == 12
    assert all(t < DEV_VOCAB_SIZE for t in out["token_ids"])
