"""OpenAI's Responses API (and the items of its Conversations API): the request, the response
object, its output and input items, in the shapes the official SDKs parse
(`openai.types.responses.*`, `openai.types.conversations.*`).

What kvchat takes of a request is typed here; anything the SDKs may send that kvchat does not
do (`background`, `prompt`, `max_tool_calls`, logprobs, tools other than functions) is a 400
naming the field. Fields the SDKs send empty (`include: []`, `reasoning: null`) and OpenAI's
newer options are ignored (`extra="ignore"`), so a newer SDK still talks to this server.
Input items are typed one by one by `parse_items` (app/transports/responses.py calls it), so a
bad item is answered with the path OpenAI uses, `input.2.call_id`, not pydantic's union tags.

kvchat's extensions, as on Chat Completions: `seed`, `stop`, `top_k`, `ignore_eos`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from app.errors import APIError, invalid_request
from app.schemas.chat import NAME_PATTERN
from app.schemas.ranges import INT32_MAX, INT64_MAX, INT64_MIN

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

# -- input items --------------------------------------------------------------------------------


class TextContent(BaseModel):
    """A text part: `input_text` (what users, systems and developers say), `output_text` (an
    assistant's, as the SDKs send a previous output back) or `refusal` (its `refusal` text)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _has_text(self) -> TextContent:
        if self.type == "refusal" and self.refusal is None:
            raise ValueError("a refusal part needs refusal")
        if self.type != "refusal" and self.text is None:
            raise ValueError(f"an {self.type} part needs text")
        return self

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class MessageItem(BaseModel):
    """`{"role", "content"}` (EasyInputMessage) or a message item with `type: "message"`;
    a previous output's `id` and `status` are taken and left alone."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]
    id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _string_or_parts(cls, value: Any) -> Any:
        if not isinstance(value, str | list):
            raise ValueError("content must be a string or a list of text parts")
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.value for part in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made (an agent sends it back with the call's output)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(BaseModel):
    """What a call returned: text, or input_text parts."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextContent]
    id: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _string_or_parts(cls, value: Any) -> Any:
        if not isinstance(value, str | list):
            raise ValueError("output must be a string or a list of input_text parts")
        return value

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.value for part in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_TYPES: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


def parse_items(raw: list[Any], param: str) -> list[InputItem]:
    """Input items typed one by one; a 400 naming the bad field (`input.1.call_id`) when one
    is not an item kvchat takes."""
    items: list[InputItem] = []
    for i, value in enumerate(raw):
        where = f"{param}.{i}"
        if not isinstance(value, dict):
            raise invalid_request(f"{where} must be an object (an input item)", where)
        kind = value.get("type", "message")
        model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise APIError(400, f"input items of type {kind!r} are not supported by this "
                           f"server (it takes {', '.join(ITEM_TYPES)})", param=f"{where}.type",
                           code="unsupported")
        try:
            items.append(model.model_validate(value))  # type: ignore[arg-type]
        except ValidationError as e:
            # The deepest error says most (`content.0.type`, not the union's `content.str`);
            # a union's member names are not part of the path.
            error = max(e.errors(), key=lambda err: len(err.get("loc", ())))
            loc = ".".join(str(p) for p in error.get("loc", ())
                           if not (isinstance(p, str) and (p == "str" or "[" in p)))
            field = f"{where}.{loc}" if loc else where
            message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
            raise invalid_request(f"Invalid value for '{field}': {message}", field) from None
    return items


# -- the request ----------------------------------------------------------------------------------


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema object.")
    strict: bool | None = None


class ToolChoiceFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: free text, any JSON object, or JSON valid for `schema` (enforced by
    constrained decoding whether `strict` is set or not)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs name and schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ConversationRef(BaseModel):
    id: str = Field(min_length=1, max_length=64)


class ResponseCreate(BaseModel):
    """`POST /v1/responses`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=64)
    conversation: str | ConversationRef | None = None
    store: bool | None = True
    stream: bool | None = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=512)
    # kvchat's extensions (as on Chat Completions)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    # OpenAI's options kvchat does not do: refused when set
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _string_or_items(cls, value: Any) -> Any:
        if isinstance(value, str) and not value:
            raise ValueError("input must not be empty")
        if isinstance(value, list) and not value:
            raise ValueError("input must have at least one item")
        if not isinstance(value, str | list):
            raise ValueError("input must be a string or a list of input items")
        return value

    @field_validator("conversation", mode="before")
    @classmethod
    def _id_or_object(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and 1 <= len(value) <= 64):
            return value
        if isinstance(value, dict):
            try:
                return ConversationRef.model_validate(value)
            except ValidationError:
                pass
        raise ValueError("conversation must be a conversation id or {\"id\": ...}")

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _option_or_function(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict):
            try:
                return ToolChoiceFunction.model_validate(value)
            except ValidationError:
                pass
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{\"type\": \"function\", \"name\": ...}")

    @field_validator("stop", mode="before")
    @classmethod
    def _at_most_four(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return value

    @field_validator("metadata")
    @classmethod
    def _openai_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs are allowed")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters")
            if len(item) > MAX_METADATA_VALUE:
                raise ValueError(f"values are at most {MAX_METADATA_VALUE} characters")
        return value

    @property
    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation


# -- the response ---------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputText(BaseModel):
    type: Literal["input_text"] = "input_text"
    text: str


class InputMessage(BaseModel):
    """A user, system or developer message as an item (developer messages are stored as
    system messages and read back as such)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer"]
    status: Literal["completed"] = "completed"
    content: list[InputText]


class FunctionCallOutput(BaseModel):
    id: str
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str
    status: Literal["completed"] = "completed"


Item = InputMessage | OutputMessage | FunctionCall | FunctionCallOutput


class ItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int  # prefilled this turn: written to the session's KV


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseTextOut(BaseModel):
    format: dict[str, Any]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["completed", "failed", "in_progress", "cancelled", "incomplete"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage | FunctionCall]
    output_text: str = Field(description="The output's text parts joined (as the SDKs "
                             "compute it).")
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    conversation: ConversationRef | None = None
    store: bool
    temperature: float | None = None
    top_p: float | None = None
    text: ResponseTextOut
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# -- the Conversations API's bodies -------------------------------------------------------------


class ConversationUpdate(BaseModel):
    """`POST /v1/conversations/{id}` (OpenAI's update; kvchat's is PATCH)."""

    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, Any]


class ItemsCreate(BaseModel):
    """`POST /v1/conversations/{id}/items`."""

    model_config = ConfigDict(extra="ignore")

    items: list[Any] = Field(min_length=1, max_length=20)
