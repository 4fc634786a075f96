"""The app factory and its lifespan, which owns the database, the engine thread and the
coordination back end: started in that order, stopped in reverse (in-flight turns finish or
are stopped and stored as interrupted before the engine thread goes)."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvchat.app.api import (
    admin,
    chat_completions,
    conversation_items,
    conversations,
    health,
    metrics,
    models,
    pages,
    responses,
    tokenize,
    ui_chat,
    ws,
)
from kvchat.app.api.request_checks import RequestChecks
from kvchat.app.coord import ProcessIdentity, make_coordinator
from kvchat.app.coord.leases import LeaseKeeper, default_replica_id
from kvchat.app.deps import AppState
from kvchat.app.errors import install_error_handlers
from kvchat.app.ops import log_redaction, stacks
from kvchat.app.ops.drain import Drain, bounded_close, persist_pinned_sessions
from kvchat.app.ops.limits import Limits
from kvchat.app.ops.tasks import BackgroundTasks
from kvchat.app.runtime import Runtime
from kvchat.app.settings import Settings
from kvchat.app.store import Store
from kvchat.app.turns.service import TurnService

log = logging.getLogger("kvchat")

API_DESCRIPTION = """
A multi-turn chat backend that remembers: each conversation's KV cache stays pinned between
turns, so the next turn prefills only what is new.

- `POST /v1/chat/completions` is OpenAI's Chat Completions (stateless; `X-Session-Id` pins a
  session's KV between calls).
- `/v1/conversations` keeps the history on the server, as a tree of messages (edit, regenerate,
  branch switching), planned under a token budget every turn.
- `POST /v1/responses` is OpenAI's Responses API on those conversations: `previous_response_id`
  and `conversation` continue a stored branch and its pinned KV; `/v1/conversations/{id}/items`
  is OpenAI's Conversations API on the same tables.

Every route but the health checks takes `Authorization: Bearer <key>`.
"""


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    store = await Store.open(settings.database)
    runtime = await asyncio.to_thread(Runtime, settings)
    runtime.start()
    coord = make_coordinator(settings.redis_url, settings.redis_prefix)
    await coord.start()
    identity = ProcessIdentity(settings.replica_id or default_replica_id(settings.port))
    runtime.metrics.name_replica(identity.replica_id)
    tasks = BackgroundTasks()
    limits = Limits(settings, coord, runtime.metrics, lambda: runtime.num_waiting, tasks)
    leases = LeaseKeeper(
        coord,
        runtime.engine_client,
        identity.replica_id,
        settings.lease_ttl,
        on_move=runtime.metrics.session_moves.inc,
    )
    turns = TurnService(
        settings=settings,
        defaults=settings.session_defaults(),
        store=store,
        runtime=runtime,
        coord=coord,
        identity=identity,
        limits=limits,
        tasks=tasks,
        leases=leases,
    )
    drain = Drain(
        settings.drain_grace,
        settings.drain_probes,
        exit_hooks=[
            functools.partial(
                persist_pinned_sessions, runtime.engine_client, settings.drain_timeout
            )
        ],
    )
    state = AppState(
        settings=settings,
        store=store,
        runtime=runtime,
        coord=coord,
        identity=identity,
        tasks=tasks,
        limits=limits,
        leases=leases,
        turns=turns,
        drain=drain,
    )
    interrupted = await turns.recover()
    if interrupted:
        log.warning("%d replies were cut off by a restart; stored as interrupted", len(interrupted))
    leases.start()
    app.state.kvchat = state
    if settings.is_embedded_database and await store.count_keys() == 0:
        _, plaintext = await store.create_key("default", admin=True)
        announce_key(plaintext)
    # What start-up made (the model, modules, caches) lives as long as the process: out of
    # the collector's generations, so a full collection does not walk it and stall the loop.
    gc.collect()
    gc.freeze()
    log.info("serving %s", runtime.model_name)
    try:
        yield
    finally:
        # In-flight turns: the engine drains them (or aborts them as "shutdown"), then each
        # turn stores its reply before the store closes.
        await runtime.shutdown(settings.drain_timeout)
        await tasks.wait(settings.drain_timeout)
        # The engine thread has stopped; its KV pool and pinned sessions are still here.
        await drain.before_exit()
        await bounded_close("releasing session leases", leases.close())
        await bounded_close("closing the coordinator", coord.close())
        runtime.close()
        identity.retire()
        await bounded_close("closing the database", store.close())


def announce_key(plaintext: str) -> None:
    """The key made on first start, printed once (it is stored only as a hash)."""
    print(f"kvchat: created an admin API key (shown once, keep it): {plaintext}", flush=True)


REPLICA_HEADER = b"x-kvchat-replica"


def _replica_of(scope: Scope) -> bytes | None:
    """This process's replica id (KVCHAT_REPLICA_ID) once the lifespan has started."""
    state = getattr(scope["app"].state, "kvchat", None) if "app" in scope else None
    return state.replica_id.encode() if state is not None else None


class RequestIdMiddleware:
    """An `x-request-id` on every response, as OpenAI's API sends, `x-kvchat-replica` (the
    replica that served it; on a WebSocket's handshake too) and the headers a route left in
    `request.state.extra_headers`. Plain ASGI (not BaseHTTPMiddleware), so a client's
    disconnect still reaches the routes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self.app(scope, receive, self._with_replica(scope, send))
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = f"req_{uuid.uuid4().hex}".encode()
        replica = _replica_of(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                if b"x-request-id" not in names:
                    headers.append((b"x-request-id", request_id))
                if replica is not None:
                    headers.append((REPLICA_HEADER, replica))
                # Headers a route left in request.state (rate-limit counters).
                extra = scope.get("state", {}).get("extra_headers", {})
                headers += [
                    (k.encode(), v.encode()) for k, v in extra.items() if k.encode() not in names
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)

    @staticmethod
    def _with_replica(scope: Scope, send: Send) -> Send:
        replica = _replica_of(scope)

        async def send_accept(message: Message) -> None:
            if message["type"] == "websocket.accept" and replica is not None:
                headers = [*message.get("headers", []), (REPLICA_HEADER, replica)]
                message = {**message, "headers": headers}
            await send(message)

        return send_accept


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(
        title="kvchat",
        version="0.1.0",
        description=API_DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.settings = settings
    install_error_handlers(app)
    # Innermost of the middlewares: its refusals still get CORS headers and a request id.
    app.add_middleware(RequestChecks, max_request_bytes=settings.max_request_bytes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "retry-after", "x-kvchat-replica"],
        )

    app.add_middleware(RequestIdMiddleware)

    for module in (
        health,
        models,
        chat_completions,
        responses,
        conversations,
        conversation_items,
        tokenize,
        admin,
        metrics,
        ws,
        ui_chat,
        pages,
    ):
        app.include_router(module.router)
    app.mount("/static", pages.static_files(), name="static")
    return app


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def serve(settings: Settings) -> None:
    """Run the app under uvicorn until SIGINT/SIGTERM. With a `drain_grace`, the first signal
    starts a drain (app/ops/drain.py): /readyz answers 503 `draining` while the server goes on
    serving until its load balancer has seen that; a second signal stops it at once. Then
    open connections get `drain_timeout` seconds; replies still being generated are stopped
    by the engine's drain and stored as interrupted (not as cancelled by a client), and the
    exit hooks run."""
    import uvicorn

    app = create_app(settings)

    class Server(uvicorn.Server):
        drain_requested = False

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # A signal handler: it only sets flags, which on_tick (every 0.1 s) acts on.
            state = getattr(app.state, "kvchat", None)
            if state is not None and state.drain.is_graceful and not self.drain_requested:
                self.drain_requested = True
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            state = getattr(app.state, "kvchat", None)
            if state is not None and self.drain_requested:
                state.drain.begin()
                if state.drain.is_grace_over():
                    self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets: list[Any] | None = None) -> None:
            state = getattr(app.state, "kvchat", None)
            if state is not None:
                state.shutting_down = True
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=max(1, round(settings.drain_timeout)),
        ws_per_message_deflate=settings.ws_compression,
        # Frames past this are refused by the protocol (close 1009) before
        # they are buffered; smaller ones over ws_max_frame_bytes get an
        # error frame from the app.
        ws_max_size=settings.ws_protocol_max_bytes,
    )
    log_redaction.install()  # after uvicorn set up its loggers: no key in a logged URL
    # `kill -USR1 <pid>` writes every thread's stack and every asyncio task's await chain to
    # stderr (the log): what a replica that does not exit, or a stuck turn, is waiting on. The
    # fleet sends it before a SIGKILL.
    stacks.install(signal.SIGUSR1)
    Server(config).run()
