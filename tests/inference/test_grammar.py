"""Grammars and their compiler: token bytes for both tokenizer kinds, what the grammars accept,
the compile cache, errors that name the unsupported feature."""

from __future__ import annotations

import ctypes
import json
import random

import pytest
import torch

from kvchat.inference.structured.compiler import (
    GrammarCompiler,
    GrammarError,
    logit_mask_from_bitmask,
    unpack_bitmask,
)
from kvchat.inference.structured.grammar import (
    Grammar,
    ToolSpec,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from kvchat.inference.text.tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer
from kvchat.inference.text.tokenizer_files import (
    dev_special_tokens,
    load_bundled_tokenizer,
    load_tokenizer,
)
from kvchat.inference.text.tool_calls import HERMES, LLAMA3_JSON, parse_tool_calls
from kvchat_testing.tokenizers import write_hf_tokenizer

CPU = torch.device("cpu")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def dev_tokenizer() -> TiktokenTokenizer:
    return load_bundled_tokenizer(special_tokens=dev_special_tokens(), eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def compiler(dev_tokenizer: TiktokenTokenizer) -> GrammarCompiler:
    # 8 rows of padding past the tokenizer, as checkpoints pad their vocab.
    return GrammarCompiler(dev_tokenizer, dev_tokenizer.vocab_size + 8, dev_tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("hf")
    write_hf_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


def accepts(
    compiler: GrammarCompiler, tokenizer: Tokenizer, grammar: Grammar, text: str
) -> tuple[bool, bool]:
    """(every token of `text` accepted, the grammar complete after them)."""
    matcher = compiler.new_matcher(grammar)
    ids = tokenizer.encode(text)
    return matcher.try_consume_tokens(ids) == len(ids), matcher.is_accepting()


TEXTS = ["hello world", "naïve café – 東京 🙂", " leading and  double  spaces\n", '{"a": 1}']


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_utf8_of_the_text(
    dev_tokenizer: TiktokenTokenizer, hf_tokenizer: Tokenizer, text: str
) -> None:
    for tokenizer in (dev_tokenizer, hf_tokenizer):
        ids = tokenizer.encode(text)
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_hf_byte_tokens_are_raw_bytes_and_specials_their_text(hf_tokenizer: Tokenizer) -> None:
    ids = hf_tokenizer.encode("é")  # two byte-level tokens in this ASCII-trained vocab
    assert len(ids) == 2
    assert [hf_tokenizer.token_bytes(i) for i in ids] == [b"\xc3", b"\xa9"]
    end = hf_tokenizer.token_to_id("<|im_end|>")
    assert end is not None and end in hf_tokenizer.special_token_ids
    assert hf_tokenizer.token_bytes(end) == b"<|im_end|>"


def test_json_schema_grammar_accepts_valid_and_rejects_invalid(
    compiler: GrammarCompiler, dev_tokenizer: TiktokenTokenizer
) -> None:
    grammar = json_schema_grammar(WEATHER)
    assert accepts(compiler, dev_tokenizer, grammar, '{"city": "Paris", "days": 3}') == (True, True)
    assert accepts(compiler, dev_tokenizer, grammar, '{"city": "Paris"') == (True, False)
    for bad in (
        '{"city": "Paris", "days": 15}',
        '{"city": "Paris", "days": 3.5}',
        '{"days": 3, "city": "Paris"}',
        '{"city": "Paris", "days": 3, "x": 1}',
        '{"city": "Paris and beyond", "days": 3}',
        '{"city":"Paris","days":3}',
    ):
        assert accepts(compiler, dev_tokenizer, grammar, bad)[0] is False, bad


def test_json_object_grammar_takes_any_object_only(
    compiler: GrammarCompiler, dev_tokenizer: TiktokenTokenizer
) -> None:
    grammar = json_object_grammar()
    assert accepts(compiler, dev_tokenizer, grammar, '{"a": [1, {"b": null}]}') == (True, True)
    for bad in ("[1]", '"text"', "42"):
        assert accepts(compiler, dev_tokenizer, grammar, bad)[0] is False, bad


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_tool_call_grammar_matches_what_the_parser_reads(
    compiler: GrammarCompiler, dev_tokenizer: TiktokenTokenizer, fmt: str
) -> None:
    tools = [ToolSpec("get_weather", WEATHER), ToolSpec("ping", None)]
    key = "arguments" if fmt == HERMES else "parameters"
    calls = [{"name": "get_weather", key: {"city": "Oslo", "days": 2}}, {"name": "ping", key: {}}]
    bodies = [json.dumps(c) for c in calls]
    if fmt == HERMES:
        text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies)
    else:
        text = "; ".join(bodies)
    parallel = tool_call_grammar(tools, fmt, parallel=True)
    single = tool_call_grammar(tools, fmt, parallel=False)
    assert accepts(compiler, dev_tokenizer, parallel, text) == (True, True)
    assert accepts(compiler, dev_tokenizer, single, text)[0] is False  # only one call
    first = text.split("\n<tool_call>")[0] if fmt == HERMES else bodies[0]
    assert accepts(compiler, dev_tokenizer, single, first) == (True, True)
    parsed = parse_tool_calls(text, fmt, {"get_weather", "ping"})
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("ping", {}),
    ]
    assert parsed.content is None
    # A name not offered, arguments off-schema: not in the grammar.
    wrong = text.replace("get_weather", "get_weathers")
    assert accepts(compiler, dev_tokenizer, parallel, wrong)[0] is False
    assert (
        accepts(compiler, dev_tokenizer, parallel, text.replace('"days": 2', '"days": 0'))[0]
        is False
    )


def test_tool_calls_or_json_content(
    compiler: GrammarCompiler, dev_tokenizer: TiktokenTokenizer
) -> None:
    grammar = tool_call_grammar(
        [ToolSpec("ping", None)], HERMES, parallel=False, content_schema=WEATHER
    )
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    assert accepts(compiler, dev_tokenizer, grammar, call) == (True, True)
    assert accepts(compiler, dev_tokenizer, grammar, '{"city": "Rome", "days": 1}') == (True, True)
    assert accepts(compiler, dev_tokenizer, grammar, "Hello")[0] is False


def test_same_grammar_compiles_once(dev_tokenizer: TiktokenTokenizer) -> None:
    compiler = GrammarCompiler(
        dev_tokenizer, dev_tokenizer.vocab_size, dev_tokenizer.eos_token_ids, cache_size=2
    )
    a, b, c = (json_schema_grammar({**WEATHER, "title": t}) for t in "abc")
    first = compiler.new_matcher(a)
    second = compiler.new_matcher(json_schema_grammar({**WEATHER, "title": "a"}))  # equal
    assert compiler.num_compiled == 1 and compiler.num_cache_hits == 1
    assert first is not second  # each request its own state
    assert first.consume_tokens(dev_tokenizer.encode('{"city": "Oslo"'))
    whole = dev_tokenizer.encode('{"city": "Rome", "days": 1}')
    assert second.try_consume_tokens(whole) == len(whole)  # still at the start
    compiler.compile(b)
    compiler.compile(c)  # evicts a (cache of 2)
    assert compiler.num_compiled == 3
    compiler.compile(a)
    assert compiler.num_compiled == 4


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ],
)
def test_unsupported_features_are_errors_naming_them(
    compiler: GrammarCompiler, schema: dict[str, object], feature: str
) -> None:
    with pytest.raises(GrammarError, match=feature) as info:
        compiler.compile(json_schema_grammar(schema))
    assert "\n" not in str(info.value)


def test_masks_of_a_batch_are_per_row_and_padding_is_never_allowed(
    compiler: GrammarCompiler, dev_tokenizer: TiktokenTokenizer
) -> None:
    schema_matcher = compiler.new_matcher(json_schema_grammar(WEATHER))
    call_matcher = compiler.new_matcher(
        tool_call_grammar([ToolSpec("ping", None)], HERMES, parallel=False)
    )
    rows = [(0, schema_matcher), (2, call_matcher)]  # row 1 is unconstrained
    allowed = compiler.allowed_tokens(rows, 3, CPU)
    assert allowed.shape == (3, compiler.vocab_size) and allowed.dtype == torch.bool
    assert bool(allowed[1].all())
    assert not allowed[[0, 2], dev_tokenizer.vocab_size :].any()
    first = {dev_tokenizer.decode([int(i)]) for i in allowed[0].nonzero().flatten()}
    assert '{"' in first and first <= {"{", '{"'}  # not '{}': both properties are required
    third = {dev_tokenizer.decode([int(i)]) for i in allowed[2].nonzero().flatten()}
    assert third and all(
        "<tool_call>\n".startswith(t) or t.startswith("<tool_call>") for t in third
    )
    # The bit-unpacking agrees with llguidance's own bitmask, bit for bit; the accelerator's
    # (torch) unpacking agrees with the CPU's (numpy).
    rng = random.Random(0)
    bitmask = compiler.fill_bitmask(rows, 3)
    assert torch.equal(unpack_bitmask(bitmask, compiler.vocab_size), allowed)
    for row in range(3):
        for token in rng.sample(range(compiler.vocab_size), 500) + [90, 123, 1131]:
            bit = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert bool(bit) == bool(allowed[row, token])
        for token in allowed[row].nonzero().flatten()[:50].tolist():
            assert (int(bitmask[row, token // 32]) >> (token % 32)) & 1


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_a_token_check_gives_exactly_the_masks_answer(compiler: GrammarCompiler, fmt: str) -> None:
    """allows() (what the sampler checks draws with) against the mask, along random walks
    through a tool call and a JSON schema: forced text (the tag, the name, the keys: the mask
    then allows only the forced text's own first token, not other tokenizations of it),
    bounded strings, numbers, the end-of-sequence token, special tokens and padding ids."""
    rng = random.Random(4)
    grammars = [
        tool_call_grammar([ToolSpec("get_weather", WEATHER)], fmt, parallel=True),
        json_schema_grammar(
            {
                "type": "object",
                "properties": {
                    "note": {"type": "string", "maxLength": 6},
                    "n": {"type": "number", "minimum": 0},
                },
                "required": ["note", "n"],
            }
        ),
    ]
    vocab, eos = compiler.vocab_size, compiler.eos_token_ids
    checked = forced = 0
    for grammar in grammars:
        matcher = compiler.new_matcher(grammar)
        for _ in range(24):
            if matcher.is_stopped():
                break
            allowed = compiler.allowed_tokens([(0, matcher)], 1, CPU)[0]
            some_allowed = allowed.nonzero().flatten()[:300].tolist()
            ids = sorted(
                set(range(rng.randrange(5), vocab, 5))
                | set(eos)
                | set(range(vocab - 12, vocab))
                | set(some_allowed)
            )
            for token in ids:
                assert compiler.allows(matcher, token) == bool(allowed[token]), token
            checked += len(ids)
            forced += bool(matcher.compute_ff_tokens())
            assert matcher.consume_token(rng.choice(allowed.nonzero().flatten().tolist()))
    assert checked > 500_000 and forced >= 5


def test_the_logit_mask_is_0_where_allowed_and_minus_inf_elsewhere(
    compiler: GrammarCompiler,
) -> None:
    matcher = compiler.new_matcher(json_schema_grammar(WEATHER))
    rows = [(1, matcher)]  # rows 0 and 2 are unconstrained
    allowed = compiler.allowed_tokens(rows, 3, CPU)
    mask = compiler.logit_mask(rows, 3, CPU)
    assert mask.shape == (3, compiler.vocab_size) and mask.dtype == torch.float32
    assert bool((mask[0] == 0).all()) and bool((mask[2] == 0).all())
    assert torch.equal(mask == 0, allowed) and torch.equal(mask == float("-inf"), ~allowed)
    # Every bit of a word, the sign bit and a partial last word included.
    words = torch.tensor([[-1, 0, -(2**31), 1 | (1 << 30)]], dtype=torch.int32)
    offsets = logit_mask_from_bitmask(words, 4 * 32 - 3, CPU)
    expected = [True] * 32 + [False] * 32 + [False] * 31 + [True] + [True] + [False] * 29
    assert (offsets[0] == 0).tolist() == expected[: 4 * 32 - 3]
    assert bool((offsets[0][~torch.tensor(expected[: 4 * 32 - 3])] == float("-inf")).all())
    assert torch.equal(offsets == 0, unpack_bitmask(words, 4 * 32 - 3))


class _AllowsNothing:
    """A fault injected on purpose: a matcher whose mask comes back empty (llguidance gives an
    errored matcher EOS, so this cannot be had from a real one)."""

    def unsafe_compute_mask_ptr(self, pointer: int, num_bytes: int) -> None:
        ctypes.memset(pointer, 0, num_bytes)


def test_a_row_that_allows_nothing_may_end(
    compiler: GrammarCompiler, dev_tokenizer: TiktokenTokenizer
) -> None:
    real = compiler.new_matcher(json_schema_grammar(WEATHER))
    rows = [(0, _AllowsNothing()), (1, real)]
    mask = compiler.logit_mask(rows, 2, CPU)  # type: ignore[arg-type]
    assert set((mask[0] == 0).nonzero().flatten().tolist()) == set(dev_tokenizer.eos_token_ids)
    assert torch.equal(mask[1], compiler.logit_mask([(0, real)], 1, CPU)[0])
    # An end token on a word's sign bit (id % 32 == 31) is set as well.
    sign_bit = GrammarCompiler(dev_tokenizer, compiler.vocab_size, [95, 100])
    mask = sign_bit.logit_mask([(0, _AllowsNothing())], 1, CPU)  # type: ignore[list-item]
    assert (mask[0] == 0).nonzero().flatten().tolist() == [95, 100]


def test_an_accepting_grammar_allows_end_of_sequence(
    compiler: GrammarCompiler, dev_tokenizer: TiktokenTokenizer
) -> None:
    matcher = compiler.new_matcher(json_schema_grammar(WEATHER))
    assert matcher.consume_tokens(dev_tokenizer.encode('{"city": "Rome", "days": 7}'))
    allowed = compiler.allowed_tokens([(0, matcher)], 1, CPU)[0].nonzero().flatten().tolist()
    assert set(allowed) == set(dev_tokenizer.eos_token_ids)
    assert matcher.is_stopped()


def test_hf_tokenizer_constrains_too(hf_tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(hf_tokenizer, hf_tokenizer.vocab_size, hf_tokenizer.eos_token_ids)
    grammar = json_schema_grammar(
        {
            "type": "object",
            "properties": {"word": {"type": "string", "enum": ["héllo", "fox"]}},
            "required": ["word"],
        }
    )
    assert accepts(compiler, hf_tokenizer, grammar, '{"word": "héllo"}') == (True, True)
    assert accepts(compiler, hf_tokenizer, grammar, '{"word": "hello"}')[0] is False


def test_no_eos_is_refused(dev_tokenizer: TiktokenTokenizer) -> None:
    with pytest.raises(ValueError, match="end-of-sequence"):
        GrammarCompiler(dev_tokenizer, 1000, [])


def test_after_one_parallel_call_end_of_sequence_or_another_call(
    compiler: GrammarCompiler, dev_tokenizer: TiktokenTokenizer
) -> None:
    matcher = compiler.new_matcher(
        tool_call_grammar([ToolSpec("ping", None)], HERMES, parallel=True)
    )
    assert matcher.consume_tokens(
        dev_tokenizer.encode('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    )
    assert matcher.is_accepting() and not matcher.is_stopped()
    allowed = set(compiler.allowed_tokens([(0, matcher)], 1, CPU)[0].nonzero().flatten().tolist())
    assert set(dev_tokenizer.eos_token_ids) <= allowed
    others = {dev_tokenizer.decode([t]) for t in allowed - set(dev_tokenizer.eos_token_ids)}
    assert "\n" in others and all("\n<tool_call>\n".startswith(t) for t in others)


def test_unpacking_covers_every_bit_including_the_sign_bit() -> None:
    words = torch.tensor([[-1, 0, -(2**31), 1 | (1 << 30)]], dtype=torch.int32)
    bits = unpack_bitmask(words, 4 * 32 - 3)
    expected = [True] * 32 + [False] * 32 + [False] * 31 + [True] + [True] + [False] * 29
    assert bits[0].tolist() == expected[: 4 * 32 - 3]
