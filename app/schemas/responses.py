"""OpenAI's Responses API: the request and the response object, in the shapes the official
SDKs parse (`openai.types.responses.*`).

What kvchat takes of a request is typed here; anything the SDKs may send that kvchat does not
do (`background`, `prompt`, `max_tool_calls`, tools other than functions) is a 400 naming the
field. Fields the SDKs send empty (`reasoning: null`) and OpenAI's newer options are ignored
(`extra="ignore"`), so a newer SDK still talks to this server. `include` takes OpenAI's
values; only `message.output_text.logprobs` adds something here (the others name outputs of
tools kvchat does not have). Input items and the items answered are in
app/schemas/response_items.py.

`prompt_cache_key` and `prompt_cache_retention` are OpenAI's (app/turns/cache_hints.py).

kvchat's extensions, as on Chat Completions: `seed`, `stop`, `top_k`, `min_p`,
`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`, `ignore_eos`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from kvchat.app.ranges import INT32_MAX, INT64_MAX, INT64_MIN
from kvchat.app.schemas.chat import NAME_PATTERN, PromptCacheHints, token_id_keys
from kvchat.app.schemas.response_items import FunctionCall, OutputMessage

MAX_METADATA_PAIRS = 16
OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"
# OpenAI's `include` values (openai.types.responses.ResponseIncludable).
Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

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


# Input items one request may carry (a longer history goes by previous_response_id or
# conversation): each is stored as a message before the turn starts.
MAX_INPUT_ITEMS = 4096


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ConversationRef(BaseModel):
    id: str = Field(min_length=1, max_length=64)


class ResponseCreate(PromptCacheHints):
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
    max_output_tokens: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=512)
    include: list[Includable] | None = Field(
        None, description="'message.output_text.logprobs': the text's tokens and their logprobs."
    )
    top_logprobs: StrictInt | None = Field(
        None,
        ge=0,
        le=20,
        description="With include ['message.output_text.logprobs']: the most likely tokens "
        "at each step (none without it, as OpenAI's).",
    )
    # kvchat's extensions (as on Chat Completions)
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    top_k: StrictInt | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    # OpenAI's options kvchat does not do: refused when set
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return token_id_keys(value)

    @field_validator("input", mode="before")
    @classmethod
    def _string_or_items(cls, value: Any) -> Any:
        if isinstance(value, str) and not value:
            raise ValueError("input must not be empty")
        if isinstance(value, list) and not value:
            raise ValueError("input must have at least one item")
        if isinstance(value, list) and len(value) > MAX_INPUT_ITEMS:
            raise ValueError(
                f"input has {len(value)} items; at most {MAX_INPUT_ITEMS} are allowed per "
                "request (continue a longer history with previous_response_id or conversation)"
            )
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
        raise ValueError('conversation must be a conversation id or {"id": ...}')

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
        raise ValueError(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "name": ...}'
        )

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
    def wants_logprobs(self) -> bool:
        return OUTPUT_TEXT_LOGPROBS in (self.include or ())

    @property
    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation


# -- the response ---------------------------------------------------------------------------------


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
    output_text: str = Field(description="The output's text parts joined (as the SDKs compute it).")
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    conversation: ConversationRef | None = None
    store: bool
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: ResponseTextOut
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
