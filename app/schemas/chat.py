"""OpenAI Chat Completions: the request, the response, the streamed chunk.

Integers have the ranges of app/ranges.py: token counts up to INT32_MAX, `seed`
int64, OpenAI's own bounds where it gives them (`n`, `top_logprobs`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvchat.app.ranges import INT32_MAX, INT64_MAX, INT64_MIN, wrap_int64

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_N = 16


class TextPart(BaseModel):
    type: Literal["text"]
    text: str
    cache_control: Any = Field(
        None,
        description='Anthropic\'s `{"type": "ephemeral", "ttl": "5m" | "1h"}`, as LiteLLM and '
        "OpenRouter send it: a retention hint for the request's session (ttl 5m when absent).",
    )


class CacheControl(BaseModel):
    """A content part's `cache_control`. Checked by app.turns.cache_hints, with its path
    (`messages.0.content.1.cache_control.ttl`), not as TextPart's field type: pydantic would
    name a bad one by the union branch it failed in (`messages.0.content.str`)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


# OpenAI's limit on a prompt_cache_key (a longer one is a 400 there too).
MAX_PROMPT_CACHE_KEY = 64


class PromptCacheHints(BaseModel):
    """OpenAI's prompt-cache fields, on Chat Completions and Responses (app/turns/cache_hints.py
    says what they do here)."""

    prompt_cache_key: str | None = Field(
        None,
        max_length=MAX_PROMPT_CACHE_KEY,
        description="Names the session the request runs in when it has no X-Session-Id "
        "(scoped to the key's owner), so requests sharing a prefix reuse its KV; a fleet "
        "routes by it. Empty: none.",
    )
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None,
        description="How long the session's KV is held after the turn: in_memory 10 minutes, "
        "24h a day (in the host pool and the KV store on disk).",
    )


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="A JSON object, as text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Annotated[str, Field(pattern=NAME_PATTERN)] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str | None:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema object.")
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False


def token_id_keys(bias: dict[str, float] | None) -> dict[str, float] | None:
    """logit_bias's keys are token ids written as decimal strings (OpenAI's shape)."""
    for key in bias or {}:
        if not key.isascii() or not key.isdigit() or len(key) > 10:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
    return bias


class SamplingFields(BaseModel):
    """The generation fields shared by chat completions and the conversations API."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(
        None, ge=-1, le=INT32_MAX, description="vLLM's extension; 0 or -1 is off."
    )
    min_p: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="vLLM's extension: drop tokens below min_p x the top token's probability.",
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0.0,
        le=2.0,
        description="vLLM's extension: logits of tokens in the prompt or output so far are "
        "divided (positive) or multiplied (negative) by it; 1 is off.",
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        description="Token id (as a string) -> bias in [-100, 100] added to its logit.",
    )
    ignore_eos: bool = Field(False, description="vLLM's extension: go on past end-of-sequence.")
    seed: StrictInt | None = Field(
        None,
        ge=INT64_MIN,
        le=INT64_MAX,
        description="int64. With n > 1, choice i is sampled with seed + i (wrapping within int64).",
    )
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return token_id_keys(value)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("logprobs must be true when top_logprobs is set")
        return value

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def reply_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def choice_seed(self, choice: int) -> int | None:
        """The seed of the `choice`-th reply (0 for the first): seed + choice wrapped within
        int64, so every accepted seed gives n seeds the generators take."""
        return None if self.seed is None else wrap_int64(self.seed + choice)


class ChatCompletionRequest(SamplingFields, PromptCacheHints):
    model: str
    messages: list[Message] = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)


# -- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    refusal: None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"] | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallFunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta


class ChoiceDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChoiceDelta
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"] | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
