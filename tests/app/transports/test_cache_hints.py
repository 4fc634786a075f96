"""The ecosystem's prompt-cache hints, in process (SQLite and Postgres): OpenAI's
`prompt_cache_key` names a keyless client's session (scoped to its owner, X-Session-Id wins) and
its replies are spliced back, so resending the history reuses its KV exactly;
`prompt_cache_retention` and Anthropic-style `cache_control` parts become the session's
retention in the engine's budget, merged with what an operator set; bad values are typed 400s
naming the field, with nothing stored; the official `openai` client sends both fields."""

from __future__ import annotations

import secrets
import time
from typing import Any

import pytest
from openai import OpenAI

from kvchat.app.schemas.chat import Message
from kvchat.app.turns.prompting import (
    opening_session_key,
    prompt_cache_session_key,
    session_key,
)
from kvchat.inference import SessionInfo
from kvchat_testing.app_service import Service

GREEDY = {"temperature": 0, "max_tokens": 6}
USER = [{"role": "user", "content": "Hello there."}]


def chat(
    service: Service,
    messages: list[dict[str, Any]],
    key: str | None = None,
    headers: dict[str, str] | None = None,
    **fields: Any,
) -> Any:
    body = {"model": service.model, "messages": messages, **GREEDY, **fields}
    return service.post("/v1/chat/completions", body, key=key, headers=headers or {})


def respond(service: Service, **fields: Any) -> Any:
    body = {"model": service.model, "max_output_tokens": 6, "temperature": 0, **fields}
    return service.post("/v1/responses", body)


def fresh(name: str) -> str:
    """A prompt_cache_key no other test (or earlier run of the module) used."""
    return f"{name}-{secrets.token_hex(4)}"


def session_info(service: Service, session: str) -> SessionInfo | None:
    engine = service.state.runtime.engine_client
    return service.client.portal.call(engine.session_info, session)  # type: ignore[no-any-return]


def pinned_tokens(service: Service, session: str, at_least: int, timeout: float = 60.0) -> int:
    """The tokens the engine pins for `session` once they are `at_least` (or the timeout
    passed): the engine pins a turn's last sampled token in a step after the reply is out."""
    deadline = time.monotonic() + timeout
    while True:
        info = session_info(service, session)
        pinned = 0 if info is None else info.num_tokens
        if pinned >= at_least or time.monotonic() > deadline:
            return pinned
        time.sleep(0.01)


def conversations(service: Service) -> list[str]:
    return [c["id"] for c in service.get("/v1/conversations?limit=100").json()["data"]]


def parts(*controls: Any) -> list[dict[str, Any]]:
    """A user message of text parts, one per control (None: a part without cache_control)."""
    content = []
    for i, control in enumerate(controls):
        part: dict[str, Any] = {"type": "text", "text": f"Part {i}. "}
        if control is not None:
            part["cache_control"] = control
        content.append(part)
    return [{"role": "user", "content": content}]


# -- bad values ------------------------------------------------------------------------------------

CHAT_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("key-65", {"prompt_cache_key": "k" * 65}, "prompt_cache_key"),
    ("key-number", {"prompt_cache_key": 7}, "prompt_cache_key"),
    ("key-object", {"prompt_cache_key": {"id": "k"}}, "prompt_cache_key"),
    ("retention-1h", {"prompt_cache_retention": "1h"}, "prompt_cache_retention"),
    ("retention-dash", {"prompt_cache_retention": "in-memory"}, "prompt_cache_retention"),
    ("retention-seconds", {"prompt_cache_retention": 600}, "prompt_cache_retention"),
    (
        "control-type",
        {"messages": parts({"type": "persistent"})},
        "messages.0.content.0.cache_control.type",
    ),
    ("control-no-type", {"messages": parts({})}, "messages.0.content.0.cache_control.type"),
    (
        "control-ttl",
        {"messages": parts(None, {"type": "ephemeral", "ttl": "2h"})},
        "messages.0.content.1.cache_control.ttl",
    ),
    (
        "control-ttl-seconds",
        {"messages": parts({"type": "ephemeral", "ttl": 300})},
        "messages.0.content.0.cache_control.ttl",
    ),
    ("control-string", {"messages": parts("ephemeral")}, "messages.0.content.0.cache_control"),
    (
        "control-later-message",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                *parts({"type": "ephemeral", "ttl": "1d"}),
            ]
        },
        "messages.1.content.0.cache_control.ttl",
    ),
]


@pytest.mark.parametrize(
    ("change", "param"), [r[1:] for r in CHAT_BAD], ids=[r[0] for r in CHAT_BAD]
)
def test_bad_chat_hints_are_typed_400s_and_start_no_session(
    service: Service, change: dict[str, Any], param: str
) -> None:
    key = fresh("bad")
    body = {"messages": USER, "prompt_cache_key": key, **change}
    r = chat(service, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"] and r.headers["x-should-retry"] == "false"
    assert session_info(service, prompt_cache_session_key("alice", key) or "") is None
    assert chat(service, USER).status_code == 200


RESPONSES_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("key-65", {"prompt_cache_key": "k" * 65}, "prompt_cache_key"),
    ("key-list", {"prompt_cache_key": ["k"]}, "prompt_cache_key"),
    ("retention", {"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
]


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize(
    ("change", "param"), [r[1:] for r in RESPONSES_BAD], ids=[r[0] for r in RESPONSES_BAD]
)
def test_bad_responses_hints_are_typed_400s_and_store_nothing(
    service: Service, change: dict[str, Any], param: str, store: bool
) -> None:
    before = conversations(service)
    r = respond(service, input="Hello.", store=store, **change)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert conversations(service) == before


def test_a_key_of_64_characters_is_taken_and_an_empty_one_names_no_session(
    service: Service,
) -> None:
    longest = fresh("k").ljust(64, "x")
    assert len(longest) == 64
    assert chat(service, USER, prompt_cache_key=longest).status_code == 200
    assert session_info(service, prompt_cache_session_key("alice", longest) or "") is not None
    assert prompt_cache_session_key("alice", "") is None
    assert chat(service, USER, prompt_cache_key="").status_code == 200
    r = respond(service, input="Hello.", store=False, prompt_cache_key=longest)
    assert r.status_code == 200, r.text


# -- the session a key names -----------------------------------------------------------------------


def test_a_keyless_client_with_a_prompt_cache_key_reuses_its_whole_history(
    service: Service,
) -> None:
    """An agent resending its history with only a prompt_cache_key: each call runs in the
    session the key names and reuses all of the previous call (its reply spliced back by its
    ids). Each call is sent once the session holds the whole previous turn (the engine pins a
    turn's last token a step after the reply), whatever the machine's speed."""
    key = fresh("agent")
    session = prompt_cache_session_key("alice", key)
    assert session is not None and session.startswith("sess_") and len(session) == 5 + 32
    # Its own namespace: never the X-Session-Id's or the opening's of the same text.
    assert session not in (session_key("alice", key), session_key("alice", session))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    previous = None
    for turn in range(4):
        messages.append({"role": "user", "content": f"Step {turn}: what next?"})
        if previous is not None:
            whole = previous["prompt_tokens"] + previous["completion_tokens"]
            assert pinned_tokens(service, session, whole) == whole
        r = chat(service, messages, prompt_cache_key=key, max_tokens=8)
        assert r.status_code == 200, r.text
        body = r.json()
        usage = body["usage"]
        if previous is not None:
            assert usage["prompt_tokens_details"]["cached_tokens"] >= whole
        previous = usage
        reply = body["choices"][0]["message"]
        # Its ids are remembered for the session, to be spliced in when it comes back.
        ids = service.state.generated.lookup(session, reply["content"], [])
        assert ids is not None and len(ids) == usage["completion_tokens"]
        messages.append(reply)
    info = session_info(service, session)
    assert info is not None and info.num_turns == 4


def test_two_owners_equal_keys_are_two_sessions(service: Service) -> None:
    key = fresh("shared")
    prompt = [{"role": "user", "content": f"A prompt both owners send, {key}. " * 4}]
    mine = chat(service, prompt, prompt_cache_key=key)
    assert mine.status_code == 200, mine.text
    theirs = chat(service, prompt, key=service.other_key, prompt_cache_key=key)
    assert theirs.status_code == 200, theirs.text
    assert theirs.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    alice, bob = prompt_cache_session_key("alice", key), prompt_cache_session_key("bob", key)
    assert alice is not None and bob is not None and alice != bob
    for session in (alice, bob):
        info = session_info(service, session)
        assert info is not None and info.num_turns == 1


def test_x_session_id_wins_over_the_key(service: Service) -> None:
    key, header = fresh("key"), fresh("header")
    r = chat(service, USER, prompt_cache_key=key, headers={"X-Session-Id": header})
    assert r.status_code == 200, r.text
    by_header = session_info(service, session_key("alice", header) or "")
    assert by_header is not None and by_header.num_turns == 1
    assert session_info(service, prompt_cache_session_key("alice", key) or "") is None


def test_the_key_wins_over_a_keyless_opening(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service.state.settings, "keyless_sessions", True)
    key = fresh("opening")
    messages = [{"role": "user", "content": f"An opening of its own, {key}."}]
    assert chat(service, messages, prompt_cache_key=key).status_code == 200
    opening = opening_session_key("alice", [Message.model_validate(m) for m in messages])
    assert opening is not None and opening != prompt_cache_session_key("alice", key)
    assert session_info(service, opening) is None
    assert session_info(service, prompt_cache_session_key("alice", key) or "") is not None


def test_responses_without_store_reuse_the_keys_session(service: Service) -> None:
    """Codex's way: `store: false`, the whole history as input items each call (the previous
    outputs as they came), one prompt_cache_key: each call reuses the previous one's KV."""
    key = fresh("codex")
    session = prompt_cache_session_key("alice", key)
    assert session is not None
    items: list[dict[str, Any]] = [{"role": "developer", "content": "Be brief."}]
    previous = None
    for turn in range(3):
        items.append({"role": "user", "content": f"Task {turn}: go on."})
        if previous is not None:
            whole = previous["input_tokens"] + previous["output_tokens"]
            assert pinned_tokens(service, session, whole) == whole
        r = respond(service, input=items, store=False, prompt_cache_key=key, max_output_tokens=8)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["prompt_cache_key"] == key and body["store"] is False
        usage = body["usage"]
        if previous is not None:
            assert usage["input_tokens_details"]["cached_tokens"] >= whole
        previous = usage
        ids = service.state.generated.lookup(session, body["output_text"], [])
        assert ids is not None and len(ids) == usage["output_tokens"]
        items += body["output"]


# -- retention -------------------------------------------------------------------------------------


def retention(service: Service, session: str | None) -> float | None:
    assert session is not None
    info = session_info(service, session)
    assert info is not None
    return info.budget.retention_ttl_s


@pytest.mark.parametrize(
    ("fields", "held_s"),
    [
        ({"prompt_cache_retention": "24h"}, 86_400),
        ({"prompt_cache_retention": "in_memory"}, 600),
        ({"messages": parts({"type": "ephemeral"})}, 300),
        ({"messages": parts({"type": "ephemeral", "ttl": "5m"}, None)}, 300),
        ({"messages": parts(None, {"type": "ephemeral", "ttl": "1h"})}, 3_600),
        # The longest of a request's hints.
        (
            {
                "prompt_cache_retention": "in_memory",
                "messages": parts({"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}),
            },
            3_600,
        ),
        (
            {
                "prompt_cache_retention": "24h",
                "messages": parts({"type": "ephemeral", "ttl": "1h"}),
            },
            86_400,
        ),
        ({}, None),
    ],
)
def test_a_chat_hint_is_the_sessions_retention_in_the_engine(
    service: Service, fields: dict[str, Any], held_s: float | None
) -> None:
    key = fresh("ttl")
    r = chat(service, **{"messages": USER, **fields}, prompt_cache_key=key)
    assert r.status_code == 200, r.text
    assert retention(service, prompt_cache_session_key("alice", key)) == held_s


def test_a_hint_keeps_what_an_operator_set_and_the_longer_retention_wins(
    service: Service,
) -> None:
    header = fresh("ops")
    session = session_key("alice", header)
    assert session is not None
    headers = {"X-Session-Id": header}
    assert chat(service, USER, headers=headers).status_code == 200
    _, admin = service.client.portal.call(lambda: service.state.store.create_key("ops", admin=True))
    put = service.client.put(
        f"/v1/admin/sessions/{session}",
        json={"max_kv_tokens": 4096, "max_context_tokens": 1024},
        headers=service.headers(admin),
    )
    assert put.status_code == 200, put.text
    r = chat(service, USER, headers=headers, prompt_cache_retention="24h")
    assert r.status_code == 200, r.text
    info = session_info(service, session)
    assert info is not None
    assert info.budget.retention_ttl_s == 86_400
    assert (info.budget.max_kv_tokens, info.budget.max_context_tokens) == (4096, 1024)
    # A shorter hint later does not cut what the session holds; none leaves it as it is.
    for later in ({"prompt_cache_retention": "in_memory"}, {}):
        assert chat(service, USER, headers=headers, **later).status_code == 200
        assert retention(service, session) == 86_400


def test_only_the_first_choice_runs_in_the_session(service: Service) -> None:
    key = fresh("n")
    r = chat(service, USER, prompt_cache_key=key, prompt_cache_retention="24h", n=3)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    info = session_info(service, prompt_cache_session_key("alice", key) or "")
    assert info is not None and info.num_turns == 1 and info.budget.retention_ttl_s == 86_400


def test_a_stored_responses_hint_reaches_its_conversations_session(service: Service) -> None:
    r = respond(service, input="Keep me a day.", prompt_cache_retention="24h")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_cache_retention"] == "24h" and body["prompt_cache_key"] is None
    reply = "msg_" + body["id"].removeprefix("resp_")
    conv = next(
        c
        for c in conversations(service)
        if any(
            m["id"] == reply for m in service.get(f"/v1/conversations/{c}/messages").json()["data"]
        )
    )
    assert retention(service, conv) == 86_400
    again = respond(
        service,
        input="And now in memory.",
        previous_response_id=body["id"],
        prompt_cache_retention="in_memory",
    )
    assert again.status_code == 200, again.text
    # A conversation's budget comes from its settings at each turn: this turn's hint only.
    assert retention(service, conv) == 600
    retrieved = service.get(f"/v1/responses/{again.json()['id']}").json()
    assert retrieved["prompt_cache_retention"] == "in_memory"


def test_a_stateless_responses_hint_reaches_the_keys_session(service: Service) -> None:
    key = fresh("resp")
    r = respond(
        service, input="Hello.", store=False, prompt_cache_key=key, prompt_cache_retention="24h"
    )
    assert r.status_code == 200, r.text
    assert retention(service, prompt_cache_session_key("alice", key)) == 86_400


# -- the official client ---------------------------------------------------------------------------


def test_the_openai_client_sends_both_fields(service: Service) -> None:
    client = OpenAI(
        base_url=f"{service.client.base_url}/v1",
        api_key=service.key,
        http_client=service.client,
        max_retries=0,
    )
    key = fresh("sdk")
    completion = client.chat.completions.create(
        model=service.model,
        messages=[{"role": "user", "content": "Hello from the SDK."}],
        max_tokens=4,
        temperature=0,
        prompt_cache_key=key,
        prompt_cache_retention="24h",
    )
    assert completion.choices[0].message.role == "assistant"
    assert retention(service, prompt_cache_session_key("alice", key)) == 86_400
    response_key = fresh("sdk-responses")
    response = client.responses.create(
        model=service.model,
        input="Hello from the SDK.",
        max_output_tokens=4,
        temperature=0,
        store=False,
        prompt_cache_key=response_key,
        prompt_cache_retention="24h",
    )
    assert response.status in ("completed", "incomplete")
    assert response.prompt_cache_key == response_key
    assert response.prompt_cache_retention == "24h"
    assert retention(service, prompt_cache_session_key("alice", response_key)) == 86_400


def test_a_streamed_stateless_response_is_spliced_back_too(service: Service) -> None:
    """The reply of a streamed `store: false` response is remembered before its stream ends:
    the next call, sending its output items back, reuses all of it (but perhaps its last
    token, which the engine pins a step after the reply)."""
    client = OpenAI(
        base_url=f"{service.client.base_url}/v1",
        api_key=service.key,
        http_client=service.client,
        max_retries=0,
    )
    key = fresh("streamed")
    items: list[Any] = [{"role": "user", "content": "Stream me a few words."}]
    stream = client.responses.create(
        model=service.model,
        input=items,
        max_output_tokens=8,
        temperature=0,
        store=False,
        prompt_cache_key=key,
        stream=True,
    )
    ends = [e for e in stream if e.type in ("response.completed", "response.incomplete")]
    assert len(ends) == 1
    first = ends[0].response  # type: ignore[union-attr]
    assert first.usage is not None and first.output
    session = prompt_cache_session_key("alice", key)
    assert session is not None
    ids = service.state.generated.lookup(session, first.output_text, [])
    assert ids is not None and len(ids) == first.usage.output_tokens
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"role": "user", "content": "And a few more."})
    second = client.responses.create(
        model=service.model,
        input=items,
        max_output_tokens=4,
        temperature=0,
        store=False,
        prompt_cache_key=key,
    )
    assert second.usage is not None
    whole = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= whole - 1
