"""Tokenizers: bundled cl100k, the dev model's tokenizer, Llama-3 ranks and tokenizer.json."""

from __future__ import annotations

import base64
import json
import random
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.inference.text.tokenizer import (
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerError,
)
from kvchat.inference.text.tokenizer_files import (
    DEV_VOCAB_SIZE,
    bundled_ranks_path,
    load_bundled_tokenizer,
    load_tokenizer,
    write_dev_tokenizer,
)
from kvchat_testing.tokenizers import write_hf_tokenizer

# Merges on top of the 256 single bytes; ranks 256.. in this order. Each merge's two
# halves are earlier tokens, so BPE can reach it: "hello" -> [259], " world" -> [264].
LLAMA3_MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world"]
NUM_LLAMA3_RANKS = 256 + len(LLAMA3_MERGES)  # 265

MIXED_SCRIPT_TEXT = "😀 你好, naïve café 🤖 龘 — done\n"


@pytest.fixture(scope="module")
def cl100k() -> TiktokenTokenizer:
    return load_bundled_tokenizer()


@pytest.fixture(scope="module")
def dev_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model_dir = tmp_path_factory.mktemp("dev")
    write_dev_tokenizer(model_dir)
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("hf")
    write_hf_tokenizer(model_dir)
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|startoftext|>", "eos_token": {"content": "<|im_end|>"}})
    )
    return model_dir


@pytest.fixture(scope="module")
def hf_tokenizer(hf_dir: Path) -> Tokenizer:
    tokenizer = load_tokenizer(hf_dir)
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


def write_llama3_ranks(model_dir: Path) -> None:
    tokens = [bytes([b]) for b in range(256)] + LLAMA3_MERGES
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (model_dir / "tokenizer.model").write_text("\n".join(lines) + "\n")


def push_all(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    detokenizer = tokenizer.new_detokenizer()
    return [detokenizer.push(token_id) for token_id in token_ids] + [detokenizer.flush()]


# --- bundled cl100k ---------------------------------------------------------------------


def test_cl100k_known_ids(cl100k: TiktokenTokenizer) -> None:
    assert cl100k.encode("hello world") == [15339, 1917]
    assert cl100k.decode([15339, 1917]) == "hello world"
    assert cl100k.token_to_id("hello") == 15339
    assert cl100k.token_to_id("<|endoftext|>") == 100257
    assert cl100k.token_to_id("no such token at all") is None
    assert cl100k.encode("") == []
    assert cl100k.decode([]) == ""


def test_cl100k_specials_and_vocab(cl100k: TiktokenTokenizer) -> None:
    # cl100k alone: its five specials, the top one at 100276; 100256 is a hole.
    assert cl100k.vocab_size == 100277
    assert cl100k.bos_token_id is None
    assert cl100k.eos_token_ids == frozenset({100257})
    assert cl100k.is_known_id(100255) and not cl100k.is_known_id(100256)
    with pytest.raises(TokenizerError, match="token id 100256 is not in the vocabulary"):
        cl100k.decode([15339, 100256])
    with pytest.raises(TokenizerError, match="token id -1"):
        cl100k.decode([-1])


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_cl100k_round_trip(cl100k: TiktokenTokenizer, text: str) -> None:
    token_ids = cl100k.encode(text)
    assert all(0 <= t < 100256 for t in token_ids)
    assert cl100k.decode(token_ids) == text


def test_bundled_hash_mismatch(tmp_path: Path) -> None:
    original = bundled_ranks_path("cl100k_base")
    intact = tmp_path / "intact.tiktoken"
    shutil.copyfile(original, intact)
    assert load_bundled_tokenizer(ranks_path=intact).encode("hello world") == [15339, 1917]

    corrupted = tmp_path / "corrupted.tiktoken"
    data = bytearray(original.read_bytes())
    data[-2] = ord("7") if data[-2] != ord("7") else ord("8")  # last line's rank digit
    corrupted.write_bytes(bytes(data))
    with pytest.raises(TokenizerError, match=r"sha256 .* does not match"):
        load_bundled_tokenizer(ranks_path=corrupted)


def test_unsupported_bundled_encoding() -> None:
    with pytest.raises(TokenizerError, match="'o200k_base' is not bundled; supported: cl100k"):
        load_bundled_tokenizer("o200k_base")


# --- the dev model's tokenizer ------------------------------------------------------------


def test_dev_tokenizer_every_id_decodes(dev_tokenizer: Tokenizer) -> None:
    assert isinstance(dev_tokenizer, TiktokenTokenizer)
    assert dev_tokenizer.vocab_size == DEV_VOCAB_SIZE == 100277
    all_ids = list(range(DEV_VOCAB_SIZE))
    assert all(dev_tokenizer.is_known_id(t) for t in all_ids)
    assert len(dev_tokenizer.decode(all_ids)) > 0
    for token_id in range(100256, DEV_VOCAB_SIZE):
        text = dev_tokenizer.decode([token_id])
        assert text.startswith("<|") and text.endswith("|>")
        assert dev_tokenizer.token_to_id(text) == token_id
    assert not dev_tokenizer.is_known_id(DEV_VOCAB_SIZE)
    with pytest.raises(TokenizerError, match=f"token id {DEV_VOCAB_SIZE} "):
        dev_tokenizer.decode([DEV_VOCAB_SIZE])


def test_dev_tokenizer_special_tokens(dev_tokenizer: Tokenizer) -> None:
    assert dev_tokenizer.token_to_id("<|im_start|>") == 100264
    assert dev_tokenizer.token_to_id("<|im_end|>") == 100265
    assert dev_tokenizer.token_to_id("<|endofprompt|>") == 100276
    assert dev_tokenizer.token_to_id("<|fim_suffix|>") == 100260
    assert dev_tokenizer.decode([100256]) == "<|reserved_special_token_0|>"
    assert dev_tokenizer.decode([100275]) == "<|reserved_special_token_13|>"
    assert dev_tokenizer.bos_token is None and dev_tokenizer.bos_token_id is None
    assert dev_tokenizer.eos_token == "<|im_end|>"
    assert dev_tokenizer.eos_token_ids == frozenset({100265, 100257})


def test_dev_tokenizer_config_shape(tmp_path: Path) -> None:
    write_dev_tokenizer(tmp_path / "nested" / "dev")
    config = json.loads((tmp_path / "nested" / "dev" / "tokenizer_config.json").read_text())
    assert config["tiktoken_encoding"] == "cl100k_base"
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] is None
    decoder = config["added_tokens_decoder"]
    assert sorted(int(k) for k in decoder) == list(range(100256, 100277))
    assert decoder["100264"]["content"] == "<|im_start|>" and decoder["100264"]["special"]
    assert "<|im_start|>" in config["chat_template"]


def test_allow_special(dev_tokenizer: Tokenizer) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    special = dev_tokenizer.encode(text, allow_special=True)
    assert special[0] == 100264 and special[-1] == 100265
    assert special[1:-1] == dev_tokenizer.encode("user\nhi")
    plain = dev_tokenizer.encode(text, allow_special=False)
    assert all(t < 100256 for t in plain)
    assert dev_tokenizer.decode(plain) == text
    assert dev_tokenizer.encode(text) == plain  # plain text is the default


def test_dev_config_errors(tmp_path: Path) -> None:
    write_dev_tokenizer(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())

    config_path.write_text(json.dumps({**config, "tiktoken_encoding": "o200k_base"}))
    with pytest.raises(TokenizerError, match=r"tiktoken_encoding 'o200k_base'.*cl100k_base"):
        load_tokenizer(tmp_path)

    config_path.write_text(json.dumps({**config, "tiktoken_sha256": "0" * 64}))
    with pytest.raises(TokenizerError, match="tiktoken_sha256"):
        load_tokenizer(tmp_path)

    config_path.write_text(json.dumps({**config, "eos_token": "<|nope|>"}))
    message = re.escape("eos_token '<|nope|>' is not in the vocabulary")
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(tmp_path)

    config_path.write_text("{not json")
    with pytest.raises(TokenizerError, match=re.escape("tokenizer_config.json: not readable JSON")):
        load_tokenizer(tmp_path)


def test_tiktoken_detokenizer_whole_chars(cl100k: TiktokenTokenizer) -> None:
    assert cl100k.encode("😀") == [76460, 222]  # one emoji, split over two byte tokens
    assert push_all(cl100k, [76460, 222]) == ["", "😀", ""]

    token_ids = cl100k.encode(MIXED_SCRIPT_TEXT)
    pieces = push_all(cl100k, token_ids)
    assert "".join(pieces) == MIXED_SCRIPT_TEXT
    assert not any("\ufffd" in piece for piece in pieces)
    assert pieces.count("") > 1  # some chars did span several tokens


def test_tiktoken_detokenizer_flush_and_unknown(cl100k: TiktokenTokenizer) -> None:
    detokenizer = cl100k.new_detokenizer()
    assert detokenizer.push(15339) == "hello"
    assert detokenizer.push(76460) == ""
    assert detokenizer.flush() == "\ufffd"  # the emoji never completed
    assert detokenizer.push(1917) == " world"  # usable after a flush
    with pytest.raises(TokenizerError, match="token id 100256"):
        detokenizer.push(100256)


def test_tiktoken_detokenizer_random_ids_match_decode(cl100k: TiktokenTokenizer) -> None:
    # Random ids form invalid UTF-8 at arbitrary points; streaming must agree with decode.
    rng = random.Random()
    token_ids = [rng.randrange(100256) for _ in range(300)]
    assert "".join(push_all(cl100k, token_ids)) == cl100k.decode(token_ids)


# --- Llama-3 tokenizer.model ------------------------------------------------------------


def test_llama3_default_layout(tmp_path: Path) -> None:
    write_llama3_ranks(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, TiktokenTokenizer)
    n = NUM_LLAMA3_RANKS
    assert tokenizer.encode("hello world") == [259, 264]
    assert tokenizer.token_to_id("<|begin_of_text|>") == n
    assert tokenizer.token_to_id("<|end_of_text|>") == n + 1
    assert tokenizer.token_to_id("<|start_header_id|>") == n + 6
    assert tokenizer.token_to_id("<|eot_id|>") == n + 9
    assert tokenizer.token_to_id("<|reserved_special_token_2|>") == n + 11
    assert tokenizer.decode([n + 255]) == "<|reserved_special_token_246|>"
    assert tokenizer.vocab_size == n + 256
    assert not tokenizer.is_known_id(n + 256)
    assert tokenizer.bos_token_id == n
    assert tokenizer.eos_token == "<|eot_id|>"
    assert tokenizer.eos_token_ids == frozenset({n + 1, n + 8, n + 9})
    text = "<|begin_of_text|>hello<|eot_id|>"
    assert tokenizer.encode(text, allow_special=True) == [n, 259, n + 9]
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_llama3_specials_from_config(tmp_path: Path) -> None:
    write_llama3_ranks(tmp_path)
    n = NUM_LLAMA3_RANKS
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "added_tokens_decoder": {str(n): {"content": "<s>"}, str(n + 1): {"content": "</s>"}},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer is not None
    assert tokenizer.vocab_size == n + 2
    assert tokenizer.bos_token_id == n
    assert tokenizer.eos_token_ids == frozenset({n + 1})
    assert tokenizer.token_to_id("<|eot_id|>") is None


@pytest.mark.parametrize(
    ("content", "line"),
    [
        ("IQ== 0\nIg== 1\nnot-base64! 2\n", 3),
        ("IQ== 0\nIg==\n", 2),
        ("IQ== zero\n", 1),
        ("IQ== 0\nIg== 0\n", 2),  # repeated rank
    ],
)
def test_llama3_malformed_ranks(tmp_path: Path, content: str, line: int) -> None:
    (tmp_path / "tokenizer.model").write_text(content)
    with pytest.raises(TokenizerError, match=rf"tokenizer\.model, line {line}:"):
        load_tokenizer(tmp_path)


def test_llama3_special_id_clash(tmp_path: Path) -> None:
    write_llama3_ranks(tmp_path)
    config = {"added_tokens_decoder": {"5": {"content": "<|eot_id|>"}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"special token ids \[5\]"):
        load_tokenizer(tmp_path)


# --- Hugging Face tokenizer.json ----------------------------------------------------------


def test_hf_specials_from_config(hf_tokenizer: Tokenizer, hf_dir: Path) -> None:
    startoftext, endoftext, im_end = (
        hf_tokenizer.token_to_id(t) for t in ("<|startoftext|>", "<|endoftext|>", "<|im_end|>")
    )
    assert (startoftext, endoftext, im_end) == (0, 1, 3)
    assert hf_tokenizer.bos_token_id == 0
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.eos_token_ids == frozenset({1, 3})
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    num_ids = max(vocab.values()) + 1
    assert num_ids > 300  # the trainer learned merges beyond the 256 bytes + 4 specials
    assert hf_tokenizer.vocab_size == num_ids
    assert hf_tokenizer.is_known_id(num_ids - 1)
    assert not hf_tokenizer.is_known_id(num_ids) and not hf_tokenizer.is_known_id(-1)
    with pytest.raises(TokenizerError, match=f"token id {num_ids} "):
        hf_tokenizer.decode([5, num_ids])


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=100))
def test_hf_round_trip(hf_tokenizer: Tokenizer, text: str) -> None:
    token_ids = hf_tokenizer.encode(text)
    assert hf_tokenizer.decode(token_ids) == text


def test_hf_allow_special(hf_tokenizer: Tokenizer) -> None:
    text = "<|im_start|>user hello<|im_end|>"
    special = hf_tokenizer.encode(text, allow_special=True)
    assert special[0] == 2 and special[-1] == 3
    plain = hf_tokenizer.encode(text)
    assert not {0, 1, 2, 3} & set(plain)
    assert hf_tokenizer.decode(plain) == text
    assert hf_tokenizer.encode("hello")[0] != hf_tokenizer.bos_token_id  # no BOS added


def test_hf_detokenizer_whole_chars(hf_tokenizer: Tokenizer) -> None:
    emoji_ids = hf_tokenizer.encode("😀")
    assert len(emoji_ids) == 4  # ASCII-trained: one token per UTF-8 byte
    assert push_all(hf_tokenizer, emoji_ids) == ["", "", "", "😀", ""]
    cjk_ids = hf_tokenizer.encode("你")
    assert push_all(hf_tokenizer, cjk_ids) == ["", "", "你", ""]

    token_ids = hf_tokenizer.encode(MIXED_SCRIPT_TEXT + "<|im_end|>", allow_special=True)
    pieces = push_all(hf_tokenizer, token_ids)
    assert "".join(pieces) == MIXED_SCRIPT_TEXT + "<|im_end|>"
    assert not any("\ufffd" in piece for piece in pieces)

    detokenizer = hf_tokenizer.new_detokenizer()
    assert detokenizer.push(emoji_ids[0]) == ""
    assert detokenizer.flush() == "\ufffd"
    with pytest.raises(TokenizerError, match="token id -3"):
        detokenizer.push(-3)
    assert detokenizer.push(hf_tokenizer.encode("a")[0]) == "a"  # state intact after the error


def test_hf_bad_bos_in_config(tmp_path: Path, hf_dir: Path) -> None:
    shutil.copyfile(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": 7}))
    with pytest.raises(TokenizerError, match="bos_token must be a token string"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(TokenizerError, match="bos_token '<s>' is not in the vocabulary"):
        load_tokenizer(tmp_path)


def test_hf_takes_precedence(tmp_path: Path, hf_dir: Path) -> None:
    shutil.copyfile(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    write_llama3_ranks(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer)


# --- directories without a tokenizer ------------------------------------------------------


def test_no_tokenizer_files(tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_tokenizer(tmp_path) is None  # a config alone names no vocabulary


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "absent")
