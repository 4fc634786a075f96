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
- llama3_json: `{"name": "f", "parameters": {...}}`, several joined by `"; "`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
    tool_calls | tool_calls_or_json."""

    source: str
    kind: str


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: Mapping[str, Any] | None  # a JSON schema of type object; None: no parameters


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
    arguments = "arguments" if fmt == HERMES else "parameters"
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            arguments: dict(tool.parameters) if tool.parameters is not None else NO_PARAMETERS,
        },
        "required": ["name", arguments],
        "additionalProperties": False,
    }


def tool_call_grammar(
    tools: Sequence[ToolSpec],
    fmt: str,
    *,
    parallel: bool,
    content_schema: Mapping[str, Any] | None = None,
) -> Grammar:
    """One call (or with `parallel` one or more) of the given tools in format `fmt`. With
    `content_schema`, the output may instead be JSON valid for it (tool_choice auto together
    with a JSON response_format)."""
    if fmt not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
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
    lines.append("call_json: " + " | ".join(f"tool_{i}" for i in range(len(tools))))
    lines += [f"tool_{i}: {json_rule(call_schema(t, fmt))}" for i, t in enumerate(tools)]
    kind = "tool_calls" if content_schema is None else "tool_calls_or_json"
    return Grammar("\n".join(lines) + "\n", kind)
