"""The OpenAPI document: every operation documents its success answer (a typed JSON model, a
non-JSON media type with its schema: for an event stream, the schema of each event, as FastAPI
documents its own SSE routes; or a 204 without a body); and the JSON the routes answer is what
their models say and what the routes return: every key the route's code returns, in its order
and with its JSON type, none filtered out by the response model and no null added for a key
the route leaves out."""

from __future__ import annotations

import dataclasses
import json
import time
import typing
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI, Response
from fastapi.encoders import jsonable_encoder
from jsonschema import Draft202012Validator

from kvchat.app.api import admin as admin_routes
from kvchat.app.api import models as model_routes
from kvchat_testing.app_service import Service

JSON = "application/json"
EVENT_STREAM = "text/event-stream"
# Move between two reads of the same session: its idle time, and the retention policy's view
# of it, which is a function of that time.
VOLATILE = {"idle_seconds", "next_turn_s", "value"}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    return app.openapi()


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    """The document `/openapi.json` serves (building it needs no engine and no database)."""
    from kvchat.app.main import create_app
    from kvchat.app.settings import Settings

    return build_openapi(create_app(Settings()))


def untyped(schema: dict[str, Any]) -> str | None:
    """Why a JSON body's schema states no shape (None: it does). A `$ref`, a union of typed
    schemas, or a `type` (an object with its properties, an array of typed items)."""
    if not schema:
        return "no schema ({})"
    if "$ref" in schema:
        return None
    for combiner in ("anyOf", "oneOf", "allOf"):
        if combiner in schema:
            return next(filter(None, map(untyped, schema[combiner])), None)
    kind = schema.get("type")
    if kind is None:
        return f"no type: {schema}"
    if kind == "object" and not schema.get("properties"):
        extra = schema.get("additionalProperties")
        if not isinstance(extra, dict) or untyped(extra):
            return "an object of unknown keys (dict[str, Any])"
    if kind == "array":
        return untyped(schema.get("items") or {})
    return None


def undocumented(document: dict[str, Any]) -> list[str]:
    """Each operation whose success answer is not documented, and why."""
    found = []
    for path, item in document.get("paths", {}).items():
        for method, operation in item.items():
            name = f"{method.upper()} {path}"
            success = {
                code: response
                for code, response in operation.get("responses", {}).items()
                if str(code).upper().startswith("2")
            }
            if not success:
                found.append(f"{name}: no 2xx response")
            for code, response in success.items():
                content = response.get("content") or {}
                if str(code) == "204":
                    if content:
                        found.append(f"{name} 204: has content {sorted(content)}")
                    continue
                if not content:
                    found.append(f"{name} {code}: no content")
                for media, body in content.items():
                    if media == JSON:
                        why = untyped(body.get("schema") or {})
                    elif media == EVENT_STREAM:  # the schema of each event (as FastAPI's SSE)
                        why = untyped(body.get("itemSchema") or {}) and "no typed itemSchema"
                    else:
                        why = None if body.get("schema") else "no schema"
                    if why:
                        found.append(f"{name} {code} {media}: {why}")
    return found


def test_every_operation_documents_its_success_answer(openapi: dict[str, Any]) -> None:
    assert openapi["paths"], "no operations"
    offenders = undocumented(openapi)
    assert not offenders, "operations without a documented 2xx answer:\n" + "\n".join(offenders)


def test_the_check_names_each_kind_of_undocumented_answer() -> None:
    app = FastAPI()

    @app.get("/plain-dict")
    async def plain_dict() -> dict[str, Any]:
        return {}

    @app.get("/no-model")
    async def no_model():  # no annotation: no model
        return {}

    @app.get("/response", response_class=Response)
    async def response() -> Response:
        return Response()

    @app.get("/event-stream", responses={200: {"content": {"text/event-stream": {}}}})
    async def event_stream() -> Response:
        return Response()

    @app.get("/fine", status_code=204)
    async def fine() -> None:
        return None

    assert undocumented(build_openapi(app)) == [
        "GET /plain-dict 200 application/json: an object of unknown keys (dict[str, Any])",
        "GET /no-model 200 application/json: no schema ({})",
        "GET /response 200: no content",
        "GET /event-stream 200 application/json: no schema ({})",
        "GET /event-stream 200 text/event-stream: no typed itemSchema",
    ]


def test_fixed_values_are_the_engines() -> None:
    """The Literals and field lists of the admin models follow what the engine reports."""
    from kvchat.app.schemas.admin import (
        EffectiveSettings,
        HistoryCounters,
        LinearPlanOut,
        SessionBudgetOut,
        SessionClass,
        SessionStateName,
        StatelessEffectiveSettings,
        Tier,
    )
    from kvchat.app.session_settings import BUDGET_FIELDS
    from kvchat.app.store import OVERRIDE_FIELDS
    from kvchat.inference.model.linear_plan import PLAIN, PREPACKED
    from kvchat.memory import HistoryStats, SessionState
    from kvchat.memory.config import SessionBudget
    from kvchat.memory.retention import CLASSES, TIERS

    assert set(typing.get_args(SessionStateName)) == {s.value for s in SessionState}
    assert typing.get_args(Tier) == TIERS and typing.get_args(SessionClass) == CLASSES
    assert set(StatelessEffectiveSettings.model_fields) == set(BUDGET_FIELDS)
    assert list(HistoryCounters.model_fields) == [f.name for f in dataclasses.fields(HistoryStats)]
    assert list(SessionBudgetOut.model_fields) == [
        f.name for f in dataclasses.fields(SessionBudget)
    ]
    for settings in (EffectiveSettings,):
        assert tuple(settings.model_fields) == OVERRIDE_FIELDS, settings
    weights = LinearPlanOut.model_fields["weights"].annotation
    assert set(typing.get_args(weights)) == {PLAIN, PREPACKED}


# -- the answers the routes give ------------------------------------------------------------------


def shape(value: Any) -> Any:
    """Keys (in order) and JSON types, not values."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def without(value: Any, keys: set[str]) -> Any:
    if isinstance(value, dict):
        return {k: without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without(v, keys) for v in value]
    return value


class Answers:
    """A started app's answers over HTTP, what its routes' functions return (before their
    response models see it), and the OpenAPI schema each answer is checked against."""

    def __init__(self, service: Service, admin: str) -> None:
        self.service = service
        self.admin = admin
        self.app: FastAPI = service.client.app  # type: ignore[assignment]
        self.document = self.app.openapi()

    def returned(self, endpoint: Callable[..., Any], **arguments: Any) -> Any:
        """What a route's function returns, as the JSON a route without a response model
        answered (FastAPI's jsonable_encoder)."""
        return jsonable_encoder(self.service.client.portal.call(lambda: endpoint(**arguments)))

    def answered(
        self, method: str, template: str, url: str, key: str | None = None, **kw: Any
    ) -> Any:
        """The JSON body of a 200 to `method url`, checked against the schema the document
        gives the operation `template`."""
        headers = self.service.headers(key or self.admin)
        r = self.service.client.request(method, url, headers=headers, **kw)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith(JSON), r.headers["content-type"]
        body = r.json()
        responses = self.document["paths"][template][method.lower()]["responses"]
        schema = responses["200"]["content"][JSON]["schema"]
        validator = Draft202012Validator({**schema, "components": self.document["components"]})
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]
        assert not errors, f"{method} {url} does not match its schema: {errors}"
        return body


@pytest.fixture(scope="module")
def answers(service: Service) -> Answers:
    state = service.state
    _, admin = service.client.portal.call(lambda: state.store.create_key("openapi-ops", admin=True))
    return Answers(service, admin)


def settled_conversation(answers: Answers, title: str) -> str:
    """A conversation with one turn whose KV the engine has pinned."""
    service = answers.service
    r = service.post("/v1/conversations", {"title": title}, key=answers.admin)
    assert r.status_code == 200, r.text
    conv: str = r.json()["id"]
    turn = {"content": "Say hi.", "max_tokens": 4, "temperature": 0}
    r = service.post(f"/v1/conversations/{conv}/messages", turn, key=answers.admin)
    assert r.status_code == 200, r.text
    for _ in range(200):
        view = service.get(f"/v1/admin/sessions/{conv}", key=answers.admin).json()
        if view["engine"] and view["engine"]["state"] != "active":
            return conv
        time.sleep(0.02)
    raise AssertionError("the session stayed active")


def test_admin_answers_are_what_the_operators_return(answers: Answers) -> None:
    state = answers.service.state
    conv = settled_conversation(answers, "admin answers")
    engine = answers.answered("GET", "/v1/admin/engine", "/v1/admin/engine")
    assert engine == answers.returned(admin_routes.engine, key=None, state=state)
    defaults = answers.answered("GET", "/v1/admin/defaults", "/v1/admin/defaults")
    assert defaults == answers.returned(admin_routes.get_defaults, key=None, state=state)
    put = answers.answered("PUT", "/v1/admin/defaults", "/v1/admin/defaults", json={})
    assert put == defaults

    template = "/v1/admin/sessions/{session_id}"
    session = answers.answered("GET", template, f"/v1/admin/sessions/{conv}")
    returned = answers.returned(admin_routes.get_session, session_id=conv, key=None, state=state)
    assert shape(session) == shape(returned)
    assert without(session, VOLATILE) == without(returned, VOLATILE)
    assert session["kind"] == "conversation" and session["engine"] is not None
    put = answers.answered("PUT", template, f"/v1/admin/sessions/{conv}", json={})
    assert without(put, VOLATILE) == without(session, VOLATILE)

    memory = answers.answered("GET", "/v1/admin/memory", "/v1/admin/memory")
    assert shape(memory) == shape(answers.returned(admin_routes.memory, key=None, state=state))
    assert conv in [s["session_id"] for s in memory["sessions"]]
    listed = answers.answered("GET", "/v1/admin/sessions", "/v1/admin/sessions")
    returned = answers.returned(admin_routes.list_sessions, key=None, state=state)
    assert shape(listed) == shape(returned)
    assert without(listed, VOLATILE) == without(returned, VOLATILE)
    (mine,) = [s for s in listed["data"] if s["session_id"] == conv]
    assert (mine["tier"], mine["class"], mine["held"]) == ("device", "person", False)

    template = "/v1/admin/sessions/{session_id}/evict"
    offloaded = answers.returned(
        admin_routes.evict, session_id=conv, key=None, state=state, offload=True
    )
    dropped = answers.answered("POST", template, f"/v1/admin/sessions/{conv}/evict?offload=false")
    assert shape(dropped) == shape(offloaded)
    assert (offloaded["state"], dropped["before"]) == ("offloaded", "offloaded")
    # Dropped from the host pool: nowhere, or only in the KV store on disk once its blocks
    # were written there (the retention policy's bottom tiers).
    assert dropped["state"] in ("empty", "stored")


def test_public_answers_are_what_the_routes_return(answers: Answers) -> None:
    service, state = answers.service, answers.service.state
    live = answers.answered("GET", "/healthz", "/healthz")
    assert live == {"status": "ok"}
    ready = answers.answered("GET", "/readyz", "/readyz")
    assert ready["status"] in ("ready", "degraded") and "database_error" not in ready["checks"]

    models = answers.answered("GET", "/v1/models", "/v1/models", key=service.key)
    assert models == answers.returned(model_routes.list_models, key=None, state=state)
    model = models["data"][0]["id"]
    one = answers.answered("GET", "/v1/models/{model_id}", f"/v1/models/{model}", service.key)
    assert one == models["data"][0]

    conv = settled_conversation(answers, "public answers")
    items = service.get(f"/v1/conversations/{conv}/items", key=answers.admin).json()["data"]
    for item in items:
        got = answers.answered(
            "GET",
            "/v1/conversations/{conversation_id}/items/{item_id}",
            f"/v1/conversations/{conv}/items/{item['id']}",
        )
        assert got == item
    stopped = answers.answered(
        "POST", "/v1/conversations/{conversation_id}/stop", f"/v1/conversations/{conv}/stop"
    )
    assert stopped == {"id": conv, "stopped": False}
    stopped = answers.answered("POST", "/v1/ui/chat/{chat_id}/stop", f"/v1/ui/chat/{conv}/stop")
    assert stopped == {"id": conv, "stopped": False}
    deleted = answers.answered(
        "DELETE", "/v1/conversations/{conversation_id}", f"/v1/conversations/{conv}"
    )
    assert deleted == {"id": conv, "object": "conversation.deleted", "deleted": True}


def test_non_json_answers_have_their_documented_media_types(answers: Answers) -> None:
    client = answers.service.client
    document = answers.document
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    nothing = client.get(f"/v1/ui/chat/{'c' * 12}/stream", headers=answers.service.headers())
    assert nothing.status_code == 204 and not nothing.content
    stream = document["paths"]["/v1/ui/chat/{chat_id}/stream"]["get"]["responses"]
    assert set(stream["200"]["content"]) == {EVENT_STREAM}
    assert "content" not in stream["204"]


def sse_events(text: str) -> list[dict[str, str]]:
    """The events of an SSE body, as a client parses them (fields of a blank-line block)."""
    events = []
    for block in text.split("\n\n"):
        event: dict[str, str] = {}
        for line in block.splitlines():
            if line and not line.startswith(":"):
                field, _, value = line.partition(":")
                event[field] = value.removeprefix(" ")
        if event:
            events.append(event)
    return events


def test_streamed_events_match_their_documented_schema(answers: Answers) -> None:
    service = answers.service
    conv = service.post("/v1/conversations", {"title": "streamed"}, key=answers.admin).json()["id"]
    template = "/v1/conversations/{conversation_id}/messages"
    turn = {"content": "Say hi.", "max_tokens": 4, "temperature": 0, "stream": True}
    r = service.post(f"/v1/conversations/{conv}/messages", turn, key=answers.admin)
    assert r.status_code == 200 and r.headers["content-type"].startswith(EVENT_STREAM), r.text
    content = answers.document["paths"][template]["post"]["responses"]["200"]["content"]
    assert set(content) == {JSON, EVENT_STREAM}
    validator = Draft202012Validator(content[EVENT_STREAM]["itemSchema"])
    events = sse_events(r.text)
    types = [json.loads(e["data"])["type"] for e in events]
    assert types[0] == "start" and types[-1] == "done", types
    for event in events:
        errors = [e.message for e in validator.iter_errors(event)]
        assert not errors, f"{event} does not match the documented event: {errors}"
