"""`GET /v1/models` and `GET /v1/models/{id}` (app/api/models.py): OpenAI's model object, with
the context length kvchat serves."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelObject(BaseModel):
    id: str
    object: Literal["model"]
    created: int = Field(description="When this process started (Unix seconds).")
    owned_by: Literal["kvchat"]
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelObject]
