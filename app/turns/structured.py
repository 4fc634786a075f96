"""Structured output: from a request's `tool_choice` and `response_format` to the grammar its
reply must match (or None for a free reply), every schema compiled before anything is queued,
so what cannot be enforced is a 400 naming the field, never a silent unconstrained run.

- `tool_choice` "required": one call (with `parallel_tool_calls`, the default, one or more) of
  the offered tools, in the template's tool-call format, arguments valid for each schema
  (`strict`: every declared property present); a named function: calls of that function
  only; "auto": free, unless a JSON response_format is given too (then the reply is either
  calls or that JSON), or the format is the generic one (then the reply is either calls or a
  response: a string, or that JSON); "none": no tools.
- `response_format` json_object: a JSON object; json_schema: JSON valid for the schema
  (enforced whether or not `strict` is set). With tool_choice required or named the reply is
  calls, which response_format does not apply to.

A schema (response_format's or a tool's parameters) nests at most MAX_SCHEMA_DEPTH levels
(JSON containers: `{"type": "object", "properties": {"a": {...}}}` is two per object level),
checked before anything walks it recursively (jsonschema's own check, the grammar compiler).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from kvchat.app.errors import APIError, invalid_request
from kvchat.app.schemas.chat import NamedToolChoice, SamplingFields
from kvchat.app.schemas.json_input import json_depth
from kvchat.inference import (
    ANY_OBJECT,
    GENERIC,
    Grammar,
    GrammarCompiler,
    GrammarError,
    ToolSpec,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)

MAX_SCHEMA_DEPTH = 64


def output_grammar(
    fields: SamplingFields, tool_format: str | None, compiler: GrammarCompiler
) -> Grammar | None:
    """The grammar of the reply `fields` ask for (checked and compiled), None when free.
    Call after `offered_tools` has checked the tools and tool_choice."""
    content = content_schema(fields, compiler)
    tools = fields.tools or []
    choice = fields.tool_choice
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    generic = tool_format == GENERIC
    if not tools or choice == "none" or not (forced or content is not None or generic):
        return _content_grammar(fields, content)
    if tool_format is None:
        raise invalid_request(
            "this model's chat template writes tool calls in no format the server knows, so "
            "calls cannot be constrained (tool_choice 'required' or named, or tools together "
            "with a JSON response_format); use tool_choice 'auto' without response_format",
            "tool_choice",
            code="unsupported",
        )
    specs = []
    for i, tool in enumerate(tools):
        if isinstance(choice, NamedToolChoice) and tool.function.name != choice.function.name:
            continue
        parameters = tool.function.parameters
        if parameters is not None:
            _compile(compiler, json_schema_grammar(parameters), f"tools.{i}.function.parameters")
        specs.append(ToolSpec(tool.function.name, parameters, strict=bool(tool.function.strict)))
    grammar = tool_call_grammar(
        specs,
        tool_format,
        parallel=fields.parallel_tool_calls is not False,
        content_schema=None if forced else content,
        answer=generic and not forced,
    )
    _compile(compiler, grammar, "tools")
    return grammar


def content_schema(fields: SamplingFields, compiler: GrammarCompiler) -> dict[str, Any] | None:
    """The JSON schema a free-text reply must follow (None: no JSON response_format)."""
    response_format = fields.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return ANY_OBJECT
    assert response_format.json_schema is not None  # the request schema checks it
    schema = response_format.json_schema.schema_
    param = "response_format.json_schema.schema"
    if schema is None:
        raise invalid_request("response_format json_schema needs a schema", param)
    check_json_schema(schema, param)
    _compile(compiler, json_schema_grammar(schema), param)
    return schema


def _content_grammar(fields: SamplingFields, content: dict[str, Any] | None) -> Grammar | None:
    if content is None:
        return None
    assert fields.response_format is not None
    if fields.response_format.type == "json_object":
        return json_object_grammar()
    return json_schema_grammar(content)


def check_json_schema(schema: Mapping[str, Any], param: str) -> None:
    """A 400 naming `param` unless `schema` is a valid JSON schema (by its own draft), nested
    at most MAX_SCHEMA_DEPTH levels."""
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise APIError(
            400,
            f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep; flatten it "
            "(or use $defs and $ref)",
            param=param,
            code="schema_too_deep",
        )
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        raise invalid_request(f"{param} is not a valid JSON schema: {e.message}", param) from e


def _compile(compiler: GrammarCompiler, grammar: Grammar, param: str) -> None:
    try:
        compiler.compile(grammar)
    except GrammarError as e:
        raise APIError(
            400,
            f"{param} cannot be enforced by constrained decoding: {e}",
            param=param,
            code="unsupported_schema",
        ) from e
