"""The output processor on the dev tokenizer: one documented behaviour for the text of a
finished request, whatever ended it and whether stop strings are set."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.inference.engine.output_processor import OutputProcessor
from kvchat.inference.engine.sequence import Sequence
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.inference.text.tokenizer import TiktokenTokenizer
from kvchat.inference.text.tokenizer_files import load_tokenizer, write_dev_tokenizer

IM_END = 100265


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> TiktokenTokenizer:
    path: Path = tmp_path_factory.mktemp("dev_tokenizer")
    write_dev_tokenizer(path)
    tok = load_tokenizer(path)
    assert isinstance(tok, TiktokenTokenizer)
    return tok


def run(tokenizer: TiktokenTokenizer, ids: list[int], params: SamplingParams) -> tuple[str, str]:
    """Feed `ids` as sampled tokens; returns (streamed text, final text) and the reason."""
    processor = OutputProcessor(tokenizer, frozenset({IM_END}))
    seq = Sequence("r", [1, 2, 3], params, max_total_tokens=100)
    processor.add(seq)
    streamed = ""
    for token_id in ids:
        out = processor.append_token(seq, token_id, None)
        streamed += out.new_text
        if out.finished:
            assert out.text is not None
            return streamed, out.text
    out = processor.finish(seq, "abort", abort_reason="cancelled")
    assert out.text is not None and out.abort_reason == "cancelled"
    return streamed + out.new_text, out.text


@pytest.mark.parametrize("stop", [(), ("END",)], ids=["no-stop-strings", "stop-strings"])
def test_unfinished_character_at_a_stop_token_shows_as_replacement(
    tokenizer: TiktokenTokenizer, stop: tuple[str, ...]
) -> None:
    lead_byte = tokenizer._encoding.encode_single_token(b"\xc3")  # half of "é"
    hello = tokenizer.encode("hello ")
    params = SamplingParams(max_tokens=20, stop=stop)
    streamed, text = run(tokenizer, [*hello, lead_byte, IM_END], params)
    # The same whether or not stop strings are set: the decoded ids, less the stop token.
    assert text == streamed == "hello \ufffd" == tokenizer.decode([*hello, lead_byte])


def test_abort_and_length_keep_the_same_rule(tokenizer: TiktokenTokenizer) -> None:
    lead_byte = tokenizer._encoding.encode_single_token(b"\xc3")
    _, aborted = run(tokenizer, [*tokenizer.encode("ab"), lead_byte], SamplingParams(stop="X"))
    assert aborted == "ab\ufffd"


def test_a_stop_string_ends_the_text_where_it_begins(tokenizer: TiktokenTokenizer) -> None:
    ids = tokenizer.encode("one two END three")
    streamed, text = run(tokenizer, ids, SamplingParams(max_tokens=20, stop="END"))
    assert text == streamed == "one two "


def test_a_plain_string_is_one_stop_string() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["A", "B"]).stop == ("A", "B")  # type: ignore[arg-type]
