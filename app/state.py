"""AppState: what the app holds between requests (built by the lifespan), and the
dependencies routes declare to reach it (`Annotated` aliases, as the FastAPI template does)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Header, Request

from .coord import Coordinator
from .errors import APIError
from .prompting import GeneratedIds
from .runtime import Runtime
from .settings import Settings
from .store import KeyRecord, Store


@dataclass
class AppState:
    settings: Settings
    store: Store
    runtime: Runtime
    coord: Coordinator
    generated: GeneratedIds = field(default_factory=GeneratedIds)
    # The turn running in each conversation (this process), for stop and resume.
    turns: dict[str, Any] = field(default_factory=dict)
    # Work that outlives a request (summaries, turns whose client left): kept referenced,
    # awaited at shutdown.
    background: set[asyncio.Task[None]] = field(default_factory=set)
    started_at: int = field(default_factory=lambda: int(time.time()))

    def spawn(self, coro: object) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task


def get_state(request: Request) -> AppState:
    return request.app.state.kvchat  # type: ignore[no-any-return]


StateDep = Annotated[AppState, Depends(get_state)]


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def current_key(
    state: StateDep,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> KeyRecord:
    token = bearer_token(authorization)
    record = await state.store.authenticate(token) if token else None
    if record is None:
        raise APIError(
            401,
            "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'; "
            "`kvchat keys create` makes one.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return record


async def admin_key(key: Annotated[KeyRecord, Depends(current_key)]) -> KeyRecord:
    if not key.is_admin:
        raise APIError(403, "This route needs an admin key.", code="admin_required")
    return key


CurrentKey = Annotated[KeyRecord, Depends(current_key)]
AdminKey = Annotated[KeyRecord, Depends(admin_key)]
