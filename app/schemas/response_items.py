"""Items, the unit of OpenAI's Responses and Conversations APIs: the input items kvchat
takes (typed one by one by `parse_items`, so a bad one is answered with the path OpenAI uses,
`input.2.call_id`, not pydantic's union tags), the items it answers with, and the
Conversations API's bodies."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvchat.app.errors import APIError, invalid_request
from kvchat.app.schemas.chat import NAME_PATTERN

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
            raise APIError(
                400,
                f"input items of type {kind!r} are not supported by this "
                f"server (it takes {', '.join(ITEM_TYPES)})",
                param=f"{where}.type",
                code="unsupported",
            )
        try:
            items.append(model.model_validate(value))  # type: ignore[arg-type]
        except ValidationError as e:
            # The deepest error says most (`content.0.type`, not the union's `content.str`);
            # a union's member names are not part of the path.
            error = max(e.errors(), key=lambda err: len(err.get("loc", ())))
            loc = ".".join(
                str(p)
                for p in error.get("loc", ())
                if not (isinstance(p, str) and (p == "str" or "[" in p))
            )
            field = f"{where}.{loc}" if loc else where
            message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
            raise invalid_request(f"Invalid value for '{field}': {message}", field) from None
    return items


# -- items as answered ---------------------------------------------------------------------------


class TopLogprob(BaseModel):
    """One of the most likely tokens at a step (`bytes`: the token's UTF-8 bytes, which
    may hold part of a character)."""

    token: str
    bytes: list[int]
    logprob: float


class OutputLogprob(TopLogprob):
    """A token of the text, with the most likely ones at its step (top_logprobs of them)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputLogprob] = Field(
        default_factory=list,
        description="With include ['message.output_text.logprobs']: the text's tokens.",
    )


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


# -- the Conversations API's bodies -------------------------------------------------------------


class ConversationUpdate(BaseModel):
    """`POST /v1/conversations/{id}` (OpenAI's update; kvchat's is PATCH)."""

    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, Any]


class ItemsCreate(BaseModel):
    """`POST /v1/conversations/{id}/items`."""

    model_config = ConfigDict(extra="ignore")

    items: list[Any] = Field(min_length=1, max_length=20)
