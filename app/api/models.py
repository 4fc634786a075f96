"""`GET /v1/models`: the one model this server serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kvchat.app.deps import CurrentKey, StateDep
from kvchat.app.errors import APIError
from kvchat.app.schemas.models import ModelList, ModelObject

router = APIRouter(prefix="/v1", tags=["models"])


def _model(state: StateDep) -> dict[str, Any]:
    return {
        "id": state.runtime.model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "kvchat",
        "max_model_len": state.runtime.max_model_len,
    }


@router.get("/models", response_model=ModelList)
async def list_models(key: CurrentKey, state: StateDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model(state)]}


@router.get("/models/{model_id}", response_model=ModelObject)
async def get_model(model_id: str, key: CurrentKey, state: StateDep) -> dict[str, Any]:
    if model_id != state.runtime.model_name:
        raise APIError(
            404, f"The model '{model_id}' does not exist", param="model", code="model_not_found"
        )
    return _model(state)
