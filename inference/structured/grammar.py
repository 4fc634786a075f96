"""Grammar: what a constrained request's output must match, as llguidance grammar text (Lark
syntax; a JSON schema is embedded with `%json`). Built from the API's structured-output
requests: a JSON schema (`response_format`), any JSON object, or tool calls in the chat
template's own format (`tool_choice` required or named).

JSON is written the way `json.dumps` writes it (`", "` and `": "`, no other whitespace): the
layout models see in their templates, and a bound on what a constrained decoder may spend on
whitespace. Object properties come in schema order (llguidance's rule).

Tool calls follow `kvchat.inference.text.tool_calls`' formats, so the parser reads back exactly
the calls the grammar allowed:

- hermes: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, several joined by
  a newline;
- llama3_json: `{"name": "f", "parameters": {...}}`, several joined by `"; "`;
- generic: `{"tool_calls": [{"name": "f", "arguments": {...}}, ...]}`, or where an answer is
  allowed `{"response": "..."}` (the JSON a response_format asks for in place of the string),
  whose string the model may end without closing it, as it would end free text.

A call's arguments follow its function's `parameters`, with objects that do not say
`additionalProperties` closed (no argument the function does not declare: what llama.cpp's and
xgrammar's schema compilers do, and what no client wants); a `strict` function's arguments
also carry every declared property, as OpenAI's strict mode guarantees.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..text.generic_tool_calls import CALLS_KEY, GENERIC, RESPONSE_KEY
from ..text.tool_calls import HERMES, LLAMA3_JSON, TOOL_CALL_FORMATS

# llguidance's JSON options (its "x-guidance" key): json.dumps' separators, no free whitespace.
JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# What a function without `parameters` takes (OpenAI: an empty parameter list).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Grammar:
    """An output constraint. `source` is llguidance grammar text; equal sources compile once
    (see GrammarCompiler). `kind` says what it was built for: json_schema | json_object |
    tool_calls | tool_calls_or_json | tool_calls_or_answer | answer."""

    source: str
    kind: str


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: Mapping[str, Any] | None  # a JSON schema of type object; None: no parameters
    strict: bool = False  # every declared property present (OpenAI's strict mode)


def json_rule(schema: Mapping[str, Any]) -> str:
    """A Lark rule body that matches JSON valid for `schema`, in JSON_LAYOUT."""
    body = {k: v for k, v in schema.items() if k != "x-guidance"}
    return "%json " + json.dumps({**body, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)


def json_schema_grammar(schema: Mapping[str, Any]) -> Grammar:
    return Grammar(f"start: {json_rule(schema)}\n", "json_schema")


def json_object_grammar() -> Grammar:
    return Grammar(f"start: {json_rule(ANY_OBJECT)}\n", "json_object")


def call_schema(tool: ToolSpec, fmt: str) -> dict[str, Any]:
    """The JSON schema of one call object of `tool` in format `fmt`."""
    arguments = "parameters" if fmt == LLAMA3_JSON else "arguments"
    parameters = NO_PARAMETERS
    if tool.parameters is not None:
        parameters = closed_schema(tool.parameters, require_all=tool.strict)
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, arguments: parameters},
        "required": ["name", arguments],
        "additionalProperties": False,
    }


# Where a schema holds other schemas: one (`items`), a list (`anyOf`), or a map (`properties`).
_ONE_SCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_schema(schema: Mapping[str, Any], *, require_all: bool = False) -> dict[str, Any]:
    """`schema` with every object schema that declares `properties` and does not say
    `additionalProperties` (or `unevaluatedProperties`) closed to those properties, and with
    `require_all` each such object's properties all required. Members of `allOf` are left
    as they are (closing one would refuse its siblings' properties), and so is an object
    whose properties come from elsewhere too (`allOf`, `$ref`, `patternProperties`)."""
    out: dict[str, Any] = dict(schema)
    for key in _ONE_SCHEMA:
        if isinstance(out.get(key), Mapping):
            out[key] = closed_schema(out[key], require_all=require_all)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [
                closed_schema(s, require_all=require_all) if isinstance(s, Mapping) else s
                for s in out[key]
            ]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {
                name: closed_schema(s, require_all=require_all) if isinstance(s, Mapping) else s
                for name, s in out[key].items()
            }
    properties = out.get("properties")
    merged_from_elsewhere = any(k in out for k in ("allOf", "$ref", "patternProperties"))
    if isinstance(properties, Mapping) and not merged_from_elsewhere:
        if "additionalProperties" not in out and "unevaluatedProperties" not in out:
            out["additionalProperties"] = False
        if require_all:
            out["required"] = list(properties)
    return out


def tool_call_grammar(
    tools: Sequence[ToolSpec],
    fmt: str,
    *,
    parallel: bool,
    content_schema: Mapping[str, Any] | None = None,
    answer: bool = False,
) -> Grammar:
    """One call (or with `parallel` one or more) of the given tools in format `fmt`. With
    `content_schema`, the output may instead be JSON valid for it (tool_choice auto together
    with a JSON response_format). In the generic format `answer` allows a response instead of
    calls (tool_choice auto): a string, or JSON valid for `content_schema`."""
    if fmt not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    if fmt == GENERIC:
        return _generic_grammar(
            tools, parallel=parallel, content_schema=content_schema, answer=answer
        )
    lines = []
    if content_schema is not None:
        lines.append("start: calls | content")
        lines.append(f"content: {json_rule(content_schema)}")
    else:
        lines.append("start: calls")
    joiner = json.dumps("\n" if fmt == HERMES else "; ")
    lines.append(f"calls: call ({joiner} call)*" if parallel else "calls: call")
    if fmt == HERMES:
        lines.append(r'call: "<tool_call>\n" call_json "\n</tool_call>"')
    else:
        assert fmt == LLAMA3_JSON
        lines.append("call: call_json")
    lines += _call_rules(tools, fmt)
    kind = "tool_calls" if content_schema is None else "tool_calls_or_json"
    return Grammar("\n".join(lines) + "\n", kind)


def _call_rules(tools: Sequence[ToolSpec], fmt: str) -> list[str]:
    """`call_json`: one call object of any of the tools."""
    return [
        "call_json: " + " | ".join(f"tool_{i}" for i in range(len(tools))),
        *(f"tool_{i}: {json_rule(call_schema(t, fmt))}" for i, t in enumerate(tools)),
    ]


# The characters of a JSON string (RFC 8259), as a Lark regular expression (`/` escaped).
_JSON_STRING_CHARS = r'(?:[^"\\\x00-\x1f]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4})*'


def _generic_grammar(
    tools: Sequence[ToolSpec],
    *,
    parallel: bool,
    content_schema: Mapping[str, Any] | None,
    answer: bool,
) -> Grammar:
    opening = json.dumps("{" + json.dumps(CALLS_KEY) + ": [")
    lines = ["start: calls | response" if answer else "start: calls"]
    lines.append(
        f'calls: {opening} call_json (", " call_json)* "]}}"'
        if parallel
        else f'calls: {opening} call_json "]}}"'
    )
    if answer:
        lines += _response_rules(content_schema)
    lines += _call_rules(tools, GENERIC)
    kind = "tool_calls_or_answer" if answer else "tool_calls"
    return Grammar("\n".join(lines) + "\n", kind)


def generic_answer_grammar(content_schema: Mapping[str, Any] | None = None) -> Grammar:
    """The generic format's answer alone, `{"response": ...}` (no call): what a reply that
    would only repeat the calls its conversation's last turn made gives instead."""
    return Grammar(
        "\n".join(["start: response", *_response_rules(content_schema)]) + "\n", "answer"
    )


def _response_rules(content_schema: Mapping[str, Any] | None) -> list[str]:
    """`response`: a string, or JSON valid for `content_schema`."""
    if content_schema is not None:
        opening = json.dumps("{" + json.dumps(RESPONSE_KEY) + ": ")
        return [f'response: {opening} value "}}"', f"value: {json_rule(content_schema)}"]
    # The model may end an answer where it would end free text: the string's close is
    # optional, so the end of sequence is allowed anywhere in it (the stored reply is closed
    # after it; app/turns/generation.py).
    opening = json.dumps("{" + json.dumps(RESPONSE_KEY) + ': "')
    return [f'response: {opening} ANSWER "\\"}}"?', f"ANSWER: /{_JSON_STRING_CHARS}/"]
