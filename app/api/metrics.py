"""`GET /metrics`: Prometheus exposition (no key: scrapers reach it on the private network;
put it behind your proxy's auth if the port is public)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvchat.app.deps import StateDep

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text exposition format."}},
)
async def metrics(state: StateDep) -> Response:
    return Response(state.runtime.metrics.render(), media_type=CONTENT_TYPE_LATEST)
