"""A Hugging Face `tokenizer.json` rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries the vocabulary, the merges (or SentencePiece scores) and the token types, but
not the normalizer, pre-tokenizer or decoder; llama.cpp picks those from `tokenizer.ggml.model`
and `tokenizer.ggml.pre`, and so does this module:

- `gpt2`: byte-level BPE with merges; the pre-tokenizer regex comes from `tokenizer.ggml.pre`
  (the same table llama.cpp's `llm_tokenizer_bpe` uses), written the way the model's own
  `tokenizer.json` spells it.
- `llama`: SentencePiece BPE with byte fallback; merges are derived from the token scores
  when the file lists none.

Token types (llama.cpp's `llama_token_type`): 1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte. Control tokens become special added tokens; user-defined ones plain added
tokens (matched whole, as llama.cpp does)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from ..errors import GGUFImportError

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> (the split regex, whether digits are first split one by one,
# whether a word that is itself a token skips the merges, as Llama 3's tokenizer does).
_PRE_TOKENIZERS: dict[str, tuple[str, bool, bool]] = {
    **dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "jais"), (_GPT2_SPLIT, False, False)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        (_GPT2_SPLIT, True, False),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"),
        (_LLAMA3_SPLIT, False, True),
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (_QWEN2_SPLIT, False, False)
    ),
    "tekken": (_TEKKEN_SPLIT, False, False),
}
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_TOKENIZERS))
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")


def build_tokenizer(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The tokenizer the metadata describes, with its added tokens and BOS/EOS handling."""
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFImportError("tokenizer.ggml.tokens is missing: the GGUF has no vocabulary")
    token_types = metadata.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise GGUFImportError(
            f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )
    if model == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(metadata, tokens, token_types)
    else:
        raise GGUFImportError(
            f"tokenizer.ggml.model {model!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)})"
        )
    _add_tokens(tokenizer, tokens, token_types)
    bos = special_token(metadata, "bos")
    if metadata.get("tokenizer.ggml.add_bos_token", model == "llama") and bos is not None:
        bos_id = metadata["tokenizer.ggml.bos_token_id"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def special_token(metadata: Mapping[str, Any], role: str) -> str | None:
    """The text of `tokenizer.ggml.<role>_token_id` (bos, eos, unknown, padding, eot), if any."""
    token_id = metadata.get(f"tokenizer.ggml.{role}_token_id")
    if token_id is None:
        return None
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    if not 0 <= token_id < len(tokens):
        raise GGUFImportError(
            f"tokenizer.ggml.{role}_token_id is {token_id}, outside the vocabulary of "
            f"{len(tokens)} tokens"
        )
    return tokens[token_id]


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        # A repeated token keeps its first id, as llama.cpp's text-to-token map does.
        vocab.setdefault(token, token_id)
    return vocab


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: Sequence[str]) -> tokenizers.Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre == "default":
        pre = "gpt-2"
    if pre not in _PRE_TOKENIZERS:
        raise GGUFImportError(
            f"tokenizer.ggml.pre {pre!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})"
        )
    split, split_digits, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise GGUFImportError("tokenizer.ggml.merges is missing: a gpt2 tokenizer needs merges")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise GGUFImportError(f"tokenizer.ggml.merges holds {merge!r}, not two tokens")
        pairs.append((left, right))
    try:
        bpe = models.BPE(_vocab(tokens), pairs, ignore_merges=ignore_merges)
    except Exception as e:  # the Rust side raises a bare Exception for a bad vocab or merge
        raise GGUFImportError(f"the GGUF's vocabulary and merges do not form a BPE ({e})") from e
    tokenizer = tokenizers.Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split == _GPT2_SPLIT)
    steps: list[pre_tokenizers.PreTokenizer] = []
    if split_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split != _GPT2_SPLIT:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(
    metadata: Mapping[str, Any], tokens: Sequence[str], token_types: Sequence[int]
) -> tokenizers.Tokenizer:
    merges = metadata.get("tokenizer.ggml.merges")
    if isinstance(merges, list):
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise GGUFImportError(
                "tokenizer.ggml.scores is missing or not one per token: a llama tokenizer "
                "without merges needs them"
            )
        pairs = _merges_from_scores(tokens, scores, token_types)
    unk = special_token(metadata, "unknown")
    try:
        bpe = models.BPE(_vocab(tokens), pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    except Exception as e:  # the Rust side raises a bare Exception for a bad vocab or merge
        raise GGUFImportError(f"the GGUF's vocabulary and merges do not form a BPE ({e})") from e
    tokenizer = tokenizers.Tokenizer(bpe)
    prepend = "first" if metadata.get("tokenizer.ggml.add_space_prefix", True) else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme=prepend, split=False
    )
    strip = [decoders.Strip(content=" ", left=1, right=0)] if prepend == "first" else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int]
) -> list[tuple[str, str]]:
    """SentencePiece BPE merges: a normal token that splits into two vocabulary pieces is the
    merge of those pieces, ranked by the merged token's score (higher first), ties broken by
    longer left, then longer right piece, then the ids (transformers' order)."""
    vocab = _vocab(tokens)
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for token_id, (token, score, token_type) in enumerate(
        zip(tokens, scores, token_types, strict=True)
    ):
        if token_type not in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                key = (-score, -len(left), -len(right), token_id, vocab[left], vocab[right])
                ranked.append((*key, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_tokens(
    tokenizer: tokenizers.Tokenizer, tokens: Sequence[str], token_types: Sequence[int]
) -> None:
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type == TOKEN_TYPE_CONTROL
    ]
    plain = [
        AddedToken(token, special=False, normalized=False)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type == TOKEN_TYPE_USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
