"""Schema fuzzing of a started `kvchat serve` (schemathesis over its OpenAPI schema), on SQLite
and on Postgres + Redis: no request ever gets a 5xx; every 4xx body is OpenAI's error shape;
documented responses match the schema.

Checks, and why:
- `not_a_server_error`: the point of the exercise (nothing a client sends produces a 5xx).
- `openai_error_shape` (here): every 4xx is `{"error": {"message", "type", "param", "code"}}`.
- `content_type_conformance` and `response_schema_conformance`: a documented status's body
  has a documented media type and matches its model (they skip undocumented statuses).
- Not `status_code_conformance`: the schema lists 200 and FastAPI's generic 422, while the
  API answers OpenAI's statuses by design (400 for validation, never 422; 401, 404, 409, 413,
  429, 503); it would flag every one of them, and `openai_error_shape` checks those instead.
- Not `negative_data_rejection` / `positive_data_acceptance`: requests ignore unknown fields
  as OpenAI's do, and a well-formed request about another owner's or a missing conversation
  is rightly a 404; neither check would tell a defect from the API's contract.

Bounds: the coverage phase (a fixed, deterministic set of boundary and type-mutation cases per
operation) and `KVCHAT_ATTACK_EXAMPLES` fuzzed examples per operation and generation mode
(positive and negative; default 10), derandomized with seed 0, without shrinking; a request
unanswered after 120 s fails as a hang.

What is restricted, only to keep the model's work small: the server's `KVCHAT_DEFAULT_MAX_TOKENS`
is 16; a generated `max_tokens` / `max_completion_tokens` that the model would spend (an
integer in 17..2**31-1) is sent as 16, and a request with neither gets `max_tokens: 16` (a chat
completion without one runs to the end of the context). Every other value (0, negatives,
floats, strings, 2**31 and past) is sent as generated.

What is pointed at real things, in two requests of three (by the request's number in the run,
so the run stays deterministic; the third goes as generated): ids of conversations and chats
name real ones (DELETE a fresh one of its own), the model the served one; and rules across
fields that the schema cannot state are met (content or parent_id on a turn, tool_call_id on a
tool message, content on a system or user message, logprobs with top_logprobs, stream with
stream_options, Idempotency-Key and X-Session-Id of the allowed lengths), so that generated
requests reach the turn pipeline and the model rather than stopping at validation.

The tests are built at collection time from the app's own schema; the started server is
checked to serve that very schema.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
)
from schemathesis.config import SchemathesisConfig

from kvchat.app.turns.prompting import SESSION_ID_PATTERN
from kvchat_testing.attack_servers import (
    BACKENDS,
    REQUESTS_PROPERTY,
    assert_openai_error,
    started_server,
)
from kvchat_testing.service import Server

EXAMPLES = int(os.environ.get("KVCHAT_ATTACK_EXAMPLES", "10"))
REPLY_CAP = 16  # tokens the model generates at most per reply here
CONVERSATIONS = 4  # real conversations the generated ids are mapped to


def app_schema() -> dict[str, Any]:
    """The OpenAPI schema the app serves at /openapi.json (the started server's is checked to
    be this one: the tests are built at collection time, before any server runs)."""
    from kvchat.app.main import create_app
    from kvchat.app.settings import Settings

    return create_app(Settings()).openapi()


CONFIG = SchemathesisConfig.from_dict(
    {
        "seed": 0,
        "generation": {
            "mode": "all",
            "max-examples": EXAMPLES,
            "deterministic": True,
            "database": "none",
            "no-shrink": True,
        },
        "phases": {"stateful": {"enabled": False}},
        "request-timeout": 120,
        # Show the values sent (max_tokens too: its name has "token" in it); the key is the
        # test server's own.
        "output": {"sanitization": {"enabled": False}},
    }
)
schema = schemathesis.openapi.from_dict(app_schema(), config=CONFIG)


@schemathesis.check
def openai_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx body is OpenAI's error shape."""
    if 400 <= response.status_code < 500:
        assert_openai_error(
            response.json(), f"{case.method} {case.formatted_path} -> {response.status_code}"
        )
    return None


CHECKS = [
    not_a_server_error,
    openai_error_shape,
    content_type_conformance,
    response_schema_conformance,
]


@dataclass
class Target:
    """A started server and the real things generated requests are pointed at."""

    backend: str
    server: Server
    model: str
    conversations: list[str]
    sent: int = 0
    made: list[str] = field(default_factory=list)

    def new_conversation(self, tag: str) -> str:
        r = httpx.post(
            f"{self.server.url}/v1/conversations",
            headers=self.server.headers(),
            json={"title": tag},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        self.made.append(r.json()["id"])
        return str(r.json()["id"])


@pytest.fixture(scope="module", params=BACKENDS)
def target(
    request: pytest.FixtureRequest, dev_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    backend = request.param
    env = {"KVCHAT_DEFAULT_MAX_TOKENS": str(REPLY_CAP)}
    with started_server(dev_model, tmp_path_factory.mktemp("data"), backend, env) as server:
        served = httpx.get(f"{server.url}/openapi.json", timeout=60).json()
        assert served == app_schema(), "the server serves another schema than the tests use"
        model = httpx.get(f"{server.url}/v1/models", headers=server.headers(), timeout=60).json()[
            "data"
        ][0]["id"]
        target = Target(backend, server, model, [])
        for i in range(CONVERSATIONS):  # each with a first turn: something to regenerate
            conv = target.new_conversation(f"fuzz {i}")
            r = httpx.post(
                f"{server.url}/v1/conversations/{conv}/messages",
                headers=server.headers(),
                timeout=120,
                json={"content": f"conversation {i} of the schema fuzzing"},
            )
            assert r.status_code == 200, r.text
            target.conversations.append(conv)
        yield target
        print(f"\nschemathesis on {backend}: {target.sent} requests")


def cap_reply(body: Any) -> None:
    """A generated reply budget the model would spend (17..2**31-1 tokens) becomes REPLY_CAP,
    and so does none (a chat completion without one runs to the end of the context); every
    other value is sent as generated."""
    if not isinstance(body, dict):
        return
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = REPLY_CAP
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and REPLY_CAP < value < 2**31:
            body[name] = REPLY_CAP


def retarget(case: Any, target: Target) -> None:
    """Point the generated request at real things, and past the rules across fields that the
    schema cannot state, except every third request (by its number in the run, so the run
    stays deterministic), which is sent as generated."""
    if target.sent % 3 == 0:
        return
    params = case.path_parameters
    for name in ("conversation_id", "chat_id"):
        if isinstance(params.get(name), str):
            if case.method.upper() == "DELETE":  # delete one of its own, not the shared ones
                params[name] = target.new_conversation("to delete")
            else:
                params[name] = target.conversations[target.sent % CONVERSATIONS]
    if isinstance(params.get("model_id"), str):
        params["model_id"] = target.model
    headers = case.headers or {}
    if not 1 <= len(str(headers.get("Idempotency-Key", "key"))) <= 255:
        del headers["Idempotency-Key"]
    if not SESSION_ID_PATTERN.match(str(headers.get("X-Session-Id", "session"))):
        del headers["X-Session-Id"]
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = target.model
    if (
        case.operation.path.endswith("/messages")
        and body.get("content") is None
        and body.get("parent_id") is None
    ):
        body["content"] = f"fuzzed turn {target.sent}"
    for message in body.get("messages") or () if isinstance(body.get("messages"), list) else ():
        if not isinstance(message, dict):
            continue
        if (
            message.get("role") in ("system", "developer", "user")
            and message.get("content") is None
        ):
            message["content"] = f"fuzzed message {target.sent}"
        if message.get("role") == "tool" and not message.get("tool_call_id"):
            message["tool_call_id"] = "call_fuzzed"
    if body.get("logprobs") in (None, False) and "top_logprobs" in body:
        body["logprobs"] = True
    if body.get("stream") in (None, False) and "stream_options" in body:
        body["stream"] = True


@pytest.fixture
def counted(target: Target, record_property: Any) -> Iterator[None]:
    """Record how many requests this operation's examples sent (read by the suite's summary)."""
    before = target.sent
    yield
    record_property(REQUESTS_PROPERTY, (target.backend, target.sent - before))


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_errors_in_openai_shape(case: Any, target: Target, counted: None) -> None:
    retarget(case, target)
    cap_reply(case.body)
    server = target.server
    response = case.call(base_url=server.url, headers=server.headers())
    target.sent += 1
    case.validate_response(response, checks=CHECKS, headers=server.headers())
