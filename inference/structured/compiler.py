"""GrammarCompiler: grammars compiled for one tokenizer with llguidance, cached; per-request
matchers; the token masks of a batch of matchers, computed together.

Why llguidance: it takes any tokenizer as a list of token bytes (so the cl100k dev model and
a tokenizer.json model go through one path), computes a mask without precomputing per-state
tables (a new schema is usable after a fast compile, which matters when every agent request
may bring its own tools), writes the masks of a whole batch into one bitmask (from a thread
pool where cores allow), and reports unsupported JSON-schema features as errors rather than
ignoring them. A mask costs microseconds where the lexer state holds (inside a free string,
llguidance reuses the last one) and 0.4-1 ms a row on a 100k vocabulary where every
character changes what may follow (a string with maxLength). xgrammar masks that case in
microseconds but ignores the schema keywords it does not implement (warnings only).

Where a mask costs that much, checking one token costs microseconds (`allows`: exactly the
mask's answer), so the sampler checks a constrained row's draws first and asks for its mask
only when they are all rejected (see inference/model/sampler.py).

A compiled grammar is kept as a pristine matcher; each request gets a deep copy (its own
parser state over the shared lexer). A matcher is used by one thread at a time: the engine
thread advances it, and its mask is computed by the engine thread or, while the engine
thread waits on the forward, by its mask worker. Compiling (and the cache) may be reached
from other threads (the service validates a request's grammar before queueing it)."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import llguidance
import torch

from ..text.tokenizer import Tokenizer
from .grammar import Grammar

DEFAULT_CACHE_SIZE = 256
MIN_PARALLEL_ROWS = 4  # fewer constrained rows than this are computed in the calling thread


class GrammarError(ValueError):
    """A grammar (or a JSON schema in it) that cannot be compiled: invalid, or using a
    feature the grammar engine does not implement. The message names the problem."""


class _TokenTable:
    """What llguidance reads a tokenizer from (the duck type of its TokenizerWrapper): the
    bytes of every id below the model's vocab size (b"" for ids that are no token: never
    allowed), which ids are special (llguidance marks them, so literal text in a grammar never
    matches a control token), EOS, and an encoder for the text it needs tokenized."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.tokens = [
            tokenizer.token_bytes(i) if tokenizer.is_known_id(i) else b"" for i in range(vocab_size)
        ]
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(i for i in tokenizer.special_token_ids if i < vocab_size)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


class GrammarCompiler:
    """Grammars for one tokenizer and vocab size. `num_compiled` counts real compilations;
    a grammar compiled before (same source) is a cache hit (`num_cache_hits`)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        num_threads: int | None = None,
    ) -> None:
        eos = sorted(i for i in eos_token_ids if i < vocab_size)
        if not eos:
            raise ValueError("constrained decoding needs an end-of-sequence token")
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        self.ll_tokenizer = llguidance.LLTokenizer(
            _TokenTable(tokenizer, vocab_size, eos[0]),  # type: ignore[arg-type]
            n_vocab=vocab_size,
            eos_token=eos,
        )
        self.cache_size = cache_size
        self.num_compiled = 0
        self.num_cache_hits = 0
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        # A thread pool pays off only with cores to spare: on a few cores the hand-off costs
        # more than the masks (measured: 16 rows, 2 cores, ~10-30 ms pooled vs < 1 ms in the
        # engine thread), so masks are computed in the calling thread there.
        if num_threads is None:
            num_threads = (os.cpu_count() or 1) // 2
        self._executor = llguidance.LLExecutor(num_threads) if num_threads > 1 else None

    @property
    def mask_words(self) -> int:
        """int32 words per row of a bitmask."""
        return (self.vocab_size + 31) // 32

    # -- compiling ---------------------------------------------------------------------------

    def compile(self, grammar: Grammar) -> llguidance.LLMatcher:
        """The pristine matcher of `grammar` (compiled now, or from the cache). Raises
        GrammarError when it does not compile."""
        with self._lock:
            matcher = self._cache.get(grammar.source)
            if matcher is not None:
                self._cache.move_to_end(grammar.source)
                self.num_cache_hits += 1
                return matcher
        # Compiled outside the lock (llguidance drops the GIL meanwhile); two threads racing
        # on one new grammar both compile it, and one result is kept.
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar.source, log_level=0)
        if matcher.is_error():
            raise GrammarError(_clean_error(matcher.get_error()))
        with self._lock:
            self.num_compiled += 1
            self._cache[grammar.source] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def clear_cache(self) -> None:
        """Forget every compiled grammar (matchers already handed out keep working)."""
        with self._lock:
            self._cache.clear()

    def new_matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A matcher at the start of `grammar`, for one request."""
        return self.compile(grammar).deep_copy()

    # -- decoding ----------------------------------------------------------------------------

    def fill_bitmask(
        self,
        matchers: Sequence[tuple[int, llguidance.LLMatcher]],
        num_rows: int,
        seconds: list[float] | None = None,
    ) -> torch.Tensor:
        """[num_rows, mask_words] int32: for each (row, matcher), bit t of the row (word
        t // 32, bit t % 32) is set when the matcher allows token t next; rows without a
        matcher allow everything. A matcher that allows nothing (llguidance's error state
        allows EOS, so this is a guard) is given EOS, so the row can end rather than sample
        from nothing. The matchers' rows are computed in parallel where cores allow. With
        `seconds`, what each matcher's mask took is appended to it, in `matchers`' order (an
        even share of the whole when computed in parallel)."""
        bitmask = torch.full((num_rows, self.mask_words), -1, dtype=torch.int32)
        row_bytes = self.mask_words * 4
        base = bitmask.data_ptr()
        if self._executor is not None and len(matchers) >= MIN_PARALLEL_ROWS:
            start = time.perf_counter()
            self._executor.unsafe_compute_mask_ptr(
                [(m, row) for row, m in matchers], base, row_bytes, num_rows
            )
            if seconds is not None:
                seconds += [(time.perf_counter() - start) / len(matchers)] * len(matchers)
        else:
            for row, matcher in matchers:
                start = time.perf_counter()
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
                if seconds is not None:
                    seconds.append(time.perf_counter() - start)
        words = bitmask.numpy()
        for row, _ in matchers:
            if not words[row].any():
                for eos in self.eos_token_ids:
                    words[row, eos // 32] |= _bit(eos % 32)
        return bitmask

    def allows(self, matcher: llguidance.LLMatcher, token: int) -> bool:
        """Whether `matcher` allows `token` next, exactly as its mask would say, without
        computing the mask (5-30 us where the mask may take a millisecond): an end-of-sequence
        token when the grammar may end here; another token when the grammar accepts its bytes,
        except where the grammar forces the next bytes and they have a sure first token (the
        mask then allows only that token, not other tokenizations of the same text)."""
        if token in self.eos_token_ids:
            return bool(matcher.is_accepting())
        if matcher.validate_tokens([token]) != 1:
            return False
        if not matcher.compute_ff_bytes():  # ~5 us; the forced tokens take ~20
            return True
        forced = matcher.compute_ff_tokens()
        return not forced or forced[0] == token

    def logit_mask(
        self,
        matchers: Sequence[tuple[int, llguidance.LLMatcher]],
        num_rows: int,
        device: torch.device,
        seconds: list[float] | None = None,
    ) -> torch.Tensor:
        """[num_rows, vocab_size] float32 on `device`, to add to the logits: 0 where the row
        may sample the token next, -inf where it may not (rows without a matcher: 0
        everywhere). `seconds` as in fill_bitmask."""
        return self.logit_offsets(self.fill_bitmask(matchers, num_rows, seconds), device)

    def logit_offsets(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        """fill_bitmask's words -> the logit mask logit_mask describes."""
        return logit_mask_from_bitmask(bitmask, self.vocab_size, device)

    def allowed_tokens(
        self,
        matchers: Sequence[tuple[int, llguidance.LLMatcher]],
        num_rows: int,
        device: torch.device,
    ) -> torch.Tensor:
        """[num_rows, vocab_size] bool on `device`: the tokens each row may sample next (all
        of them for rows without a matcher)."""
        return unpack_bitmask(self.fill_bitmask(matchers, num_rows).to(device), self.vocab_size)


# Byte value b -> the logit offsets of its 8 tokens (token k of the byte is bit k): 0.0 where
# the bit is set, -inf where it is clear.
_BYTE_OFFSETS = torch.tensor(
    [[0.0 if (b >> k) & 1 else float("-inf") for k in range(8)] for b in range(256)]
)


def _bit(k: int) -> int:
    """The int32 word with only bit k set (bit 31 is the sign bit)."""
    return -(1 << 31) if k == 31 else 1 << k


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 bitmask words -> [N, vocab_size] bool, with torch ops (on any device).
    Bit k of a word survives an arithmetic shift by k unchanged, sign bit included."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def logit_mask_from_bitmask(
    words: torch.Tensor, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[N, W] int32 bitmask words -> [N, vocab_size] float32 on `device`: 0 for a set bit,
    -inf for a clear one. Each byte of the words looks its 8 offsets up in a 256-row table
    (one embedding lookup, the words copied over first: they are 32x smaller than the mask);
    boolean masking and float selects cost several times more on the CPU."""
    table = _byte_offsets(str(device))
    rows = words.to(device, non_blocking=True).view(torch.uint8).long()  # little-endian
    return torch.nn.functional.embedding(rows, table).view(len(words), -1)[:, :vocab_size]


@functools.cache
def _byte_offsets(device: str) -> torch.Tensor:
    return _BYTE_OFFSETS.to(device)


def _clean_error(message: str) -> str:
    """llguidance's error without its position and grammar excerpt: the first line, from the
    JSON-schema compiler's own words where it has them."""
    first = message.strip().splitlines()[0] if message.strip() else "the grammar is invalid"
    marker = "failed to compile JSON schema:"
    if marker in first:
        return first.split(marker, 1)[1].strip()
    return first
