"""What the app holds between requests, and the FastAPI dependencies routes declare to reach
it (`Annotated` aliases, as the FastAPI template does).

AppState is built once, by the composition root (app/main.py's lifespan), from collaborators
built there; nothing below this module imports it: the turn service, the limits and the
coordination back end are given what they use."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Header, Request

from kvchat.app.coord import Coordinator, ProcessIdentity
from kvchat.app.coord.leases import LeaseKeeper
from kvchat.app.errors import APIError, invalid_api_key
from kvchat.app.ops.drain import Drain
from kvchat.app.ops.limits import Limits
from kvchat.app.ops.tasks import BackgroundTasks
from kvchat.app.runtime import Runtime
from kvchat.app.session_settings import SessionSettings
from kvchat.app.settings import Settings
from kvchat.app.store import KeyRecord, Store
from kvchat.app.turns.prompting import GeneratedIds
from kvchat.app.turns.service import TurnService


@dataclass
class AppState:
    settings: Settings
    store: Store
    runtime: Runtime
    coord: Coordinator
    identity: ProcessIdentity
    tasks: BackgroundTasks  # work that outlives a request, awaited at shutdown
    limits: Limits
    leases: LeaseKeeper  # this process's session ownership leases
    turns: TurnService  # every turn of this process: start, stop, resume, delete
    drain: Drain  # SIGTERM to exit: not ready, grace, exit hooks
    generated: GeneratedIds = field(default_factory=GeneratedIds)
    started_at: int = field(default_factory=lambda: int(time.time()))  # the model's `created`
    websockets: dict[str, int] = field(default_factory=dict)  # key id -> open sockets
    # Conversation id -> its open sockets: its session is present while it has any.
    conversation_sockets: dict[str, int] = field(default_factory=dict)
    shutting_down: bool = False  # set on SIGTERM: replies are left to the engine's drain

    @property
    def replica_id(self) -> str:
        return self.identity.replica_id

    @property
    def defaults(self) -> SessionSettings:
        """The settings of sessions that set none of their own (PUT /v1/admin/defaults
        changes them, from the next turn on)."""
        return self.turns.planner.defaults

    @defaults.setter
    def defaults(self, value: SessionSettings) -> None:
        self.turns.planner.defaults = value


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
        raise invalid_api_key()
    return record


async def admin_key(key: Annotated[KeyRecord, Depends(current_key)]) -> KeyRecord:
    if not key.is_admin:
        raise APIError(403, "This route needs an admin key.", code="admin_required")
    return key


CurrentKey = Annotated[KeyRecord, Depends(current_key)]
AdminKey = Annotated[KeyRecord, Depends(admin_key)]


async def rate_limited_key(request: Request, key: CurrentKey, state: StateDep) -> KeyRecord:
    """The caller's key, once this request is counted against its limits (429 when over);
    the x-ratelimit headers go on the response."""
    request.state.extra_headers = await state.limits.admit(key)
    return key


RateLimitedKey = Annotated[KeyRecord, Depends(rate_limited_key)]
