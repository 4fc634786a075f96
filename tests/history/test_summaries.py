"""The checks a generated running summary passes before it replaces what it summarizes, and
the sentence and fact helpers they rest on (pure Python: no model)."""

from __future__ import annotations

import pytest

from kvchat.history import end_at_sentence, facts, missing_facts, sentences, summary_defect

DROPPED = [
    ("user", "Hi! My name is Ada Lovelace and I work as a nurse in Lyon."),
    ("assistant", "Nice to meet you, Ada. How long have you been a nurse?"),
    ("user", "Since 2019. My friend Bruno lives in Porto."),
]


def test_facts_are_the_numbers_and_names_a_text_states() -> None:
    assert facts(DROPPED[0][1]) == {"Ada", "Lovelace", "Lyon"}
    assert facts(DROPPED[2][1]) == {"2019", "Bruno", "Porto"}
    # Possessives keep the name; pronouns and sentence openers are not names.
    assert facts("Gutenberg's press, around 1440. I think The end is near.") == {
        "Gutenberg",
        "1440",
    }
    assert missing_facts("Ada's friend lives in porto.", {"Ada", "Porto", "Bruno"}) == ["Bruno"]


@pytest.mark.parametrize(
    ("text", "ended"),
    [
        ("The user is Ada. She works in Ly", "The user is Ada."),
        ('He said "yes." And then', 'He said "yes."'),
        ("One line\nand half a second", "One line"),
        ("Version 2.5 is out! Next is", "Version 2.5 is out!"),
        ("no sentence ends here", ""),
    ],
)
def test_a_summary_cut_by_its_limit_ends_at_its_last_whole_sentence(text: str, ended: str) -> None:
    assert end_at_sentence(text) == ended


def test_sentences_split_and_end_every_piece() -> None:
    assert sentences("Hi there! I live in Lyon.\nMy friend is Bruno") == [
        "Hi there!",
        "I live in Lyon.",
        "My friend is Bruno.",
    ]


@pytest.mark.parametrize(
    ("summary", "previous", "defect"),
    [
        (
            "The user, Ada Lovelace, is a nurse in Lyon since 2019; friend Bruno in Porto.",
            None,
            None,
        ),
        ("", None, "empty"),
        ("user: Hi! My name is Ada Lovelace", None, "copies the transcript"),
        (
            "Hi! My name is Ada Lovelace and I work as a nurse in Lyon. Since 2019. "
            "My friend Bruno lives in Porto.",
            None,
            "copies the transcript",
        ),
        ("Ada nurse Ada nurse Ada nurse Ada nurse Ada nurse Ada nurse", None, "repeats itself"),
        # Built from the last exchange alone: the first message's facts are gone.
        (
            "Since 2019 the user's friend Bruno lives in Porto.",
            None,
            "leaves out Ada, Lovelace, Lyon",
        ),
        # A running summary keeps what the previous one held.
        (
            "Ada Lovelace, a nurse in Lyon since 2019, has a friend Bruno in Porto.",
            "The user is 41 and has a cat named Miso.",
            "leaves out 41, Miso",
        ),
        (
            "Ada Lovelace (41, cat Miso) is a nurse in Lyon since 2019; friend Bruno, Porto.",
            "The user is 41 and has a cat named Miso.",
            None,
        ),
    ],
)
def test_a_generated_summary_that_does_not_keep_what_it_covers_is_refused(
    summary: str, previous: str | None, defect: str | None
) -> None:
    assert summary_defect(summary, previous, DROPPED) == defect


def test_a_word_that_only_opens_a_sentence_is_not_a_fact_a_summary_must_keep() -> None:
    dropped = [("user", "Tell me about Rome. Rome is old. Give me three tips, Tell.")]
    assert summary_defect("The user asked about Rome.", None, dropped) == "leaves out Tell"
    # The price: a name that only ever opens a sentence is not held either.
    dropped = [("user", "Tell me about Rome. Lyon is where I live.")]
    assert summary_defect("The user asked about Rome.", None, dropped) is None


def test_only_the_users_facts_are_required() -> None:
    # What the assistant said is the model's own words: a summary need not keep its names.
    dropped = [("user", "I live in Lyon."), ("assistant", "Lyon is lovely, says Paul Bocuse.")]
    assert summary_defect("The user lives in Lyon.", None, dropped) is None
