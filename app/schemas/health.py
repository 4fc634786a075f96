"""Bodies of `/healthz` and `/readyz` (app/api/health.py): 200 when live or ready, 503 (with
the replica's id) when not."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import SkipJsonSchema


class Live(BaseModel):
    """`GET /healthz` 200: the engine loop runs."""

    status: Literal["ok"]


class EngineStopped(BaseModel):
    """`GET /healthz` 503: the engine loop has stopped (a supervisor restarts the process)."""

    status: Literal["engine_stopped"]
    replica: str


class KVStoreCheck(BaseModel):
    active: bool
    reason: str | None
    errors: int


class CoordinationCheck(BaseModel):
    backend: str
    healthy: bool


class ReadinessChecks(BaseModel):
    database: bool
    migrations: bool
    # Present only when the database could not be reached (the error's first line).
    database_error: str | SkipJsonSchema[None] = Field(
        None, description="Only when the database could not be reached: why."
    )
    engine: bool
    # Present only when the engine has a KV store.
    kv_store: KVStoreCheck | SkipJsonSchema[None] = Field(
        None, description="Only when a KV store is configured."
    )
    coordination: CoordinationCheck


class Ready(BaseModel):
    """`GET /readyz` 200: database, migrations and engine are up (`degraded`: coordination
    is not)."""

    status: Literal["ready", "degraded"]
    replica: str
    checks: ReadinessChecks


class NotReady(BaseModel):
    """`GET /readyz` 503: the database, the migrations or the engine is not up."""

    status: Literal["not_ready"]
    replica: str
    checks: ReadinessChecks


class Draining(BaseModel):
    """`GET /readyz` 503 from SIGTERM on: stop sending requests here."""

    status: Literal["draining"]
    replica: str
