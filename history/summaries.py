"""The running summary: what the dropped messages become under the `summarize` policy, the
prompt that makes it, how much of it to generate, which messages a new one folds in, and the
checks a generated one must pass before it replaces what it summarizes.

A running summary is rebuilt from the previous summary plus the newly dropped messages, and
it is all that remains of them, so a generated one is kept only if it keeps what it claims to
cover: it must not be empty, a copy of the transcript or a loop of one phrase, and it must
keep every fact (number or name) of the previous summary and of the dropped user messages
(`summary_defect`). One cut by its token limit ends at its last whole sentence. Otherwise the
summary is extracted instead (`extract_lines`): the previous summary, then what each dropped
user message stated, sentence by sentence; assistant replies, the model's own words, are left
out. A summary covers a message only when the stored text holds what it stated.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvchat.history.errors import InvalidHistoryError
from kvchat.history.policy import ROLES, HistoryPolicy

if TYPE_CHECKING:
    from kvchat.history.planner import ContextPlan

SUMMARY_INSTRUCTION = (
    "You keep the running summary of a conversation between a user and an assistant. "
    "The messages below are being removed from the conversation: your summary replaces "
    "them, and the previous summary if there is one, and is all that will remain of them. "
    "Write a concise summary that keeps the facts, names, numbers, decisions made and open "
    "tasks or questions; leave out greetings and filler. Answer with the summary only."
)


@dataclass(frozen=True)
class SummaryState:
    """The running summary of dropped messages, placed right after the system prompt."""

    text: str
    num_tokens: int  # its segment length as placed in the prompt
    covers: tuple[str, ...]  # ids of the messages it summarizes, oldest first

    def __post_init__(self) -> None:
        object.__setattr__(self, "covers", tuple(self.covers))
        if self.num_tokens < 0:
            raise InvalidHistoryError(
                f"summary num_tokens must be >= 0, got {self.num_tokens}", "summary"
            )
        if len(set(self.covers)) != len(self.covers):
            raise InvalidHistoryError("summary covers a message id twice", "summary")


def summary_targets(plan: ContextPlan) -> tuple[SummaryState | None, tuple[str, ...]]:
    """What a new summary after this turn folds together: the running summary it extends
    (None: the first) and the dropped messages no summary covers yet, oldest first; empty
    when there is nothing to summarize (not `summarize`, nothing new, or a running summary
    that does not lead this branch)."""
    previous = plan.running_summary
    covered = previous.covers if previous is not None else ()
    if not plan.to_summarize or plan.dropped[: len(covered)] != covered:
        return previous, ()
    return previous, plan.to_summarize


def summarization_messages(
    previous_summary: str | None, dropped: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """The (role, content) prompt that folds newly dropped messages into the summary:
    the instruction, then the previous summary and the messages as a transcript."""
    if not dropped:
        raise InvalidHistoryError("nothing to summarize: no dropped messages", "dropped")
    for role, _ in dropped:
        if role not in ROLES:
            raise InvalidHistoryError(f"dropped message has role {role!r}", "dropped")
    transcript = "\n\n".join(f"{role}: {content}" for role, content in dropped)
    parts = []
    if previous_summary:
        parts.append(f"Previous summary:\n{previous_summary}")
    parts.append(f"Messages to fold into the summary:\n{transcript}")
    return [("system", SUMMARY_INSTRUCTION), ("user", "\n\n".join(parts))]


def summary_max_new_tokens(
    policy: HistoryPolicy, max_context_tokens: int, markup_tokens: int
) -> int:
    """How many tokens to generate for a running summary: max_summary_tokens, bounded so the
    summary as placed (its text plus `markup_tokens`, what placing it adds: the prefix and the
    template's markup) stays within its share of the budget. 0 when the share cannot hold the
    markup: no summary is made."""
    if markup_tokens < 0:
        raise InvalidHistoryError(f"markup_tokens must be >= 0, got {markup_tokens}", "markup")
    room = policy.summary_share_tokens(max_context_tokens) - markup_tokens
    return max(0, min(policy.max_summary_tokens, room))


def merge_summary(
    previous: SummaryState | None, text: str, num_tokens: int, newly_covered: Sequence[str]
) -> SummaryState:
    """The new running summary: `text` (generated from the previous summary and the newly
    dropped messages) covering the previous summary's messages and then `newly_covered`."""
    before = previous.covers if previous is not None else ()
    if not newly_covered:
        raise InvalidHistoryError("a new summary must cover new messages", "newly_covered")
    if set(before) & set(newly_covered):
        raise InvalidHistoryError(
            "newly_covered repeats messages the previous summary covers", "newly_covered"
        )
    return SummaryState(text=text, num_tokens=num_tokens, covers=before + tuple(newly_covered))


# -- checking a generated summary --------------------------------------------------------------

SUMMARIZERS = ("model", "extractive")

# A sentence ends at . ! ? or an ellipsis (and any closing quotes or brackets after it) followed
# by white space or the end, or at a line break.
_SENTENCE_END = re.compile(r"""[.!?\u2026]+["'\u2019\u201d)\]]*(?=\s|$)|\n""")
_NUMBER = re.compile(r"\d+(?:[.,:/-]\d+)*")
_WORD = re.compile(r"[^\W\d_]+(?:['\u2019-][^\W\d_]+)*")
_POSSESSIVE = re.compile(r"['\u2019]s$")
_ROLE_LINE = re.compile(r"^\s*(user|assistant|tool|system)\s*:", re.IGNORECASE | re.MULTILINE)
# Capitalized words that are not names: pronouns, articles, sentence openers, greetings.
_NOT_NAMES = frozenset(
    """I I'm I've I'll I'd A An The My Me Mine We Our You Your He His Him She Her It Its They
    Their Them This That These Those There Here What Where When Who Whom Whose Which Why How
    And But Or So Yet If Then Also Please Thanks Thank Hi Hello Hey Yes No Not Okay OK Sure
    Well Now Today Is Are Was Were Do Does Did Can Could Will Would Should Shall May Might
    Must Let Let's Have Has Had Be Been Being At In On Of For From To With By As About After
    Before Since Until While Because Although Though User Assistant Summary Previous
    Messages Good
    """.split()  # noqa: SIM905
)
COPY_NGRAM = 8  # a generated summary whose word 8-grams mostly occur in the transcript copies it
COPY_SHARE = 0.5
REPEAT_NGRAM = 3  # ... whose word 3-grams are less than half distinct repeats itself
REPEAT_DISTINCT = 0.5


def end_at_sentence(text: str) -> str:
    """`text` up to the end of its last whole sentence ('' when it has none)."""
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    return text[: ends[-1]].strip() if ends else ""


def with_period(text: str) -> str:
    """`text` ending as a sentence does: a period added when it ends on a word."""
    text = text.strip()
    if text and not _SENTENCE_END.search(text[-1:] + " ") and text[-1] not in "\"')]:;":
        return text + "."
    return text


def sentences(text: str) -> list[str]:
    """The sentences of `text`, each stripped and ending as a sentence does."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        piece = text[start : m.end()].strip()
        if piece:
            out.append(with_period(piece))
        start = m.end()
    rest = text[start:].strip()
    if rest:
        out.append(with_period(rest))
    return out


def facts(text: str) -> set[str]:
    """The facts a summary must keep from `text`: its numbers and its names (capitalized words
    other than pronouns and sentence openers), as written."""
    names = {_POSSESSIVE.sub("", w) for w in _WORD.findall(text) if w[0].isupper()}
    return set(_NUMBER.findall(text)) | {w for w in names - _NOT_NAMES if len(w) > 1}


def stated_facts(text: str) -> set[str]:
    """The facts a generated summary is held to: `facts`, less the capitalized words that open
    a sentence and are not written capitalized mid-sentence anywhere in `text` ("Tell me about
    Rome." states Rome, not Tell)."""
    found = facts(text)
    openers, inside = set(), set()
    for sentence in sentences(text):
        words = [_POSSESSIVE.sub("", w) for w in _WORD.findall(sentence)]
        openers.update(words[:1])
        inside.update(words[1:])
    return found - (openers - inside)


def missing_facts(summary: str, required: set[str]) -> list[str]:
    """The facts in `required` that `summary` does not state (case-insensitive, whole words)."""
    words = _WORD.findall(summary)
    have = {w.lower() for w in words} | {_POSSESSIVE.sub("", w).lower() for w in words}
    have |= set(_NUMBER.findall(summary))
    return sorted(f for f in required if (f if f[0].isdigit() else f.lower()) not in have)


def summary_defect(
    summary: str, previous_summary: str | None, dropped: Sequence[tuple[str, str]]
) -> str | None:
    """Why a generated summary of `dropped` (role, content) pairs, folded into the previous
    summary, must not replace them; None when it may."""
    if not summary.strip():
        return "empty"
    if _ROLE_LINE.search(summary):
        return "copies the transcript"
    words = _WORD.findall(summary.lower())
    transcript = " ".join(_WORD.findall(" ".join(c for _, c in dropped).lower()))
    grams = _ngrams(words, COPY_NGRAM)
    if grams and sum(g in transcript for g in grams) >= COPY_SHARE * len(grams):
        return "copies the transcript"
    grams = _ngrams(words, REPEAT_NGRAM)
    if len(grams) >= 4 and len(set(grams)) < REPEAT_DISTINCT * len(grams):
        return "repeats itself"
    required = stated_facts(previous_summary or "")
    for role, content in dropped:
        if role == "user":
            required |= stated_facts(content)
    missing = missing_facts(summary, required)
    if missing:
        return "leaves out " + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
    return None


def _ngrams(words: list[str], n: int) -> list[str]:
    return [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)]


def extract_lines(role: str, content: str) -> list[str]:
    """What the extracted summary keeps of one dropped message: a user message's sentences
    (nothing of the assistant's replies or tool results)."""
    return sentences(content) if role == "user" else []
