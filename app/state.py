"""AppState: what the app holds between requests (built by the lifespan), and the
dependencies routes declare to reach it (`Annotated` aliases, as the FastAPI template does)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Header, Request

from kvchat.app.coord import Coordinator, ProcessIdentity
from kvchat.app.errors import APIError, invalid_api_key
from kvchat.app.ops.drain import Drain, persist_pinned_sessions
from kvchat.app.runtime import Runtime
from kvchat.app.settings import Settings
from kvchat.app.store import KeyRecord, Store
from kvchat.app.turns.prompting import GeneratedIds

if TYPE_CHECKING:
    from kvchat.app.turns.service import TurnService


@dataclass
class SessionDefaults:
    """Budgets and history policy of sessions that set none of their own (from the settings;
    operators change them at run time with PUT /v1/admin/defaults)."""

    max_context_tokens: int | None = None
    max_kv_tokens: int | None = None
    history_policy: str = "drop"
    high_watermark: float = 0.8
    low_watermark: float = 0.5
    max_tool_result_tokens: int | None = None
    max_summary_tokens: int = 512

    @classmethod
    def of(cls, settings: Settings) -> SessionDefaults:
        return cls(**{f: getattr(settings, f) for f in cls.__dataclass_fields__})


@dataclass
class AppState:
    settings: Settings
    store: Store
    runtime: Runtime
    coord: Coordinator
    identity: ProcessIdentity
    generated: GeneratedIds = field(default_factory=GeneratedIds)
    # Every turn of this process: start, stop, resume, delete (set by the lifespan).
    turns: TurnService = field(init=False)
    # Work that outlives a request (summaries, turns whose client left): kept referenced,
    # awaited at shutdown.
    background: set[asyncio.Task[None]] = field(default_factory=set)
    started_at: int = field(default_factory=lambda: int(time.time()))
    defaults: SessionDefaults = field(default_factory=SessionDefaults)
    websockets: dict[str, int] = field(default_factory=dict)  # key id -> open sockets
    leases: Any = None  # LeaseKeeper: this process's session ownership leases
    shutting_down: bool = False  # set on SIGTERM: replies are left to the engine's drain
    drain: Drain = field(init=False)  # SIGTERM to exit: not ready, grace, exit hooks

    def __post_init__(self) -> None:
        self.defaults = SessionDefaults.of(self.settings)
        self.drain = Drain(
            self.settings.drain_grace,
            self.settings.drain_probes,
            exit_hooks=[persist_pinned_sessions],
        )

    @property
    def replica_id(self) -> str:
        return self.identity.replica_id

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
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
        raise invalid_api_key()
    return record


async def admin_key(key: Annotated[KeyRecord, Depends(current_key)]) -> KeyRecord:
    if not key.is_admin:
        raise APIError(403, "This route needs an admin key.", code="admin_required")
    return key


CurrentKey = Annotated[KeyRecord, Depends(current_key)]
AdminKey = Annotated[KeyRecord, Depends(admin_key)]
