"""A reply's token ids with parts of its text taken out (a repeated tool call the parser
dropped), keeping every other id as the model generated it: the tokens wholly before and after
a part stay, and only the text of the tokens it cuts through is tokenized again."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def ids_without_spans(
    token_ids: Sequence[int],
    text: str,
    spans: Sequence[tuple[int, int]],
    decode: Callable[[Sequence[int]], str],
    encode: Callable[[str], Sequence[int]],
) -> tuple[list[int], str]:
    """(the ids, the text) of the reply without text[start:end] for each span. `text` is the
    reply as the engine decoded it; when decoding the ids does not start with it (a
    detokenizer that differs), the reply is returned unchanged rather than cut wrongly."""
    ids = list(token_ids)
    if not spans or not decode(ids).startswith(text):
        return ids, text
    for start, end in sorted(spans, reverse=True):  # from the end: earlier offsets hold
        if not 0 <= start < end <= len(text):
            raise ValueError(f"span {start}:{end} is outside the reply's {len(text)} characters")
        whole = decode(ids)
        first = _last_prefix_within(ids, start, decode)
        last = _first_prefix_reaching(ids, end, decode)
        before = whole[len(decode(ids[:first])) : start]
        after = whole[end : len(decode(ids[:last]))]
        ids = [*ids[:first], *encode(before + after), *ids[last:]]
        text = text[:start] + text[end:]
    return ids, text


def _last_prefix_within(ids: list[int], limit: int, decode: Callable[[Sequence[int]], str]) -> int:
    """The most tokens whose text is at most `limit` characters (binary search: a prefix's
    text grows with it)."""
    low, high = 0, len(ids)
    while low < high:
        middle = (low + high + 1) // 2
        if len(decode(ids[:middle])) <= limit:
            low = middle
        else:
            high = middle - 1
    return low


def _first_prefix_reaching(
    ids: list[int], limit: int, decode: Callable[[Sequence[int]], str]
) -> int:
    """The fewest tokens whose text is at least `limit` characters."""
    low, high = 0, len(ids)
    while low < high:
        middle = (low + high) // 2
        if len(decode(ids[:middle])) >= limit:
            high = middle
        else:
            low = middle + 1
    return low
