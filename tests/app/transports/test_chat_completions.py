"""POST /v1/chat/completions in process, on SQLite and on Postgres."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from kvchat_testing.app_service import Service
from kvchat_testing.sampling_knobs import check_sampling_knobs

GREEDY = {"temperature": 0, "max_tokens": 12}


def chat(
    service: Service,
    messages: list[dict[str, Any]],
    key: str | None = None,
    headers: dict[str, str] | None = None,
    **fields: Any,
) -> Any:
    body = {"model": service.model, "messages": messages, **fields}
    return service.post("/v1/chat/completions", body, key=key, headers=headers or {})


def sse_events(response: Any) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]


def test_a_completion_has_openai_shape_and_exact_usage(service: Service) -> None:
    r = chat(service, USER, **GREEDY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == service.model
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    tokenized = service.post("/v1/tokenize", {"messages": USER}).json()
    assert usage["prompt_tokens"] == tokenized["count"]
    assert 1 <= usage["completion_tokens"] <= GREEDY["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]
    assert r.headers["x-request-id"]


def test_streamed_text_equals_the_non_streamed_text(service: Service) -> None:
    whole = chat(service, USER, **GREEDY).json()
    with service.client.stream(
        "POST",
        "/v1/chat/completions",
        headers=service.headers(),
        json={
            "model": service.model,
            "messages": USER,
            "stream": True,
            "stream_options": {"include_usage": True},
            **GREEDY,
        },
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishing) == 1
    assert finishing[0]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    # include_usage: the last chunk has no choices and the usage; the others have usage null.
    assert (
        chunks[-1]["choices"] == []
        and chunks[-1]["usage"]["completion_tokens"] == (whole["usage"]["completion_tokens"])
    )
    assert all(c["usage"] is None for c in chunks[:-1])


def test_without_include_usage_no_usage_chunk(service: Service) -> None:
    with service.client.stream(
        "POST",
        "/v1/chat/completions",
        headers=service.headers(),
        json={"model": service.model, "messages": USER, "stream": True, **GREEDY},
    ) as r:
        events = sse_events(r)
    assert all(e == "[DONE]" or e["choices"] for e in events)


def test_n_seeds_and_logprobs(service: Service) -> None:
    body = chat(
        service, USER, n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=True, top_logprobs=3
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    again = chat(service, USER, n=3, temperature=1.0, seed=7, max_tokens=6).json()
    assert [c["message"]["content"] for c in body["choices"]] == [
        c["message"]["content"] for c in again["choices"]
    ]
    for choice in body["choices"]:
        entries = choice["logprobs"]["content"]
        assert len(entries) >= 1
        for entry in entries:
            assert entry["logprob"] <= 0.0 and len(entry["top_logprobs"]) == 3
            assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
            assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    assert body["usage"]["completion_tokens"] == sum(
        len(c["logprobs"]["content"]) for c in body["choices"]
    )


def pinned_tokens(service: Service, session: str, at_least: int, timeout: float = 60.0) -> int:
    """The tokens the engine pins for `session`, once they are `at_least` (or the timeout,
    a safety net, passed): the engine pins a turn's last sampled token in a step after the
    reply is out (inference/engine/scheduler.py, FINISHING)."""
    runtime = service.state.runtime
    deadline = time.monotonic() + timeout
    while True:
        info = service.client.portal.call(runtime.engine_client.session_info, session)
        pinned = 0 if info is None else info.num_tokens
        if pinned >= at_least or time.monotonic() > deadline:
            return pinned
        time.sleep(0.01)


def test_session_header_reuses_the_whole_history(service: Service) -> None:
    """An agent resending its history with X-Session-Id: each turn reuses at least the
    previous turn's prompt and completion (the replies are spliced back by their ids). The
    engine pins a turn's last token one step after the reply; a next turn that arrives
    before that step computes the token itself (scheduler._plan_finishing), so each turn
    here is sent once the session holds the whole previous turn, whatever the machine's
    speed."""
    from kvchat.app.turns.prompting import session_key

    session = session_key("alice", "agent-1")
    assert session is not None
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    previous = None
    for turn in range(5):
        messages.append({"role": "user", "content": f"Question number {turn}: what now?"})
        if previous is not None:
            whole = previous["prompt_tokens"] + previous["completion_tokens"]
            assert pinned_tokens(service, session, whole) == whole
        body = chat(
            service, messages, headers={"X-Session-Id": "agent-1"}, temperature=0, max_tokens=8
        ).json()
        usage = body["usage"]
        if previous is not None:
            assert usage["prompt_tokens_details"]["cached_tokens"] >= whole
        previous = usage
        messages.append(body["choices"][0]["message"])


def test_two_owners_never_share_kv(service: Service) -> None:
    prompt = [{"role": "user", "content": "An identical prompt, long enough to fill blocks. " * 6}]
    chat(service, prompt, **GREEDY)
    mine = chat(service, prompt, **GREEDY).json()["usage"]["prompt_tokens_details"]
    theirs = chat(service, prompt, key=service.other_key, **GREEDY).json()
    assert mine["cached_tokens"] > 0  # the same owner hits the prefix cache
    assert theirs["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_tools_and_a_tool_result_in_the_history(service: Service) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    r = chat(service, messages, tools=tools, **GREEDY)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    with_tools = service.post("/v1/tokenize", {"messages": messages, "tools": tools}).json()
    without = service.post("/v1/tokenize", {"messages": messages}).json()
    assert with_tools["count"] > without["count"]  # the tools are in the prompt


BAD = [
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", None),
    (
        {"messages": [{"role": "tool", "content": "x", "tool_call_id": "nope"}]},
        "messages.0.tool_call_id",
        None,
    ),
    ({"max_tokens": -1}, "max_tokens", None),
    ({"max_tokens": 10**9}, "messages", "context_length_exceeded"),
    ({"temperature": 99}, "temperature", None),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs", None),
    ({"stream_options": {"include_usage": True}}, "stream_options", None),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"model": "gpt-9"}, "model", "model_not_found"),
    (
        {"messages": [{"role": "user", "content": "x " * 5000}]},
        "messages",
        "context_length_exceeded",
    ),
    ({"tool_choice": "required"}, "tool_choice", None),
    (
        {
            "tool_choice": "required",
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"type": "array", "uniqueItems": True}},
                        },
                    },
                }
            ],
        },
        "tools.0.function.parameters",
        "unsupported_schema",
    ),
    (
        {
            "tool_choice": {"type": "function", "function": {"name": "g"}},
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "tool_choice",
        None,
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": "banana"}}},
                    },
                }
            ]
        },
        "tools.0.function.parameters",
        None,
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        "tools.0.function.name",
        None,
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "nope", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "r"},
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "messages.1.tool_calls.0.function.name",
        None,
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "banana"}},
            }
        },
        "response_format.json_schema.schema",
        None,
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "s",
                    "schema": {"type": "object", "properties": {"a": {"not": {}}}},
                },
            }
        },
        "response_format.json_schema.schema",
        "unsupported_schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
        "response_format.json_schema.schema",
        None,
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format", None),
    ({"response_format": {"type": "yaml"}}, "response_format.type", None),
    (
        {"response_format": {"type": "json_object"}, "stream_options": {"include_usage": True}},
        "stream_options",
        None,
    ),
]


@pytest.mark.parametrize(
    ("change", "param", "code"), BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)]
)
def test_bad_input_gets_a_typed_error_and_the_server_goes_on(
    service: Service, change: dict[str, Any], param: str, code: str | None
) -> None:
    body = {"model": service.model, "messages": USER, **change}
    r = service.post("/v1/chat/completions", body)
    error = r.json()["error"]
    expected_status = 404 if code == "model_not_found" else 400
    assert r.status_code == expected_status, r.text
    assert error["param"] == param
    assert error["type"] == (
        "not_found_error" if expected_status == 404 else "invalid_request_error"
    )
    if code:
        assert error["code"] == code
    assert error["message"]
    assert r.headers["x-should-retry"] == "false"
    assert chat(service, USER, **GREEDY).status_code == 200


def test_bodies_that_are_not_objects(service: Service) -> None:
    for content in (b"{not json", b"[1, 2]", b""):
        r = service.client.post(
            "/v1/chat/completions",
            content=content,
            headers={**service.headers(), "content-type": "application/json"},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_context_error_states_both_numbers(service: Service) -> None:
    r = chat(service, [{"role": "user", "content": "word " * 5000}])
    message = r.json()["error"]["message"]
    assert "maximum context length is 4096 tokens" in message
    assert (
        str(
            service.post(
                "/v1/tokenize", {"messages": [{"role": "user", "content": "word " * 5000}]}
            ).json()["count"]
        )
        in message
    )


def test_keys(service: Service) -> None:
    r = service.client.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = service.client.get("/v1/models", headers={"Authorization": "Bearer kvc-wrong"})
    assert r.status_code == 401
    models = service.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [service.model]
    assert service.get(f"/v1/models/{service.model}").status_code == 200
    assert service.get("/v1/models/other").json()["error"]["code"] == "model_not_found"


def test_health(service: Service) -> None:
    assert service.client.get("/healthz").json() == {"status": "ok"}
    ready = service.client.get("/readyz").json()
    assert ready["status"] == "ready"
    assert ready["checks"]["database"] and ready["checks"]["migrations"]
    assert ready["checks"]["engine"]


def test_tokenize_counts_each_message(service: Service) -> None:
    body = service.post("/v1/tokenize", {"messages": USER, "return_token_ids": True}).json()
    assert sum(body["messages"]) + 3 == body["count"] == len(body["token_ids"])  # + assistant
    assert body["max_model_len"] == 4096


def test_openapi_describes_every_route(service: Service) -> None:
    spec = service.client.get("/openapi.json").json()
    paths = spec["paths"]
    for path in (
        "/v1/chat/completions",
        "/v1/conversations",
        "/v1/conversations/{conversation_id}",
        "/v1/conversations/{conversation_id}/messages",
        "/v1/models",
        "/v1/tokenize",
        "/healthz",
        "/readyz",
    ):
        assert path in paths, path
    assert "ChatCompletionRequest" in spec["components"]["schemas"]


def test_an_engine_failure_mid_stream_is_an_error_chunk_then_done(
    dev_model: Any, tmp_path: Any
) -> None:
    """An injected engine fault: the stream ends with an error chunk and [DONE]; the server
    answers the next requests 500 while steps keep failing, then 503 once the engine
    stops, and /readyz says not ready."""
    from fastapi.testclient import TestClient

    from kvchat.app.main import create_app
    from kvchat.inference.engine.engine import MAX_FAILED_STEPS
    from kvchat_testing.app_service import service_settings
    from kvchat_testing.faults import StepFault

    app = create_app(service_settings(dev_model, tmp_path, None))
    with TestClient(app) as client:
        state = app.state.kvchat
        _, key = client.portal.call(state.store.create_key, "k")
        StepFault(state.runtime.engine_client.engine, after=3)
        headers = {"Authorization": f"Bearer {key}"}
        body = {
            "model": state.runtime.model_name,
            "messages": USER,
            "stream": True,
            "max_tokens": 50,
            "ignore_eos": True,
        }
        with client.stream("POST", "/v1/chat/completions", headers=headers, json=body) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_error"
        assert any(
            e["choices"] and e["choices"][0]["delta"].get("content") is not None
            for e in events[:-2]
        )
        # The engine goes on after a failed step (the next request fails alone, a typed 500),
        # and stops once MAX_FAILED_STEPS steps in a row have failed: 503 from then on.
        codes = []
        for _ in range(MAX_FAILED_STEPS):
            after = client.post(
                "/v1/chat/completions", headers=headers, json={**body, "stream": False}
            )
            codes.append(after.status_code)
            if after.status_code == 500:
                assert after.json()["error"]["code"] == "engine_error"
        assert codes == [500] * (MAX_FAILED_STEPS - 2) + [503, 503]
        assert "Retry-After" in after.headers
        assert client.get("/readyz").status_code == 503
        # Liveness fails too, so a supervisor (Kubernetes, the fleet) restarts the process.
        health = client.get("/healthz")
        assert health.status_code == 503 and health.json()["status"] == "engine_stopped"


def test_sampling_knobs_reach_the_engine(service: Service) -> None:
    def reply(fields: dict[str, Any]) -> str:
        r = chat(service, USER, **fields)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    def refused(fields: dict[str, Any]) -> tuple[int, str | None]:
        r = chat(service, USER, **fields)
        return r.status_code, r.json()["error"]["param"]

    check_sampling_knobs(service.state.runtime.tokenizer, reply, refused)
