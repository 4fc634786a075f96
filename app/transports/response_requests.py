"""A Responses API request as kvchat's shared pieces take it: the generation fields of the
turn service (`SamplingFields`), the errors of those shared checks renamed to this API's
fields (`tools.0.parameters`, `text.format.schema`, `input`), and the record kept with a
stored response (what retrieve answers with)."""

from __future__ import annotations

import re
from typing import Any

from kvchat.app.errors import APIError, invalid_request
from kvchat.app.schemas.chat import (
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    SamplingFields,
    Tool,
)
from kvchat.app.schemas.responses import ResponseCreate


def check_supported(body: ResponseCreate) -> None:
    def refuse(what: str, param: str) -> None:
        raise APIError(
            400, f"{what} is not supported by this server", param=param, code="unsupported"
        )

    if body.background:
        refuse("background", "background")
    if body.prompt is not None:
        refuse("prompt (a stored prompt template)", "prompt")
    if body.max_tool_calls is not None:
        refuse("max_tool_calls", "max_tool_calls")
    if body.wants_logprobs and body.tools and body.tool_choice != "none":
        raise APIError(
            400,
            "logprobs ('message.output_text.logprobs' in include) are not available with tools: "
            "a reply's text and calls are parsed out of what the model wrote, so the text is "
            "not its tokens; drop the tools, or set tool_choice to 'none'",
            param="include",
            code="unsupported",
        )
    if body.previous_response_id is not None and body.conversation is not None:
        raise invalid_request(
            "previous_response_id and conversation cannot both be given", "conversation"
        )


def sampling_fields(body: ResponseCreate) -> SamplingFields:
    """The request's generation fields as the turn service takes them."""
    response_format = None
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        response_format = ResponseFormat(
            type=text_format.type,
            json_schema=JSONSchemaFormat(
                name=text_format.name or "output",
                description=text_format.description,
                schema=text_format.schema_,
                strict=text_format.strict,
            )
            if text_format.type == "json_schema"
            else None,
        )
    choice = body.tool_choice
    return SamplingFields(
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.logit_bias,
        ignore_eos=body.ignore_eos,
        seed=body.seed,
        stop=body.stop,
        logprobs=body.wants_logprobs,
        top_logprobs=body.top_logprobs if body.wants_logprobs else None,
        tools=[
            Tool(
                type="function",
                function=FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                ),
            )
            for t in body.tools
        ]
        if body.tools
        else None,
        tool_choice=NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        if choice is not None and not isinstance(choice, str)
        else choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format,
        user=body.user,
    )


# The params kvchat's shared checks name, as the Responses API names them.
_RENAMES = [
    (re.compile(r"^messages(\..*)?$"), "input"),
    (re.compile(r"^(max_tokens|max_completion_tokens)$"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\.schema$"), "text.format.schema"),
    (re.compile(r"^response_format(\..*)?$"), "text.format"),
    (re.compile(r"^tools\.(\d+)\.function\.(.*)$"), r"tools.\1.\2"),
    (re.compile(r"^parent_id$"), "previous_response_id"),
]


def renamed(error: APIError) -> APIError:
    """`error` with its param as this API names the field."""
    param = error.param
    if param is None:
        return error
    for pattern, name in _RENAMES:
        if pattern.match(param):
            param = pattern.sub(name, param)
            break
    if param == error.param:
        return error
    return APIError(
        error.status,
        error.message.replace(f"'{error.param}'", f"'{param}'"),
        param=param,
        code=error.code,
        type=error.type,
        headers=error.headers,
    )


def response_record(body: ResponseCreate, model: str, input_start: str | None) -> dict[str, Any]:
    """What a stored response was asked with (messages.response)."""
    text_format = (
        body.text.format.model_dump(by_alias=True, exclude_none=True)
        if body.text is not None and body.text.format is not None
        else {"type": "text"}
    )
    choice = body.tool_choice
    return {
        "model": model,
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "conversation": body.conversation_id,
        "input_start": input_start,  # the first input message (None: the reply's parent)
        "metadata": body.metadata or {},
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": choice.model_dump()
        if choice is not None and not isinstance(choice, str)
        else (choice or "auto"),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {"format": text_format},
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_logprobs": body.top_logprobs,
        "max_output_tokens": body.max_output_tokens,
        "truncation": body.truncation or "disabled",
        "user": body.user,
        "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention,
    }
