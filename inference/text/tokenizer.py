"""The Tokenizer interface and its two back ends.

* `TiktokenTokenizer`: byte-level BPE over tiktoken ranks (the bundled cl100k_base of the
  dev model, or a Llama-3 `tokenizer.model`).
* `HFTokenizer`: a Hugging Face `tokenizer.json`.

Reading the files of a model directory is `tokenizer_files`' job; nothing here downloads
anything.
"""

from __future__ import annotations

import abc
import codecs
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import tiktoken
import tokenizers

# Tokens that end a generation wherever the vocabulary has them, in the order that
# picks the default `eos_token` when tokenizer_config.json names none.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>")


class TokenizerError(ValueError):
    """A tokenizer file or a token id that cannot be used; the message names which."""


class IncrementalDetokenizer(abc.ABC):
    """Turns a stream of generated ids into text without splitting a character."""

    @abc.abstractmethod
    def push(self, token_id: int) -> str:
        """Appends one id; returns the text it completes (often "", never a partial char)."""

    @abc.abstractmethod
    def flush(self) -> str:
        """Returns the held-back tail, with U+FFFD for bytes that never completed a char."""


class Tokenizer(abc.ABC):
    """Text <-> token ids for one model. Never adds BOS: the chat template does that."""

    name: str
    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None  # the text templates see as `eos_token`
    eos_token_ids: frozenset[int]  # every id that ends a generation

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Largest known id + 1: the size of the model's embedding and logits."""

    @abc.abstractmethod
    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Ids of `text`; special-token text becomes special ids only if `allow_special`."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """Id of a special token (or a vocabulary entry), None if there is none."""

    @abc.abstractmethod
    def is_known_id(self, token_id: int) -> bool: ...

    @property
    @abc.abstractmethod
    def special_token_texts(self) -> frozenset[str]:
        """The texts that `encode(..., allow_special=True)` turns into special (control) ids."""

    @abc.abstractmethod
    def new_detokenizer(self) -> IncrementalDetokenizer: ...

    @abc.abstractmethod
    def _decode_known(self, token_ids: list[int]) -> str: ...

    def id_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (as reported in logprobs); a byte-level token that
        is part of a character is its raw bytes where the tokenizer knows them."""
        return self.decode([token_id]).encode("utf-8")

    @abc.abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token, as the model sees them: ordinary tokens concatenate to
        the UTF-8 of the text they encode (a token may hold part of a character); a special
        token is its text. What a grammar engine matches output against."""

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens."""
        ids = (self.token_to_id(text) for text in self.special_token_texts)
        return frozenset(i for i in ids if i is not None)

    def decode(self, token_ids: Sequence[int]) -> str:
        ids = list(token_ids)
        for token_id in ids:
            self._require_known(token_id)
        return self._decode_known(ids)

    def _require_known(self, token_id: int) -> None:
        if not self.is_known_id(token_id):
            raise TokenizerError(
                f"token id {token_id} is not in the vocabulary of {self.name} "
                f"(vocab_size {self.vocab_size})"
            )

    def _set_special_tokens(
        self, *, bos_token: str | None, eos_token: str | None, source: Path | str
    ) -> None:
        """Resolves BOS/EOS texts to ids; `source` names the file they came from."""
        self.bos_token = bos_token
        self.bos_token_id = None
        if bos_token is not None:
            self.bos_token_id = self.token_to_id(bos_token)
            if self.bos_token_id is None:
                raise TokenizerError(f"{source}: bos_token {bos_token!r} is not in the vocabulary")
        present = [t for t in END_OF_TURN_TOKENS if self.token_to_id(t) is not None]
        eos_ids = {self.token_to_id(t) for t in present}
        if eos_token is not None:
            eos_id = self.token_to_id(eos_token)
            if eos_id is None:
                raise TokenizerError(f"{source}: eos_token {eos_token!r} is not in the vocabulary")
            eos_ids.add(eos_id)
        self.eos_token = eos_token if eos_token is not None else (present[0] if present else None)
        self.eos_token_ids = frozenset(i for i in eos_ids if i is not None)


class _Utf8Detokenizer(IncrementalDetokenizer):
    """For byte-level vocabularies whose tokens map to raw bytes (tiktoken)."""

    def __init__(self, tokenizer: TiktokenTokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class _PrefixDetokenizer(IncrementalDetokenizer):
    """vLLM's prefix/read-offset method, for decoders that only work on id sequences.

    ids[prefix_offset:read_offset] is context already emitted; decoding it together with
    the new ids keeps decoder effects that depend on neighbours (leading-space stripping,
    byte fallback) consistent. New text is emitted once it no longer ends in U+FFFD, so
    a char split over several byte tokens comes out whole; a model that generates a
    literal U+FFFD at the very end has it held back until the next push or `flush`.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        self._tokenizer._require_known(token_id)
        self._ids.append(token_id)
        delta = self._pending_text()
        if not delta or delta.endswith("\ufffd"):
            return ""
        self._advance()
        return delta

    def flush(self) -> str:
        delta = self._pending_text()
        self._advance()
        return delta

    def _pending_text(self) -> str:
        decode = self._tokenizer._decode_known
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._ids[self._prefix_offset :])
        return new_text[len(prefix_text) :]

    def _advance(self) -> None:
        # Keep only the ids still needed as context, so a long generation stays O(1).
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)


class TiktokenTokenizer(Tokenizer):
    """Byte-level BPE over tiktoken ranks plus a table of special tokens."""

    def __init__(
        self,
        *,
        name: str,
        mergeable_ranks: dict[bytes, int],
        special_tokens: Mapping[str, int],
        pat_str: str,
        bos_token: str | None,
        eos_token: str | None,
        source: Path | str,
    ) -> None:
        rank_ids = set(mergeable_ranks.values())
        clashes = sorted(i for i in special_tokens.values() if i in rank_ids)
        if clashes:
            raise TokenizerError(
                f"{source}: special token ids {clashes[:5]} are also ids of ordinary tokens"
            )
        try:
            self._encoding = tiktoken.Encoding(
                name,
                pat_str=pat_str,
                mergeable_ranks=mergeable_ranks,
                special_tokens=dict(special_tokens),
            )
        except ValueError as e:  # tiktoken's regex compiler rejects pat_str
            raise TokenizerError(f"{source}: pat_str is not a valid pattern: {e}") from e
        num_ranks = len(mergeable_ranks)
        # cl100k and Llama 3 number their ranks 0..n-1: a range answers `in` in O(1).
        self._rank_ids: range | frozenset[int] = (
            range(num_ranks) if rank_ids == set(range(num_ranks)) else frozenset(rank_ids)
        )
        self._special_ids = frozenset(special_tokens.values())
        self.name = name
        self._set_special_tokens(bos_token=bos_token, eos_token=eos_token, source=source)

    @property
    def vocab_size(self) -> int:
        return self._encoding.max_token_value + 1

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if allow_special:
            return self._encoding.encode(text, allowed_special="all")
        return self._encoding.encode_ordinary(text)

    def token_to_id(self, token: str) -> int | None:
        try:
            return self._encoding.encode_single_token(token)
        except KeyError:
            return None

    def is_known_id(self, token_id: int) -> bool:
        return token_id in self._rank_ids or token_id in self._special_ids

    @property
    def special_token_texts(self) -> frozenset[str]:
        return frozenset(self._encoding.special_tokens_set)

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (special tokens: their UTF-8 text)."""
        self._require_known(token_id)
        return self._encoding.decode_single_token_bytes(token_id)

    def id_bytes(self, token_id: int) -> bytes:
        return self.token_bytes(token_id)

    def new_detokenizer(self) -> IncrementalDetokenizer:
        return _Utf8Detokenizer(self)

    def _decode_known(self, token_ids: list[int]) -> str:
        return self._encoding.decode(token_ids, errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`, with BOS/EOS from tokenizer_config.json."""

    def __init__(
        self, path: Path, *, bos_token: str | None, eos_token: str | None, source: Path
    ) -> None:
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any bad file
            raise TokenizerError(f"{path}: not a loadable tokenizer.json ({e})") from e
        # `encode_special_tokens` is a switch on the tokenizer object, so plain-text
        # encoding gets its own copy instead of toggling the shared one per call.
        self._plain = tokenizers.Tokenizer.from_str(self._tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._vocab_size = (
            max(self._tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        )
        self._special_texts = frozenset(
            token.content
            for token in self._tokenizer.get_added_tokens_decoder().values()
            if token.special
        )
        self.name = f"hf:{path}"
        self._piece_bytes: dict[int, bytes] | None = None  # built on first use
        self._set_special_tokens(bos_token=bos_token, eos_token=eos_token, source=source)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        # Tokens added without special=True (ordinary added words) still match as a
        # whole in plain mode; only special tokens are spelled out as text.
        tokenizer = self._tokenizer if allow_special else self._plain
        return tokenizer.encode(text, add_special_tokens=False).ids

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def is_known_id(self, token_id: int) -> bool:
        return (
            0 <= token_id < self._vocab_size and self._tokenizer.id_to_token(token_id) is not None
        )

    @property
    def special_token_texts(self) -> frozenset[str]:
        return self._special_texts

    def new_detokenizer(self) -> IncrementalDetokenizer:
        return _PrefixDetokenizer(self)

    def token_bytes(self, token_id: int) -> bytes:
        self._require_known(token_id)
        if self._piece_bytes is None:
            self._piece_bytes = self._read_piece_bytes()
        piece = self._piece_bytes.get(token_id)
        if piece is not None:
            return piece
        return self._decode_known([token_id]).encode("utf-8")

    def _read_piece_bytes(self) -> dict[int, bytes]:
        """Bytes of every vocabulary piece, read the way the decoder reads them: byte-level
        pieces (GPT-2's byte-to-character table, Llama 3 and Qwen) map back to their bytes;
        SentencePiece-style pieces have U+2581 for a space and `<0xNN>` byte-fallback pieces.
        Added tokens (special or not) are their text."""
        spec = json.loads(self._tokenizer.to_str())
        decoders = spec.get("decoder") or {}
        kinds = {d.get("type") for d in decoders.get("decoders", [decoders])}
        model = spec.get("model") or {}
        byte_fallback = bool(model.get("byte_fallback")) or "ByteFallback" in kinds
        vocab = self._tokenizer.get_vocab(with_added_tokens=False)
        if "ByteLevel" in kinds:
            table = {char: byte for byte, char in _gpt2_byte_chars().items()}
            pieces = {
                i: bytes(table[c] for c in piece)
                for piece, i in vocab.items()
                if all(c in table for c in piece)
            }
        else:
            pieces = {}
            for piece, i in vocab.items():
                match = _BYTE_PIECE.fullmatch(piece) if byte_fallback else None
                pieces[i] = (
                    bytes([int(match.group(1), 16)])
                    if match
                    else piece.replace("\u2581", " ").encode("utf-8")
                )
        for i, token in self._tokenizer.get_added_tokens_decoder().items():
            pieces[i] = token.content.encode("utf-8")
        return pieces

    def _decode_known(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies spell bytes
    this way): printable Latin-1 bytes stand for themselves, the rest map to U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
