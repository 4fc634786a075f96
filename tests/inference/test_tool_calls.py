"""Tool calls in model output: whole-text parsing, and streams split anywhere reassembling to it."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvchat.inference.text.chat_template import CHATML_TEMPLATE, CHATML_TOOLS_TEMPLATE
from kvchat.inference.text.json_scanner import JsonObjectScanner
from kvchat.inference.text.tool_calls import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamParser,
    detect_tool_call_format,
    new_tool_call_id,
    parse_tool_calls,
)
from kvchat_testing.chat_templates import TEMPLATES

ID = re.compile(r"call_[A-Za-z0-9_-]{24}")
NAMES = frozenset({"get_weather", "search", "run_code"})

Call = tuple[str, str]  # (name, arguments)


def calls_of(parsed: ParsedOutput) -> list[Call]:
    return [(call.name, call.arguments) for call in parsed.tool_calls]


def parse(text: str, fmt: str, names: frozenset[str] | None = NAMES) -> tuple[str | None, list]:
    parsed = parse_tool_calls(text, fmt, names)
    assert all(ID.fullmatch(call.id) for call in parsed.tool_calls)
    return parsed.content, calls_of(parsed)


def assemble(events: list[StreamEvent]) -> tuple[str | None, list[Call]]:
    """Content and calls from stream events, checking the OpenAI delta shape on the way."""
    content = ""
    calls: list[list[str]] = []
    ids: list[str] = []
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            content += event.text
            continue
        if event.index == len(calls):  # a new call: id and name, on its first delta only
            assert event.id is not None and ID.fullmatch(event.id)
            assert event.name is not None
            calls.append([event.name, event.arguments])
            ids.append(event.id)
        else:
            assert event.index == len(calls) - 1, "deltas of a call are contiguous"
            assert event.id is None and event.name is None
            calls[-1][1] += event.arguments
    assert len(set(ids)) == len(ids)
    return content or None, [(name, arguments) for name, arguments in calls]


def stream(
    pieces: list[str], fmt: str, names: frozenset[str] | None = NAMES
) -> tuple[str | None, list[Call]]:
    parser = ToolCallStreamParser(fmt, names)
    events: list[StreamEvent] = []
    for piece in pieces:
        events += parser.push(piece)
    events += parser.finish()
    assembled = assemble(events)
    result = parser.result()
    assert (result.content, calls_of(result)) == assembled
    return assembled


# --- scripted outputs ------------------------------------------------------------------------

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
HERMES_SINGLE = f"<tool_call>\n{WEATHER}\n</tool_call>"
HERMES_PARALLEL = (
    "Let me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"q": "Tokyo weather", "n": 3}}\n</tool_call>'
    "\nDone."
)
LLAMA31 = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
GENERIC_CALLS = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "search", "arguments": {"q": "n"}}]}'
)
LLAMA32 = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "search", "parameters": {"q": "news"}}'
)
UNICODE = (
    '<tool_call>{"name": "search", "arguments": {"q": "東京の天気 🌦", "e": "\\u00e9"}}</tool_call>'
)
TRICKY_STRING = (
    '<tool_call>{"name": "run_code", "arguments": {"code": "if (a) { b({}); }", '
    '"s": "</tool_call><tool_call>{\\"name\\": \\"x\\"}", "nested": {"a": [{"b": {}}]}}}'
    "</tool_call>"
)

# (format, output, expected content, expected calls)
CASES = [
    ("hermes", HERMES_SINGLE, None, [("get_weather", '{"city":"Paris","unit":"celsius"}')]),
    (
        "hermes",
        HERMES_PARALLEL,
        "Let me check both.\n\n\nDone.",
        [("get_weather", '{"city":"Paris"}'), ("search", '{"q":"Tokyo weather","n":3}')],
    ),
    ("hermes", UNICODE, None, [("search", '{"q":"東京の天気 🌦","e":"é"}')]),
    (
        "hermes",
        TRICKY_STRING,
        None,
        [
            (
                "run_code",
                '{"code":"if (a) { b({}); }","s":"</tool_call><tool_call>{\\"name\\": \\"x\\"}",'
                '"nested":{"a":[{"b":{}}]}}',
            )
        ],
    ),
    ("hermes", '<tool_call>{"name": "search"}</tool_call>', None, [("search", "{}")]),
    (
        "hermes",
        '<tool_call>{"name": "search", "parameters": {"q": 1}}</tool_call>',
        None,
        [("search", '{"q":1}')],
    ),
    (
        "hermes",
        "<tool_call>not json</tool_call> then "
        '<tool_call>{"name":"search","arguments":{"q":"x"}}</tool_call>',
        "<tool_call>not json</tool_call> then ",
        [("search", '{"q":"x"}')],
    ),
    ("hermes", "  \n\t", None, []),
    ("hermes", "", None, []),
    (
        "hermes",
        "Plain answer, a < and <tool but no call.",
        "Plain answer, a < and <tool but no call.",
        [],
    ),
    ("llama3_json", LLAMA31, None, [("get_weather", '{"city":"Paris"}')]),
    ("llama3_json", "<|python_tag|>" + LLAMA31, None, [("get_weather", '{"city":"Paris"}')]),
    (
        "llama3_json",
        "\n <|python_tag|> " + LLAMA31 + " \n",
        None,
        [("get_weather", '{"city":"Paris"}')],
    ),
    (
        "llama3_json",
        LLAMA32,
        None,
        [("get_weather", '{"city":"Paris"}'), ("search", '{"q":"news"}')],
    ),
    (
        "llama3_json",
        LLAMA32 + ";",
        None,
        [("get_weather", '{"city":"Paris"}'), ("search", '{"q":"news"}')],
    ),
    (
        "llama3_json",
        '{"name": "search", "arguments": {"q": "ü"}}',
        None,
        [("search", '{"q":"ü"}')],
    ),
    ("llama3_json", " The weather is {sunny}.", " The weather is {sunny}.", []),
    ("llama3_json", "", None, []),
    (
        "generic",
        GENERIC_CALLS,
        None,
        [("get_weather", '{"city":"Paris"}'), ("search", '{"q":"n"}')],
    ),
    ("generic", '{"response": "It is sunny."}', "It is sunny.", []),
    (
        "generic",
        '{"response": "a\\"b\\\\c\\n\\t\\u00e9\\ud83c\\udf26 \\/ 東京"}',
        'a"b\\c\n\té🌦 / 東京',
        [],
    ),
    ("generic", '\n {  "response" :"spaced" } \n', "spaced", []),
    (
        "generic",
        '{"response": {"city": "Oslo", "days": [1, 2]}}',
        '{"city": "Oslo", "days": [1, 2]}',
        [],
    ),
    ("generic", '{"response": 42}', "42", []),
    ("generic", '{"response": {"a": nope}}', '{"a": nope}}', []),  # without the grammar only
    ("generic", '{"response": ""}', None, []),
    ("generic", '{"response": "   "}', None, []),
    ("generic", '{"tool_calls": []}', None, []),
    ("generic", '{"tool_calls": [{"name": "search"}]}', None, [("search", "{}")]),
    # cut short (max_tokens): what was complete stays, an unfinished call or escape goes
    (
        "generic",
        '{"tool_calls": [{"name": "search", "arguments": {}}, {"name": "get_w',
        None,
        [("search", "{}")],
    ),
    ("generic", '{"response": "Half an ans', "Half an ans", []),
    ("generic", '{"response": "cut in an escape \\u00', "cut in an escape ", []),
    ("generic", '{"tool_calls": [', None, []),
    ("generic", ' {"response": "', None, []),
    ("generic", "Plain text, no JSON.", "Plain text, no JSON.", []),
    ("generic", "", None, []),
]

# Outputs that only look like calls: all content, verbatim. (format, output, tool names)
LOOKALIKES = [
    ("hermes", "<tool_call>not json</tool_call>", NAMES),
    ("hermes", '<tool_call>{"arguments": {"q": 1}}</tool_call>', NAMES),
    ("hermes", '<tool_call>{"name": "search", "arguments": [1, 2]}</tool_call>', NAMES),
    ("hermes", '<tool_call>{"name": "search", "arguments": "{\\"q\\": 1}"}</tool_call>', NAMES),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', NAMES),
    ("hermes", '<tool_call>{"name": 5, "arguments": {}}</tool_call>', None),
    ("hermes", '<tool_call>{"name": "", "arguments": {}}</tool_call>', None),
    ("hermes", '<tool_call>{"name": "search", "arguments": {}}', NAMES),  # unterminated
    ("hermes", '<tool_call>{"name": "search", "arguments": {"q": "</tool_call>', NAMES),
    ("hermes", "<tool_call>", NAMES),
    ("hermes", "Text <tool_call>\n", NAMES),
    ("hermes", '<tool_call>{"name": "search", "arguments": {}} extra</tool_call>', NAMES),
    ("hermes", '<tool_call>{"name": "search", "arguments": {"x": NaN}}</tool_call>', NAMES),
    ("hermes", '<tool_call>{"name": "search", "arguments": {"x": 1e999}}</tool_call>', NAMES),
    ("hermes", '<tool_call>{"name": "search", "arguments": {"x": "\\ud800"}}</tool_call>', NAMES),
    ("hermes", '<tool_call>{"name": "search", "arguments": {}}}</tool_call>', NAMES),
    ("hermes", '<tool_call>["search", {}]</tool_call>', NAMES),
    ("llama3_json", '{"foo": 1}', NAMES),
    ("llama3_json", '{"name": "rm_rf", "parameters": {}}', NAMES),
    ("llama3_json", '{"name": "search", "parameters": {}} and some more text', NAMES),
    ("llama3_json", '{"name": "search", "parameters": {}}; {"foo": 1}', NAMES),
    ("llama3_json", '{"name": "search", "parameters": {}};; {"name": "search"}', NAMES),
    ("llama3_json", '{"name": "search", "parameters": {}', NAMES),  # unterminated
    ("llama3_json", '{"name": "search", "parameters": [1]}', NAMES),
    ("llama3_json", '[{"name": "search", "parameters": {}}]', NAMES),
    ("llama3_json", '<|python_tag|>brave_search.call(query="kvchat")', NAMES),
    ("llama3_json", "<|python_tag|>", NAMES),
    ("llama3_json", 'Sure: {"name": "search", "parameters": {}}', NAMES),
    ("llama3_json", '<tool_call>{"name": "search", "arguments": {}}</tool_call>', NAMES),
    # generic: anything that goes astray before a call or some text was sent is all content
    ("generic", '{"tool_calls": [{"name": "rm_rf", "arguments": {}}]}', NAMES),
    ("generic", '{"tool_calls": [{"name": "search", "arguments": [1]}]}', NAMES),
    ("generic", '{"tool_calls": [{"name": "search", "arguments": {"x": NaN}}]}', NAMES),
    ("generic", '{"tool_calls": ["search"]}', NAMES),
    ("generic", '{"tool_calls": {"name": "search"}}', NAMES),
    ("generic", '{"tool_call": [{"name": "search", "arguments": {}}]}', NAMES),
    ("generic", '{"answer": "no"}', NAMES),
    ("generic", '{"response": "\\ud800 lone"}', NAMES),
    ("generic", '{"response": "\\x"}', NAMES),
    ("generic", '{"responses": "x"}', NAMES),
    ("generic", '["response"]', NAMES),
    ("generic", "{", NAMES),
]

ALL_OUTPUTS = [(fmt, text, NAMES) for fmt, text, _, _ in CASES] + LOOKALIKES


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_parse(fmt: str, text: str, content: str | None, calls: list[Call]) -> None:
    assert parse(text, fmt) == (content, calls)


@pytest.mark.parametrize(("fmt", "text", "names"), LOOKALIKES)
def test_lookalikes_stay_content(fmt: str, text: str, names: frozenset[str] | None) -> None:
    assert parse(text, fmt, names) == (text, [])


def test_tool_names_filter_only_when_given() -> None:
    text = '<tool_call>{"name": "anything", "arguments": {"a": true}}</tool_call>'
    assert parse(text, "hermes", None) == (None, [("anything", '{"a":true}')])
    assert parse(text, "hermes", frozenset()) == (text, [])
    assert parse(text, "hermes", {"anything"}) == (None, [("anything", '{"a":true}')])


def test_ids_are_fresh() -> None:
    ids = {new_tool_call_id() for _ in range(200)}
    assert len(ids) == 200 and all(ID.fullmatch(i) for i in ids)
    first, second = (parse_tool_calls(HERMES_SINGLE, "hermes").tool_calls[0] for _ in range(2))
    assert first.id != second.id
    assert first == ToolCall(first.id, "get_weather", '{"city":"Paris","unit":"celsius"}')


# --- streaming -------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "text", "names"), ALL_OUTPUTS)
def test_stream_split_at_every_position(fmt: str, text: str, names: frozenset[str] | None) -> None:
    expected = parse(text, fmt, names)
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]], fmt, names) == expected, i
    assert stream(list(text), fmt, names) == expected  # one character at a time
    assert stream([], fmt, names) == (None, [])


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stream_split_at_random_positions(data: st.DataObject) -> None:
    fmt, text, names = data.draw(st.sampled_from(ALL_OUTPUTS))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert stream(pieces, fmt, names) == parse(text, fmt, names)


@settings(max_examples=150, deadline=None)
@given(
    before=st.text(max_size=20),
    args=st.dictionaries(
        st.text(max_size=8),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=10),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.text(max_size=5), inner, max_size=3)
            ),
            max_leaves=6,
        ),
        max_size=4,
    ),
    between=st.text(alphabet=" \n", max_size=3),
    cuts=st.lists(st.integers(0, 400), max_size=10),
)
def test_hermes_random_calls(before: str, args: dict, between: str, cuts: list[int]) -> None:
    assume("<tool_call>" not in before and "<" not in before[-12:])
    text = (
        before
        + f"<tool_call>{between}"
        + json.dumps({"name": "search", "arguments": args}, ensure_ascii=bool(cuts))
        + f"{between}</tool_call>"
    )
    expected_args = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    content = before if before.strip() else None
    assert parse(text, "hermes") == (content, [("search", expected_args)])
    cuts = sorted(c for c in cuts if c <= len(text))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert stream(pieces, "hermes") == (content, [("search", expected_args)])


def test_ordinary_text_is_not_held() -> None:
    parser = ToolCallStreamParser("hermes", NAMES)
    assert parser.push("Hello") == [ContentDelta("Hello")]
    assert parser.push(" wor") == [ContentDelta(" wor")]
    assert parser.push("ld <tool") == [ContentDelta("ld ")]  # "<tool" may open a call
    assert parser.push("box> ok") == [ContentDelta("<toolbox> ok")]
    assert parser.push("<tool_call>not") == [ContentDelta("<tool_call>not")]  # cannot be a call
    assert parser.push(" json</tool_") == [ContentDelta(" json</tool_")]
    assert parser.push("call> <") == [ContentDelta("call> ")]
    assert parser.finish() == [ContentDelta("<")]


def test_a_call_is_emitted_when_its_block_closes() -> None:
    parser = ToolCallStreamParser("hermes", NAMES)
    assert parser.push("<tool_call>\n") == []
    assert parser.push('{"name": "search", "arguments": {"q": "a}') == []
    assert parser.push('"}}\n</tool_') == []
    events = parser.push("call>\nAfter")
    assert len(events) == 3
    first, second, after = events
    assert isinstance(first, ToolCallDelta) and isinstance(second, ToolCallDelta)
    assert (first.index, first.name, first.arguments) == (0, "search", "")
    assert first.id is not None and ID.fullmatch(first.id)
    assert second == ToolCallDelta(0, None, None, '{"q":"a}"}')
    assert after == ContentDelta("\nAfter")
    assert parser.finish() == []
    result = parser.result()
    assert result == ParsedOutput("\nAfter", [ToolCall(first.id, "search", '{"q":"a}"}')])


def test_llama3_held_only_when_it_starts_like_a_call() -> None:
    parser = ToolCallStreamParser("llama3_json", NAMES)
    assert parser.push("  ") == []  # still could be a call
    assert parser.push("The answer") == [ContentDelta("  The answer")]
    assert parser.push(" is {x}") == [ContentDelta(" is {x}")]
    assert parser.finish() == []

    parser = ToolCallStreamParser("llama3_json", NAMES)
    assert parser.push("<|python") == []
    assert parser.push("_tag|>") == []
    assert parser.push(LLAMA31) == []  # a `;` and another call may follow
    events = parser.finish()
    assert [(e.index, e.name, e.arguments) for e in events if isinstance(e, ToolCallDelta)] == [
        (0, "get_weather", ""),
        (0, None, '{"city":"Paris"}'),
    ]

    parser = ToolCallStreamParser("llama3_json", NAMES)
    assert parser.push('{"name": "search", "parameters": {}} ') == []
    assert parser.push("no") == [ContentDelta('{"name": "search", "parameters": {}} no')]


def test_whitespace_only_content_is_none() -> None:
    parser = ToolCallStreamParser("hermes", NAMES)
    assert parser.push("\n\n") == []
    events = parser.push(HERMES_SINGLE + "\n")
    assert [type(e) for e in events] == [ToolCallDelta, ToolCallDelta]
    assert parser.finish() == []
    assert parser.result().content is None
    # Once there is real content, whitespace is kept as written.
    assert parse("\n\nHi " + HERMES_SINGLE + " \n", "hermes")[0] == "\n\nHi  \n"


def test_misuse() -> None:
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        ToolCallStreamParser("xml")
    parser = ToolCallStreamParser("hermes")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.push("x")
    with pytest.raises(RuntimeError):
        parser.finish()


# --- formats of templates ----------------------------------------------------------------------


def test_detect_tool_call_format() -> None:
    qwen = (TEMPLATES / "qwen2.5-instruct.jinja").read_text()
    llama = (TEMPLATES / "llama-3.1-instruct.jinja").read_text()
    assert detect_tool_call_format(qwen) == "hermes"
    assert detect_tool_call_format(CHATML_TOOLS_TEMPLATE) == "hermes"
    assert detect_tool_call_format(llama) == "llama3_json"
    assert detect_tool_call_format(llama.replace("<|python_tag|>", "")) == "llama3_json"
    assert detect_tool_call_format(CHATML_TEMPLATE) is None
    assert detect_tool_call_format("{{ messages }}") is None


# --- the JSON scanner behind the stream ---------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
JSON_OBJECTS = st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=4)


def scan(text: str) -> JsonObjectScanner:
    scanner = JsonObjectScanner(0)
    scanner.advance(text)
    return scanner


@settings(max_examples=200, deadline=None)
@given(value=JSON_OBJECTS, indent=st.sampled_from([None, 0, 2]), ascii_=st.booleans())
def test_scanner_finds_the_end_of_every_object(
    value: dict, indent: int | None, ascii_: bool
) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_)
    for i in range(len(text)):  # every proper prefix could still complete
        assert scan(text[:i]).status == "partial", text[:i]
    for tail in ("", " ", "}", ",{", "</tool_call>"):
        scanner = scan(text + tail)
        assert (scanner.status, scanner.end) == ("complete", len(text))


@settings(max_examples=400, deadline=None)
@given(
    value=JSON_OBJECTS,
    edits=st.lists(
        st.tuples(
            st.integers(0, 200),
            st.sampled_from(list('{}[]":,\\ -.0123456789eEtrufalsnx\n\x01')) | st.just(""),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_scanner_agrees_with_json_on_mutations(value: dict, edits: list[tuple[int, str]]) -> None:
    text = json.dumps(value)
    for position, char in edits:  # insert a character, or delete one
        position = min(position, len(text))
        text = text[:position] + char + text[position + (0 if char else 1) :]
    assume(text.startswith("{"))
    scanner = scan(text)
    try:
        decoded, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        decoded, end = None, -1
    if scanner.status == "complete":
        assert isinstance(decoded, dict) and end == scanner.end
    elif isinstance(decoded, dict):
        # Python also reads NaN/Infinity, which are not JSON; nothing else may be missed.
        assert scanner.status == "invalid" and re.search(r"NaN|Infinity", text[:end])
    if scanner.status == "invalid":  # no continuation completes it
        for tail in ("}", '"}', "]}", "}}", '": 1}', "1}", "e}", 'e"}'):
            with pytest.raises(json.JSONDecodeError):
                json.loads(text + tail)


@pytest.mark.parametrize(
    ("text", "status"),
    [
        ("{", "partial"),
        ('{"a": -', "partial"),
        ('{"a": 1.', "partial"),
        ('{"a": 1e+', "partial"),
        ('{"a": tr', "partial"),
        ('{"a": "\\u12', "partial"),
        ('{"a": [1, {"b": [', "partial"),
        ('{"a": 01', "invalid"),
        ('{"a": 1.e', "invalid"),
        ('{"a": -x', "invalid"),
        ('{"a": +1', "invalid"),
        ('{"a": trx', "invalid"),
        ('{"a": NaN', "invalid"),
        ('{"a" 1', "invalid"),
        ('{"a": "\\x', "invalid"),
        ('{"a": "\\u12g', "invalid"),
        ('{"a": "tab\there"', "invalid"),
        ('{"a": 1,}', "invalid"),
        ('{"a": [1 2', "invalid"),
        ('{"a": [1,]', "invalid"),
        ("{,", "invalid"),
        ("{'a': 1}", "invalid"),
        ("[1]", "invalid"),
        ('{"a": [1, 2.5e-3, true, false, null, "\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9"]}', "complete"),
    ],
)
def test_scanner_decides_as_early_as_it_can(text: str, status: str) -> None:
    assert scan(text).status == status


ARGUMENTS = ('{"city": "Paris", "unit": "c"}', '{"unit": "c", "city": "Paris"}')


def repeated_call_output(fmt: str) -> str:
    """Paris, Paris again (keys in another order), then Tokyo, in `fmt`."""
    if fmt == "hermes":
        block = '<tool_call>{{"name": "get_weather", "arguments": {}}}</tool_call>'
        return "\n".join(block.format(a) for a in (*ARGUMENTS, '{"city": "Tokyo", "unit": "c"}'))
    if fmt == "generic":
        call = '{{"name": "get_weather", "arguments": {}}}'
        calls = ", ".join(call.format(a) for a in (*ARGUMENTS, '{"city": "Tokyo", "unit": "c"}'))
        return '{"tool_calls": [' + calls + "]}"
    call = '{{"name": "get_weather", "parameters": {}}}'
    return "; ".join(call.format(a) for a in (*ARGUMENTS, '{"city": "Tokyo", "unit": "c"}'))


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "generic"])
def test_a_repeated_call_is_dropped_and_its_span_told(fmt: str) -> None:
    """The repeat's span (with its joiner) taken out of the text leaves the output the model
    would have written without it: the same calls, nothing else dropped."""
    text = repeated_call_output(fmt)
    parser = ToolCallStreamParser(fmt, NAMES)
    for i in range(0, len(text), 5):
        parser.push(text[i : i + 5])
    parser.finish()
    assert len(parser.dropped_spans) == 1
    start, end = parser.dropped_spans[0]
    assert '"unit": "c", "city": "Paris"' in text[start:end]
    without = text[:start] + text[end:]
    assert '"unit": "c", "city": "Paris"' not in without
    again = ToolCallStreamParser(fmt, NAMES)
    again.push(without)
    again.finish()
    assert again.dropped_spans == []
    assert calls_of(again.result()) == calls_of(parser.result())
    assert again.result().content == parser.result().content


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "generic"])
def test_a_repeated_call_is_made_once(fmt: str) -> None:
    """The same name and arguments (keys in any order) twice in one output: one call; the
    same tool with other arguments is another call."""
    if fmt != "llama3_json":
        text = repeated_call_output(fmt)
    else:
        call = '{{"name": "get_weather", "parameters": {}}}'
        text = "; ".join(
            call.format(a)
            for a in (
                '{"city": "Paris", "unit": "c"}',
                '{"unit": "c", "city": "Paris"}',
                '{"city": "Tokyo", "unit": "c"}',
            )
        )
    expected = [
        ("get_weather", '{"city":"Paris","unit":"c"}'),
        ("get_weather", '{"city":"Tokyo","unit":"c"}'),
    ]
    assert parse(text, fmt) == (None, expected)
    assert stream([text[i : i + 7] for i in range(0, len(text), 7)], fmt) == (None, expected)
