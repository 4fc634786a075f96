"""`/healthz` (liveness: the process is up and its engine loop runs; 503 once the loop has
stopped, so a supervisor restarts the process) and `/readyz` (database, engine, migrations; 503
`draining` from SIGTERM on, so a load balancer stops sending it requests: app/ops/drain.py; the
KV store's state is detail: a store that turned itself off costs recomputes, not readiness)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from kvchat.app.deps import StateDep
from kvchat.app.schemas.health import Draining, EngineStopped, Live, NotReady, Ready

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    response_model=Live,
    responses={503: {"model": EngineStopped, "description": "The engine loop has stopped."}},
)
async def healthz(state: StateDep) -> JSONResponse:
    if not state.runtime.is_running:
        return JSONResponse(
            {"status": "engine_stopped", "replica": state.replica_id}, status_code=503
        )
    return JSONResponse({"status": "ok"})


@router.get(
    "/readyz",
    response_model=Ready,
    responses={
        503: {
            "model": NotReady | Draining,
            "description": "Not ready (database, migrations or engine down), or draining.",
        }
    },
)
async def readyz(state: StateDep) -> JSONResponse:
    if state.drain.is_draining:
        state.drain.probed()
        return JSONResponse({"status": "draining", "replica": state.replica_id}, status_code=503)
    checks: dict[str, Any] = {}
    try:
        checks["database"] = await state.store.ping()
        current, head = await state.store.schema_status()
        checks["migrations"] = current == head
    except Exception as e:  # an unreachable database is an answer here, not an error
        checks["database"] = False
        checks["migrations"] = False
        checks["database_error"] = str(e).splitlines()[0][:200]
    checks["engine"] = state.runtime.is_running
    store = state.runtime.kv_store
    if store is not None:
        checks["kv_store"] = {
            "active": store.enabled,
            "reason": store.disabled_reason,
            "errors": store.num_errors,
        }
    coordination = await state.coord.healthy()
    checks["coordination"] = {"backend": state.coord.name, "healthy": coordination}
    ready = bool(checks["database"] and checks["migrations"] and checks["engine"])
    status = "ready" if ready and coordination else ("degraded" if ready else "not_ready")
    return JSONResponse(
        {"status": status, "replica": state.replica_id, "checks": checks},
        status_code=200 if ready else 503,
    )
