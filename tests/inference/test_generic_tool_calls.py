"""The generic tool-call format: where templates without a tool format of their own get the
tools, how calls, results and answers render (as the model writes them), the grammar that keeps
a reply in the format (and reads back exactly through the parser), and a repeated call taken
out of a reply's token ids."""

from __future__ import annotations

import json
import random

import pytest

from kvchat.inference.structured.compiler import GrammarCompiler
from kvchat.inference.structured.grammar import (
    ToolSpec,
    closed_schema,
    generic_answer_grammar,
    tool_call_grammar,
)
from kvchat.inference.text.chat_template import ChatMessage, ChatTemplate
from kvchat.inference.text.generic_tool_calls import (
    GENERIC,
    calls_text,
    response_text,
    signature,
    tool_result_text,
    tools_section,
)
from kvchat.inference.text.reply_ids import ids_without_spans
from kvchat.inference.text.tokenizer import Tokenizer
from kvchat.inference.text.tool_calls import ToolCallStreamParser, call_key, parse_tool_calls
from kvchat_testing.chat_templates import DEFAULT_SYSTEM_CHATML, LLAMA3_TEMPLATE, TOOLS, tool_call

CALL = tool_call("call_1", "get_weather", '{"city": "Paris", "unit": "celsius"}')
CONVERSATION = (
    ChatMessage("system", "You are terse."),
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", None, tool_calls=(CALL,)),
    ChatMessage("tool", '{"temp": 21}', tool_call_id="call_1"),
    ChatMessage("assistant", "21 °C."),
    ChatMessage("user", "Thanks"),
)
SECTION = tools_section(TOOLS)
CALLS = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]}'
)
RESULT = '{"tool_response": {"name": "get_weather", "content": {"temp": 21}}}'

# A template in Gemma's manner: no system role, roles must alternate, no `tool` role.
ALTERNATING = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def smol(dev_tokenizer: Tokenizer) -> ChatTemplate:
    """ChatML with a default system prompt, as SmolLM2's own template."""
    return ChatTemplate(DEFAULT_SYSTEM_CHATML, dev_tokenizer)


def test_the_prompt_shapes_are_the_replies_shapes() -> None:
    assert calls_text([CALL]) == CALLS
    assert json.loads(calls_text([CALL])) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]
    }
    assert response_text('A "quoted" 東京\n') == '{"response": "A \\"quoted\\" 東京\\n"}'
    assert (
        tool_result_text("f", '{"a": [1]}')
        == '{"tool_response": {"name": "f", "content": {"a": [1]}}}'
    )
    assert tool_result_text(None, "plain [x") == '{"tool_response": {"content": "plain [x"}}'
    lines = SECTION.split("\n")
    assert lines[1] == (
        'get_weather(city: str, unit: "celsius" | "fahrenheit" (optional)): '
        "Current weather in a city."
    )
    assert '"tool_calls"' in SECTION and '"response"' in SECTION


def test_signatures_say_names_types_and_what_may_be_left_out() -> None:
    function = {
        "name": "book",
        "description": "Book a room.\n  Pays   later.",
        "parameters": {
            "type": "object",
            "properties": {
                "guests": {"type": "integer"},
                "dates": {"type": "array", "items": {"type": "string"}},
                "room": {"type": "object", "properties": {"beds": {"type": "integer"}}},
                "view": {"enum": ["sea", "city"], "default": "city"},
                "note": {"type": ["string", "null"]},
                "extra": {"anyOf": [{"type": "number"}, {"type": "boolean"}]},
                "anything": {},
            },
            "required": ["guests", "dates", "room"],
        },
    }
    assert signature(function) == (
        "book(guests: int, dates: list[str], room: {beds: int}, "
        'view: "sea" | "city" = "city", note: str | None (optional), '
        "extra: float | bool (optional), anything: Any (optional)): Book a room. Pays later."
    )
    assert signature({"name": "ping"}) == "ping()"


def test_a_template_without_tools_renders_the_generic_format(smol: ChatTemplate) -> None:
    assert smol.is_generic and smol.tool_call_format == GENERIC
    text = smol.render_text(CONVERSATION, tools=TOOLS)
    assert text == (
        f"<|im_start|>system\nYou are terse.\n\n{SECTION}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALLS}<|im_end|>\n"
        f"<|im_start|>tool\n{RESULT}<|im_end|>\n"
        '<|im_start|>assistant\n{"response": "21 °C."}<|im_end|>\n'
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"
    )
    # Without tools offered: the history's calls and results as before, answers plain, and
    # the template's own default system prompt back.
    plain = smol.render_text(CONVERSATION[1:])
    assert plain.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert f"<|im_start|>assistant\n{CALLS}<|im_end|>" in plain
    assert "<|im_start|>assistant\n21 °C.<|im_end|>" in plain
    # No system message: the tools get one of their own (the default prompt makes way).
    assert smol.render_text(CONVERSATION[1:2], tools=TOOLS) == (
        f"<|im_start|>system\n{SECTION}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_tokens_are_the_texts_and_generated_replies_keep_their_ids(
    smol: ChatTemplate,
) -> None:
    text = smol.render_text(CONVERSATION, tools=TOOLS)
    ids = smol.render_ids(CONVERSATION, tools=TOOLS)
    assert tuple(ids) == smol.tokenize(text)
    # A reply the model wrote (its calls in its ids, as the grammar laid them out; the ids
    # tokenized in a way the text alone would not be) renders from those ids, whole.
    written = [
        *smol.tokenize('{"tool_calls": [{"name": "get_weather", '),
        *smol.tokenize('"arguments": {"city": "Paris", "unit": "celsius"}}]}'),
    ]
    generated = ChatMessage("assistant", None, token_ids=tuple(written), tool_calls=(CALL,))
    messages = [*CONVERSATION[:2], generated, *CONVERSATION[3:]]
    segments = smol.render_segments(messages, tools=TOOLS)
    reply = next(s for s in segments if s.message_index == 2)
    assert (
        tuple(written) == reply.token_ids[3 : 3 + len(written)]
    )  # after "<|im_start|>assistant\n"
    assert smol.render_text(messages, tools=TOOLS) == text


def test_templates_without_a_system_role_or_tool_role(dev_tokenizer: Tokenizer) -> None:
    template = ChatTemplate(ALTERNATING, dev_tokenizer)
    assert template.is_generic
    second = tool_call("call_2", "get_weather", '{"city": "Oslo"}')
    messages = [
        ChatMessage("user", "Weather in Paris and Oslo?"),
        ChatMessage("assistant", None, tool_calls=(CALL, second)),
        ChatMessage("tool", "sunny", tool_call_id="call_1"),
        ChatMessage("tool", "rain", tool_call_id="call_2"),
    ]
    text = template.render_text(messages, tools=TOOLS)
    # The tools open the first user message; both results are one user turn, so the roles
    # still alternate; each result names its call's function.
    assert text.startswith(f"<start_of_turn>user\n{SECTION}\n\nWeather in Paris and Oslo?")
    assert (
        "<start_of_turn>user\n"
        '{"tool_response": {"name": "get_weather", "content": "sunny"}}\n'
        '{"tool_response": {"name": "get_weather", "content": "rain"}}<end_of_turn>\n'
        "<start_of_turn>assistant\n"
    ) in text
    segments = template.render_segments(messages, tools=TOOLS)
    assert [t for s in segments for t in s.token_ids] == list(template.tokenize(text))


def test_llama3_without_tool_support(llama3_tokenizer: Tokenizer) -> None:
    template = ChatTemplate(LLAMA3_TEMPLATE, llama3_tokenizer)
    assert template.is_generic
    text = template.render_text(CONVERSATION, tools=TOOLS)
    assert (
        f"<|start_header_id|>system<|end_header_id|>\n\nYou are terse.\n\n{SECTION}<|eot_id|>"
        in text
    )
    assert f"<|start_header_id|>tool<|end_header_id|>\n\n{RESULT}<|eot_id|>" in text


@pytest.fixture(scope="module")
def compiler(dev_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(dev_tokenizer, dev_tokenizer.vocab_size, dev_tokenizer.eos_token_ids)


def accepts(compiler: GrammarCompiler, tokenizer: Tokenizer, grammar, text: str) -> bool:
    """Whether `text` is a complete output of the grammar."""
    matcher = compiler.new_matcher(grammar)
    ids = tokenizer.encode(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


WEATHER = TOOLS[0]["function"]["parameters"]
SPECS = [ToolSpec("get_weather", WEATHER), ToolSpec("ping", None)]


def test_the_generic_grammar_is_what_the_parser_reads(
    compiler: GrammarCompiler, dev_tokenizer: Tokenizer
) -> None:
    two = (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "ping", "arguments": {}}]}'
    )
    one = '{"tool_calls": [{"name": "ping", "arguments": {}}]}'
    answer = '{"response": "Hi \\"there\\"\\n"}'
    auto = tool_call_grammar(SPECS, GENERIC, parallel=True, answer=True)
    required = tool_call_grammar(SPECS, GENERIC, parallel=True)
    single = tool_call_grammar(SPECS, GENERIC, parallel=False)
    for grammar, text, allowed in [
        (auto, two, True),
        (auto, answer, True),
        (required, two, True),
        (required, answer, False),  # required: calls only
        (single, one, True),
        (single, two, False),  # parallel_tool_calls false: one call
        (auto, '{"tool_calls": []}', False),
        (auto, two.replace("get_weather", "get_weathers"), False),
        (auto, two.replace('"Oslo"}', '"Oslo", "extra": 1}'), False),  # objects are closed
        (auto, two.replace('"Oslo"', '"Oslo", "unit": "kelvin"'), False),
        (auto, '{"response":"no spaces"}', False),
    ]:
        assert accepts(compiler, dev_tokenizer, grammar, text) is allowed, text
    parsed = parse_tool_calls(two, GENERIC, {"get_weather", "ping"})
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("ping", {}),
    ]
    assert parse_tool_calls(answer, GENERIC).content == 'Hi "there"\n'
    # With a JSON response_format the answer is that JSON itself.
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    as_json = tool_call_grammar(SPECS, GENERIC, parallel=True, content_schema=schema, answer=True)
    assert accepts(compiler, dev_tokenizer, as_json, '{"response": {"n": 3}}')
    assert not accepts(compiler, dev_tokenizer, as_json, '{"response": "3"}')
    assert parse_tool_calls('{"response": {"n": 3}}', GENERIC).content == '{"n": 3}'


def test_strict_functions_carry_every_property(
    compiler: GrammarCompiler, dev_tokenizer: Tokenizer
) -> None:
    loose = tool_call_grammar([ToolSpec("get_weather", WEATHER)], GENERIC, parallel=False)
    strict = tool_call_grammar(
        [ToolSpec("get_weather", WEATHER, strict=True)], GENERIC, parallel=False
    )
    city_only = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    both = city_only.replace('"Oslo"', '"Oslo", "unit": "celsius"')
    assert accepts(compiler, dev_tokenizer, loose, city_only)
    assert not accepts(compiler, dev_tokenizer, strict, city_only)
    assert accepts(compiler, dev_tokenizer, strict, both)


def test_closed_schema_closes_only_what_it_may() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "string"}}},
            "b": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
            "c": {"type": "object", "properties": {"z": {}}, "additionalProperties": True},
            "d": {
                "allOf": [{"type": "object", "properties": {"p": {}}}, {"properties": {"q": {}}}]
            },
            "e": {"anyOf": [{"type": "object", "properties": {"r": {}}}, {"type": "null"}]},
        },
        "$defs": {"t": {"type": "object", "properties": {"s": {}}}},
    }
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["items"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert all("additionalProperties" not in s for s in closed["properties"]["d"]["allOf"])
    assert closed["properties"]["e"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["t"]["additionalProperties"] is False
    assert "required" not in closed["properties"]["a"]
    assert closed_schema(schema, require_all=True)["properties"]["a"]["required"] == ["x"]
    assert "additionalProperties" not in schema  # the caller's schema is left alone


def test_a_span_taken_out_of_a_reply_keeps_every_other_id(smol: ChatTemplate) -> None:
    rng = random.Random(7)
    words = ["alpha", " beta", "东京", " 😀", ", ", '{"x": 1}', "\n", " gamma"]
    tokenizer = smol._tokenizer
    for _ in range(60):
        text = "".join(rng.choice(words) for _ in range(rng.randint(2, 14)))
        ids = list(smol.tokenize(text))
        start = rng.randrange(len(text))
        end = rng.randint(start + 1, len(text))
        cut_ids, cut_text = ids_without_spans(
            ids, text, [(start, end)], tokenizer.decode, smol.tokenize
        )
        assert cut_text == text[:start] + text[end:]
        assert tokenizer.decode(cut_ids) == cut_text
        # The ids wholly before the span are the model's own, untouched.
        kept = 0
        while kept < len(ids) and len(tokenizer.decode(ids[: kept + 1])) <= start:
            kept += 1
        assert cut_ids[:kept] == ids[:kept]
    two = "aa, bb, cc, dd"
    ids = list(smol.tokenize(two))
    cut_ids, cut_text = ids_without_spans(
        ids, two, [(2, 6), (10, 14)], tokenizer.decode, smol.tokenize
    )
    assert cut_text == "aa, cc" and tokenizer.decode(cut_ids) == "aa, cc"
    # Ids that do not decode to the text are left alone rather than cut wrongly.
    assert ids_without_spans(ids, "something else", [(0, 3)], tokenizer.decode, smol.tokenize) == (
        ids,
        "something else",
    )


def test_an_output_that_ends_early_says_where_to_cut_and_what_closes_it() -> None:
    """What a reply cut by max_tokens, or ended by the model inside its answer, needs to be a
    whole one: the unfinished call or escape cut (unfinished_from), then `closing`."""
    call = '{"name": "search", "arguments": {"q": "x"}}'
    cases = [
        ('{"response": "Half an ans', None, '"}'),  # the model ended inside its answer
        ('{"response": "cut in an escape \\u00', len('{"response": "cut in an escape '), '"}'),
        ('{"tool_calls": [' + call + ", " + call[:12], len('{"tool_calls": [' + call), "]}"),
        ('{"tool_calls": [' + call[:20], len('{"tool_calls": ['), "]}"),
        ('{"tool_calls": [' + call + "]}", None, ""),
        ('{"response": "whole"}', None, ""),
        ("plain text", None, ""),
    ]
    for text, cut, closing in cases:
        parser = ToolCallStreamParser(GENERIC, {"search"})
        parser.push(text)
        parser.finish()
        assert (parser.unfinished_from, parser.closing) == (cut, closing), text
        whole = (text if cut is None else text[:cut]) + closing
        if closing:  # what the stored reply becomes parses to the same calls and content
            again = parse_tool_calls(whole, GENERIC, {"search"})
            assert [(c.name, c.arguments) for c in again.tool_calls] == [
                (c.name, c.arguments) for c in parser.result().tool_calls
            ]
            assert again.content == parser.result().content
            json.loads(whole)


def test_calls_the_last_turn_made_count_as_made() -> None:
    """A parser told the calls the conversation's last turn made drops them like repeats,
    keys in any order; a new call is still made."""
    answered = {call_key("search", '{"q": "x", "n": 1}')}
    text = (
        '{"tool_calls": [{"name": "search", "arguments": {"n": 1, "q": "x"}}, '
        '{"name": "search", "arguments": {"q": "y"}}]}'
    )
    parser = ToolCallStreamParser(GENERIC, {"search"}, answered)
    parser.push(text)
    parser.finish()
    assert [(c.name, c.arguments) for c in parser.result().tool_calls] == [("search", '{"q":"y"}')]
    start, end = parser.dropped_spans[0]
    assert text[start:end] == '{"name": "search", "arguments": {"n": 1, "q": "x"}}'


def test_an_answer_may_end_where_free_text_would(
    compiler: GrammarCompiler, dev_tokenizer: Tokenizer
) -> None:
    """Inside the answer's string the end of sequence is allowed (the close is optional);
    the answer-only grammar takes no call."""
    auto = tool_call_grammar(SPECS, GENERIC, parallel=True, answer=True)
    only = generic_answer_grammar()
    for grammar in (auto, only):
        matcher = compiler.new_matcher(grammar)
        ids = dev_tokenizer.encode('{"response": "It is sun')
        assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
        assert accepts(compiler, dev_tokenizer, grammar, '{"response": "A \\/ b \\u00e9"}')
        assert not accepts(compiler, dev_tokenizer, grammar, '{"response": "bad \\q"}')
    assert not accepts(
        compiler, dev_tokenizer, only, '{"tool_calls": [{"name": "ping", "arguments": {}}]}'
    )
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    as_json = generic_answer_grammar(schema)
    assert accepts(compiler, dev_tokenizer, as_json, '{"response": {"n": 3}}')
    matcher = compiler.new_matcher(as_json)
    ids = dev_tokenizer.encode('{"response": {"n": 3')
    assert matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_accepting()
