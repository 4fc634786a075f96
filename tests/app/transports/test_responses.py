"""The Responses and Conversations APIs in process (SQLite and Postgres): every bad field a
typed 400 naming it (nothing stored), ids on the message tree (chains are branches, forks are
siblings, kvchat's routes and these on the same conversations), truncation, cancel, the
conversation items' edits, and what operators see. The official clients' view is
test_responses_server.py."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest

from kvchat_testing.app_service import Service
from kvchat_testing.sampling_knobs import check_sampling_knobs

SHORT: dict[str, Any] = {"model": "dev", "max_output_tokens": 6, "temperature": 0.0}
SCHEMA = {
    "type": "object",
    "properties": {"v": {"type": "string", "enum": ["a", "b"]}},
    "required": ["v"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "pick", "parameters": SCHEMA}
LOGPROBS = "message.output_text.logprobs"


def respond(service: Service, key: str | None = None, **body: Any) -> dict[str, Any]:
    r = service.post("/v1/responses", {**SHORT, **body}, key=key)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def conversations(service: Service) -> list[str]:
    page = service.get("/v1/conversations?limit=100").json()
    return [c["id"] for c in page["data"]]


def messages(service: Service, conv: str) -> list[dict[str, Any]]:
    return service.get(f"/v1/conversations/{conv}/messages?all=true").json()[  # type: ignore
        "data"
    ]


def conversation_of(service: Service, response: dict[str, Any]) -> str:
    message_id = "msg_" + response["id"].removeprefix("resp_")
    for conv in conversations(service):
        if any(m["id"] == message_id for m in messages(service, conv)):
            return conv
    raise AssertionError("no conversation holds the response")


BAD_BODIES: list[tuple[str, dict[str, Any], int, str]] = [
    ("no input", {"model": "dev"}, 400, "input"),
    # Integers are integers, as OpenAI's API has them: no numeric strings, no booleans.
    (
        "max_output_tokens a string",
        {"input": "hi", "max_output_tokens": "8"},
        400,
        "max_output_tokens",
    ),
    (
        "max_output_tokens a boolean",
        {"input": "hi", "max_output_tokens": True},
        400,
        "max_output_tokens",
    ),
    (
        "max_output_tokens a float",
        {"input": "hi", "max_output_tokens": 8.5},
        400,
        "max_output_tokens",
    ),
    ("seed a string", {"input": "hi", "seed": "7"}, 400, "seed"),
    ("input not text or items", {"input": 5}, 400, "input"),
    ("empty input", {"input": []}, 400, "input"),
    ("empty string", {"input": ""}, 400, "input"),
    ("item not an object", {"input": ["hi"]}, 400, "input.0"),
    ("unknown item type", {"input": [{"type": "image_generation_call"}]}, 400, "input.0.type"),
    ("unknown role", {"input": [{"role": "robot", "content": "x"}]}, 400, "input.0.role"),
    (
        "image content",
        {
            "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}
            ]
        },
        400,
        "input.0.content.0.type",
    ),
    ("no content", {"input": [{"role": "user"}]}, 400, "input.0.content"),
    (
        "call arguments not JSON",
        {
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "pick", "arguments": "{no"},
                {"type": "function_call_output", "call_id": "c1", "output": "x"},
            ]
        },
        400,
        "input.0.arguments",
    ),
    (
        "call without a name",
        {"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]},
        400,
        "input.0.name",
    ),
    (
        "output for no call",
        {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
        400,
        "input.0.call_id",
    ),
    (
        "call id twice",
        {
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "pick", "arguments": "{}"},
                {"type": "function_call", "call_id": "c1", "name": "pick", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "x"},
            ]
        },
        400,
        "input.1.call_id",
    ),
    ("ends with an assistant", {"input": [{"role": "assistant", "content": "x"}]}, 400, "input"),
    ("instructions not text", {"input": "x", "instructions": 5}, 400, "instructions"),
    ("temperature", {"input": "x", "temperature": 3}, 400, "temperature"),
    ("top_p", {"input": "x", "top_p": 0}, 400, "top_p"),
    ("max_output_tokens", {"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    (
        "max_output_tokens huge",
        {"input": "x", "max_output_tokens": 2**40},
        400,
        "max_output_tokens",
    ),
    ("seed", {"input": "x", "seed": 2**64}, 400, "seed"),
    ("stop", {"input": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("store", {"input": "x", "store": "maybe"}, 400, "store"),
    ("stream", {"input": "x", "stream": "maybe"}, 400, "stream"),
    ("truncation", {"input": "x", "truncation": "sometimes"}, 400, "truncation"),
    ("metadata value", {"input": "x", "metadata": {"k": 5}}, 400, "metadata.k"),
    (
        "metadata pairs",
        {"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}},
        400,
        "metadata",
    ),
    ("metadata value length", {"input": "x", "metadata": {"k": "v" * 513}}, 400, "metadata"),
    ("user", {"input": "x", "user": 5}, 400, "user"),
    ("tool type", {"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    (
        "tool name",
        {"input": "x", "tools": [{"type": "function", "name": "a b"}]},
        400,
        "tools.0.name",
    ),
    (
        "tool schema",
        {
            "input": "x",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}],
        },
        400,
        "tools.0.parameters",
    ),
    ("tool names twice", {"input": "x", "tools": [TOOL, TOOL]}, 400, "tools"),
    ("tool_choice", {"input": "x", "tool_choice": "sometimes"}, 400, "tool_choice"),
    (
        "tool_choice object",
        {"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": 5}},
        400,
        "tool_choice",
    ),
    (
        "tool_choice unknown",
        {"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
        400,
        "tool_choice",
    ),
    ("tool_choice without tools", {"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ("parallel_tool_calls", {"input": "x", "parallel_tool_calls": "x"}, 400, "parallel_tool_calls"),
    ("format type", {"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    (
        "format without schema",
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
        400,
        "text.format",
    ),
    (
        "format schema",
        {
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": 5}}},
        },
        400,
        "text.format.schema",
    ),
    ("conversation", {"input": "x", "conversation": 5}, 400, "conversation"),
    ("conversation object", {"input": "x", "conversation": {"id": 5}}, 400, "conversation"),
    (
        "both",
        {"input": "x", "conversation": "conv_x", "previous_response_id": "resp_x"},
        400,
        "conversation",
    ),
    ("background", {"input": "x", "background": True}, 400, "background"),
    ("prompt", {"input": "x", "prompt": {"id": "p"}}, 400, "prompt"),
    (
        "top_logprobs over 20",
        {"input": "x", "include": [LOGPROBS], "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    ("top_logprobs negative", {"input": "x", "top_logprobs": -1}, 400, "top_logprobs"),
    ("top_logprobs a string", {"input": "x", "top_logprobs": "3"}, 400, "top_logprobs"),
    ("top_logprobs a float", {"input": "x", "top_logprobs": 2.5}, 400, "top_logprobs"),
    ("include not a list", {"input": "x", "include": LOGPROBS}, 400, "include"),
    (
        "include unknown",
        {"input": "x", "include": ["message.output_text.logprob"]},
        400,
        "include.0",
    ),
    (
        "logprobs with tools",
        {"input": "x", "include": [LOGPROBS], "tools": [TOOL]},
        400,
        "include",
    ),
    ("unknown conversation", {"input": "x", "conversation": "conv_nope"}, 404, "conversation"),
    (
        "unknown previous",
        {"input": "x", "previous_response_id": "resp_nope"},
        404,
        "previous_response_id",
    ),
    ("model", {"input": "x", "model": "gpt-9"}, 404, "model"),
]


@pytest.mark.parametrize(
    "body, status, param", [row[1:] for row in BAD_BODIES], ids=[row[0] for row in BAD_BODIES]
)
def test_a_bad_field_is_a_typed_error_naming_it(
    service: Service, body: dict[str, Any], status: int, param: str
) -> None:
    before = conversations(service)
    r = service.post("/v1/responses", {**SHORT, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] and error["message"]
    assert conversations(service) == before  # nothing was stored


@pytest.mark.parametrize(
    "path, param",
    [
        ("/v1/responses/{id}/input_items?limit=0", "limit"),
        ("/v1/responses/{id}/input_items?limit=101", "limit"),
        ("/v1/responses/{id}/input_items?order=up", "order"),
        ("/v1/responses/{id}/input_items?after=msg_nope", "after"),
        ("/v1/responses/{id}?stream=true&starting_after=-1", "starting_after"),
        ("/v1/conversations/{conv}/items?limit=0", "limit"),
        ("/v1/conversations/{conv}/items?order=up", "order"),
    ],
)
def test_bad_query_parameters_are_typed_errors(service: Service, path: str, param: str) -> None:
    r = respond(service, input="For the queries")
    url = path.format(id=r["id"], conv=conversation_of(service, r))
    answer = service.get(url)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_bad_items_for_conversations_store_nothing(service: Service) -> None:
    before = conversations(service)
    r = service.post(
        "/v1/conversations",
        {"items": [{"role": "user", "content": "ok"}, {"role": "robot", "content": "x"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "items.1.role"
    assert conversations(service) == before
    conv = service.post(
        "/v1/conversations", {"title": "kvchat's fields still work", "max_context_tokens": 512}
    ).json()
    assert conv["title"] == "kvchat's fields still work" and conv["max_context_tokens"] == 512
    r = service.post(
        f"/v1/conversations/{conv['id']}/items",
        {"items": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "items.0.call_id"
    assert service.post(f"/v1/conversations/{conv['id']}/items", {"items": []}).status_code == 400
    assert messages(service, conv["id"]) == []


def test_chains_and_forks_are_branches_of_one_conversation(service: Service) -> None:
    first = respond(service, input="One", instructions="Be brief.")
    second = respond(
        service, input="Two", previous_response_id=first["id"], instructions="Be brief."
    )
    fork = respond(
        service, input="Two again", previous_response_id=first["id"], instructions="Be brief."
    )
    conv = conversation_of(service, first)
    assert conversation_of(service, fork) == conv == conversation_of(service, second)
    tree = {m["id"]: m for m in messages(service, conv)}
    reply_of = {r["id"]: "msg_" + r["id"].removeprefix("resp_") for r in (first, second, fork)}
    users = [tree[reply_of[r["id"]]]["parent_id"] for r in (second, fork)]
    assert [tree[u]["parent_id"] for u in users] == [reply_of[first["id"]]] * 2  # siblings
    assert tree[users[0]]["siblings"] == users
    # The fork reused the session's KV up to the point of divergence: all of `first`.
    assert fork["usage"]["input_tokens_details"]["cached_tokens"] >= (
        first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    )
    # kvchat's routes on the same conversation: a message continues the latest branch...
    r = service.post(
        f"/v1/conversations/{conv}/messages", {"content": "Via kvchat", "max_tokens": 4}
    )
    assert r.status_code == 200 and r.json()["parent_id"] != reply_of[first["id"]]
    # ...and its reply is a response too.
    via_kvchat = "resp_" + r.json()["id"].removeprefix("msg_")
    got = service.get(f"/v1/responses/{via_kvchat}").json()
    assert got["output_text"] == r.json()["content"]
    onward = respond(service, input="And on", previous_response_id=via_kvchat)
    assert onward["previous_response_id"] == via_kvchat


def test_another_owners_and_deleted_responses_are_not_found(service: Service) -> None:
    r = respond(service, input="Private")
    for method, path in [
        ("GET", "/v1/responses/{id}"),
        ("GET", "/v1/responses/{id}/input_items"),
        ("POST", "/v1/responses/{id}/cancel"),
        ("DELETE", "/v1/responses/{id}"),
        ("GET", "/v1/responses/{id}?stream=true"),
    ]:
        answer = service.client.request(
            method, path.format(id=r["id"]), headers=service.headers(service.other_key)
        )
        assert answer.status_code == 404, (method, path, answer.text)
        assert answer.json()["error"]["code"] == "not_found"
    deleted = service.client.delete(f"/v1/responses/{r['id']}", headers=service.headers())
    assert deleted.json() == {"id": r["id"], "object": "response", "deleted": True}
    assert service.get(f"/v1/responses/{r['id']}").status_code == 404
    assert (
        service.client.delete(f"/v1/responses/{r['id']}", headers=service.headers()).status_code
        == 404
    )


def test_input_items_page_in_both_orders(service: Service) -> None:
    items = [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "pick",
            "arguments": json.dumps({"v": "a"}),
        },
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]
    r = respond(service, input=items, tools=[TOOL])
    listed = service.get(f"/v1/responses/{r['id']}/input_items?order=asc").json()
    kinds = [(i["type"], i.get("role")) for i in listed["data"]]
    # The leading developer message is the new conversation's system prompt; the assistant's
    # text and its call are one stored message, two items.
    assert kinds == [
        ("message", "user"),
        ("message", "assistant"),
        ("function_call", None),
        ("function_call_output", None),
    ]
    assert listed["data"][2]["call_id"] == "c1" and listed["has_more"] is False
    conv = service.get(f"/v1/conversations/{conversation_of(service, r)}").json()
    assert conv["system"] == "Rules."
    later = service.post(
        "/v1/responses",
        {
            **SHORT,
            "previous_response_id": r["id"],
            "input": [{"role": "user", "content": "x"}, {"role": "developer", "content": "late"}],
        },
    )
    assert later.status_code == 400 and later.json()["error"]["param"] == "input.1.role"
    newest = service.get(f"/v1/responses/{r['id']}/input_items?limit=2").json()
    assert [i["id"] for i in newest["data"]] == [i["id"] for i in listed["data"][::-1][:2]]
    assert newest["has_more"] is True
    rest = service.get(
        f"/v1/responses/{r['id']}/input_items?limit=10&after={newest['last_id']}"
    ).json()
    assert [i["id"] for i in newest["data"] + rest["data"]] == [
        i["id"] for i in reversed(listed["data"])
    ]


def test_truncation_disabled_refuses_what_auto_trims(service: Service) -> None:
    conv = service.post(
        "/v1/conversations",
        {
            "max_context_tokens": 96,
            "items": [
                {"role": "user", "content": "word " * 50},
                {"role": "assistant", "content": "ok"},
            ],
        },
    ).json()
    before = messages(service, conv["id"])
    body = {
        "conversation": conv["id"],
        "max_output_tokens": 8,
        "input": [
            {"role": "user", "content": "word " * 30},
            {"role": "user", "content": "and more"},
        ],
    }
    refused = service.post("/v1/responses", {**SHORT, **body})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert refused.json()["error"]["param"] == "input"
    # What it stored for the turn is gone (the counts measured for the others are kept).
    assert [m["id"] for m in messages(service, conv["id"])] == [m["id"] for m in before]
    trimmed = respond(service, **body, truncation="auto")
    assert trimmed["truncation"] == "auto" and trimmed["usage"]["input_tokens"] <= 96


def test_cancel_stops_a_response_being_generated(service: Service) -> None:
    body = {
        **SHORT,
        "input": "Go on and on",
        "max_output_tokens": 3000,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
    }
    with service.client.stream(
        "POST", "/v1/responses", json=body, headers=service.headers()
    ) as stream:
        lines = stream.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "response.output_text.delta":
                    break
        response_id = events[0]["response"]["id"]
        cancelled = service.post(f"/v1/responses/{response_id}/cancel").json()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert cancelled["status"] == "cancelled" and cancelled["usage"]["output_tokens"] < 3000
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "cancelled"
    assert service.get(f"/v1/responses/{response_id}").json() == cancelled
    # An ended response is answered as it is.
    assert service.post(f"/v1/responses/{response_id}/cancel").json() == cancelled


def test_conversation_items_are_read_added_and_taken_out(service: Service) -> None:
    conv = service.post(
        "/v1/conversations",
        {"items": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]},
    ).json()
    added = service.post(
        f"/v1/conversations/{conv['id']}/items",
        {
            "items": [
                {"type": "function_call", "call_id": "c1", "name": "pick", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "pick", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "r1"},
            ]
        },
    ).json()
    # The two calls are one assistant message (one assistant turn), two items.
    assert [i["type"] for i in added["data"]] == [
        "function_call",
        "function_call",
        "function_call_output",
    ]
    assert added["data"][0]["id"].removesuffix("_0") == added["data"][1]["id"].removesuffix("_1")
    listed = service.get(f"/v1/conversations/{conv['id']}/items?order=asc").json()["data"]
    assert [i["type"] for i in listed] == [
        "message",
        "message",
        "function_call",
        "function_call",
        "function_call_output",
    ]
    call = listed[3]
    assert service.get(f"/v1/conversations/{conv['id']}/items/{call['id']}").json() == call
    for unknown in ("fc_nope_0", "msg_nope", "nothing"):
        r = service.get(f"/v1/conversations/{conv['id']}/items/{unknown}")
        assert r.status_code == 404
    assert (
        service.get(
            f"/v1/conversations/{conv['id']}/items/{call['id']}", key=service.other_key
        ).status_code
        == 404
    )
    # One call out: the other stays on its message.
    r = service.client.delete(
        f"/v1/conversations/{conv['id']}/items/{call['id']}", headers=service.headers()
    )
    assert r.status_code == 200 and r.json()["id"] == conv["id"]
    after = service.get(f"/v1/conversations/{conv['id']}/items?order=asc").json()["data"]
    assert [i["id"] for i in after] == [i["id"] for i in listed if i["id"] != call["id"]]
    # A message out of the middle: what came after it moves up.
    service.client.delete(
        f"/v1/conversations/{conv['id']}/items/{listed[0]['id']}", headers=service.headers()
    )
    after = service.get(f"/v1/conversations/{conv['id']}/items?order=asc").json()["data"]
    assert [i["id"] for i in after] == [listed[1]["id"], listed[2]["id"], listed[4]["id"]]
    # And the conversation goes on from its leaf.
    r = respond(service, input="three", conversation=conv["id"])
    assert r["conversation"] == {"id": conv["id"]}


def test_operators_see_the_conversation_and_its_session(service: Service) -> None:
    r = respond(service, input="For the operators")
    conv = conversation_of(service, r)
    _, admin = service.client.portal.call(lambda: service.state.store.create_key("ops", admin=True))
    session = service.get(f"/v1/admin/sessions/{conv}", key=admin)
    assert session.status_code == 200, session.text
    memory = service.get("/v1/admin/memory", key=admin).json()
    assert conv in json.dumps(memory)
    evicted = service.post(f"/v1/admin/sessions/{conv}/evict", key=admin)
    assert evicted.status_code == 200, evicted.text
    again = respond(service, input="After the evict", previous_response_id=r["id"])
    assert again["status"] in ("completed", "incomplete")


def test_an_engine_failure_is_a_failed_response(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvchat.app.turns.generation import Generation, TextDelta

    async def failing(self: Generation) -> Any:
        yield TextDelta("partial")
        raise RuntimeError("the accelerator fell over")

    monkeypatch.setattr(Generation, "events", failing)
    r = respond(service, input="Hi")
    assert r["status"] == "failed" and r["output"] == []  # nothing was stored of it
    assert r["usage"]["output_tokens"] == 0 and r["usage"]["input_tokens"] > 0
    assert r["error"]["code"] == "server_error" and "fell over" in r["error"]["message"]
    assert service.get(f"/v1/responses/{r['id']}").json() == r
    with service.client.stream(
        "POST",
        "/v1/responses",
        json={**SHORT, "input": "Again", "stream": True},
        headers=service.headers(),
    ) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "engine_error" and "fell over" in events[-2]["message"]
    assert events[-1]["response"]["status"] == "failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def sse_events(service: Service, path: str) -> list[dict[str, Any]]:
    with service.client.stream("GET", path, headers=service.headers()) as stream:
        return [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]


def test_a_stored_calls_only_reply_streams_as_its_call(service: Service) -> None:
    """Resumed from the stored reply (not a turn this process still keeps), a reply that is
    only a call streams the call, not the call's markup as text."""
    r = respond(
        service,
        input="Pick one",
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=48,
        temperature=1.0,
    )
    (call,) = r["output"]
    assert call["type"] == "function_call"
    live = sse_events(service, f"/v1/responses/{r['id']}?stream=true")
    service.state.turns._recent.clear()  # as after RECENT_TURNS later turns, or a restart
    stored = sse_events(service, f"/v1/responses/{r['id']}?stream=true")
    for events in (live, stored):
        types = [e["type"] for e in events]
        assert "response.output_text.delta" not in types, types
        added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
        assert [(i["type"], i["call_id"]) for i in added] == [("function_call", call["call_id"])]
        done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert [e["arguments"] for e in done] == [call["arguments"]]
        assert events[-1]["response"] == r


def test_too_many_input_items_are_a_400_naming_the_limit(service: Service) -> None:
    from kvchat.app.schemas.responses import MAX_INPUT_ITEMS

    before = conversations(service)
    items = [{"role": "user", "content": "x"}] * (MAX_INPUT_ITEMS + 1)
    r = service.post("/v1/responses", {**SHORT, "input": items})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input" and str(MAX_INPUT_ITEMS) in error["message"]
    assert conversations(service) == before


def test_a_long_input_is_stored_in_one_transaction(service: Service) -> None:
    """Hundreds of items become messages of the branch, in order, at once."""
    items: list[dict[str, Any]] = []
    for i in range(150):
        items.append({"role": "user", "content": f"question {i}"})
        items.append({"role": "assistant", "content": f"answer {i}"})
    items.append({"role": "user", "content": "the last question"})
    before = set(conversations(service))
    r = service.post("/v1/responses", {**SHORT, "input": items})
    assert r.status_code == 200, r.text
    (conv,) = set(conversations(service)) - before
    stored = messages(service, conv)
    assert [m["content"] for m in stored[: len(items)]] == [i["content"] for i in items]
    assert stored[-1]["role"] == "assistant"


def test_a_request_cancelled_while_its_input_is_stored_leaves_nothing(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client goes away (its task is cancelled) while a hung database write holds its
    input (an injected fault): the new conversation is removed as if it never started."""
    import asyncio

    from kvchat.app.schemas.responses import ResponseCreate
    from kvchat.app.transports import responses as transport

    state = service.state
    entered = asyncio.Event()

    async def hung(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        await asyncio.sleep(3600)

    async def scenario() -> list[Any]:
        record, _ = await state.store.create_key("carol")
        monkeypatch.setattr(state.store, "add_chain", hung)
        body = ResponseCreate.model_validate(
            {
                **SHORT,
                "input": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                ],
            }
        )
        task = asyncio.create_task(transport.start(state, record, body))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        monkeypatch.undo()
        page = await state.store.list_conversations("carol")
        return list(page[0]) if isinstance(page, tuple) else list(page)

    assert service.client.portal.call(scenario) == []


def test_an_idempotency_key_answers_a_retry_with_the_first_response(service: Service) -> None:
    before = set(conversations(service))
    body = {**SHORT, "input": "Remember this once."}
    key = {"Idempotency-Key": "responses-retry-1"}
    first = service.post("/v1/responses", body, headers=key)
    again = service.post("/v1/responses", body, headers=key)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["output"] == first.json()["output"]
    assert len(set(conversations(service)) - before) == 1  # one conversation, not two
    other = service.post("/v1/responses", {**body, "input": "Another request."}, headers=key)
    assert other.status_code == 400
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    # Continuing it: a retry adds no second sibling branch.
    follow = {**SHORT, "input": "And then?", "previous_response_id": first.json()["id"]}
    key2 = {"Idempotency-Key": "responses-retry-2"}
    one = service.post("/v1/responses", follow, headers=key2)
    two = service.post("/v1/responses", follow, headers=key2)
    assert one.status_code == two.status_code == 200
    assert one.json()["id"] == two.json()["id"]
    (conv,) = set(conversations(service)) - before
    users = [m for m in messages(service, conv) if m["content"] == "And then?"]
    assert len(users) == 1
    # A streamed request's retry streams the first one's events.
    key3 = {**service.headers(), "Idempotency-Key": "responses-retry-3"}
    stream = {**SHORT, "input": "Stream it.", "stream": True}
    first_stream = service.client.post("/v1/responses", json=stream, headers=key3)
    retry_stream = service.client.post("/v1/responses", json=stream, headers=key3)
    assert first_stream.status_code == retry_stream.status_code == 200
    ids = re.findall(r'"id": ?"(resp_[0-9a-zA-Z]+)"', first_stream.text)
    assert ids and ids[0] in retry_stream.text
    kinds = re.findall(r"event: (\S+)", first_stream.text)
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert re.findall(r"event: (\S+)", retry_stream.text) == kinds


def test_sampling_knobs_reach_the_engine(service: Service) -> None:
    """kvchat's extensions on the Responses API, as on Chat Completions."""

    def body(fields: dict[str, Any]) -> dict[str, Any]:
        fields = dict(fields)
        fields["max_output_tokens"] = fields.pop("max_tokens")
        return {**SHORT, "input": "Hello!", "store": False, **fields}

    def reply(fields: dict[str, Any]) -> str:
        r = service.post("/v1/responses", body(fields))
        assert r.status_code == 200, r.text
        (message,) = [item for item in r.json()["output"] if item["type"] == "message"]
        return str(message["content"][0]["text"])

    def refused(fields: dict[str, Any]) -> tuple[int, str | None]:
        r = service.post("/v1/responses", body(fields))
        return r.status_code, r.json()["error"]["param"]

    check_sampling_knobs(service.state.runtime.tokenizer, reply, refused)


# -- logprobs -------------------------------------------------------------------------------------

WITH_LOGPROBS: dict[str, Any] = {
    "input": "Tell me about cats.",
    "max_output_tokens": 8,
    "include": [LOGPROBS],
    "top_logprobs": 3,
}


def text_part(response: dict[str, Any]) -> dict[str, Any]:
    (message,) = [item for item in response["output"] if item["type"] == "message"]
    (part,) = message["content"]
    assert part["type"] == "output_text"
    return part  # type: ignore[no-any-return]


def streamed(service: Service, body: dict[str, Any]) -> list[dict[str, Any]]:
    with service.client.stream(
        "POST", "/v1/responses", json={**SHORT, **body, "stream": True}, headers=service.headers()
    ) as stream:
        return [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]


def assert_same_logprobs(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """The same tokens (and alternatives); logprobs equal up to float noise (a second request
    reads its prompt's KV from the prefix cache)."""

    def tokens(entries: list[dict[str, Any]]) -> list[Any]:
        return [(e["bytes"], [t["bytes"] for t in e["top_logprobs"]]) for e in entries]

    def values(entries: list[dict[str, Any]]) -> list[float]:
        return [
            v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))
        ]

    assert tokens(got) == tokens(expected)
    assert values(got) == pytest.approx(values(expected), abs=1e-4)


@pytest.mark.parametrize("store", [True, False], ids=["stored", "stateless"])
def test_logprobs_are_those_of_the_texts_tokens(service: Service, store: bool) -> None:
    r = respond(service, **WITH_LOGPROBS, store=store)
    assert r["top_logprobs"] == 3
    part = text_part(r)
    text, logprobs = part["text"], part["logprobs"]
    assert logprobs
    # One per token of the text (a closing end-of-sequence token is not the text's).
    assert len(logprobs) == r["usage"]["output_tokens"] - (r["status"] == "completed")
    assert b"".join(bytes(e["bytes"]) for e in logprobs) == text.encode()
    assert "".join(e["token"] for e in logprobs) == text
    for entry in logprobs:
        top = entry["top_logprobs"]
        assert len(top) == 3
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-6
        # Greedy decoding chose the most likely token: the same token, the same logprob.
        assert (entry["token"], entry["bytes"]) == (top[0]["token"], top[0]["bytes"])
        assert entry["logprob"] == top[0]["logprob"]
    # The values Chat Completions gives for the same prompt.
    chat = service.post(
        "/v1/chat/completions",
        {
            "model": "dev",
            "messages": [{"role": "user", "content": WITH_LOGPROBS["input"]}],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    assert chat.status_code == 200, chat.text
    entries = chat.json()["choices"][0]["logprobs"]["content"][: len(logprobs)]
    assert_same_logprobs(entries, logprobs)


@pytest.mark.parametrize("store", [True, False], ids=["stored", "stateless"])
def test_streamed_logprobs_join_to_the_whole_responses(service: Service, store: bool) -> None:
    whole = text_part(respond(service, **WITH_LOGPROBS, store=store))
    events = streamed(service, {**WITH_LOGPROBS, "store": store})
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas
    for delta in deltas:  # each delta has its text's tokens
        assert b"".join(bytes(e["bytes"]) for e in delta["logprobs"]) == delta["delta"].encode()
    joined = [e for delta in deltas for e in delta["logprobs"]]
    assert_same_logprobs(joined, whole["logprobs"])
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    (part_done,) = [e for e in events if e["type"] == "response.content_part.done"]
    (item_done,) = [e for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]["response"]
    assert done["text"] == whole["text"] == text_part(final)["text"]
    assert done["logprobs"] == joined
    assert part_done["part"]["logprobs"] == joined
    assert item_done["item"]["content"][0]["logprobs"] == joined
    assert text_part(final)["logprobs"] == joined
    if not store:
        return
    # Logprobs are not stored: retrieved later, the response has none; a stream resumed from
    # the turn this process keeps has them as first sent, one from the stored reply none.
    retrieved = service.get(f"/v1/responses/{final['id']}").json()
    assert text_part(retrieved) == {**text_part(final), "logprobs": []}
    assert retrieved["top_logprobs"] == 3
    resumed = sse_events(service, f"/v1/responses/{final['id']}?stream=true")
    assert resumed == events
    service.state.turns._recent.clear()  # as after RECENT_TURNS later turns, or a restart
    stored = sse_events(service, f"/v1/responses/{final['id']}?stream=true")
    assert [e["type"] for e in stored][-1] == events[-1]["type"]
    assert all(e.get("logprobs", []) == [] for e in stored)
    assert text_part(stored[-1]["response"])["logprobs"] == []


def test_logprobs_come_with_the_include_only(service: Service) -> None:
    # top_logprobs alone asks for none (as OpenAI's); it is echoed.
    r = respond(service, input="Tell me about cats.", top_logprobs=5)
    assert r["top_logprobs"] == 5 and text_part(r)["logprobs"] == []
    events = streamed(service, {"input": "Tell me about cats.", "top_logprobs": 5})
    assert all(e["logprobs"] == [] for e in events if e["type"] == "response.output_text.delta")
    # The include alone: the chosen tokens, no alternatives.
    r = respond(service, input="Tell me about cats.", include=[LOGPROBS], store=False)
    part = text_part(r)
    assert part["logprobs"] and all(e["top_logprobs"] == [] for e in part["logprobs"])
    assert "".join(e["token"] for e in part["logprobs"]) == part["text"]
    # Tools that are not offered (tool_choice "none") leave the text the model's tokens.
    r = respond(
        service,
        input="Tell me about cats.",
        include=[LOGPROBS, "reasoning.encrypted_content"],
        tools=[TOOL],
        tool_choice="none",
        top_logprobs=1,
    )
    part = text_part(r)
    assert part["logprobs"] and all(len(e["top_logprobs"]) == 1 for e in part["logprobs"])


def test_logprobs_of_a_reply_a_stop_string_ends(service: Service) -> None:
    """Text held back while it may start a stop string comes with a later delta; tokens the
    stop string cut away are not listed, the one it begins inside is, whole."""
    body = {**WITH_LOGPROBS, "store": False, "max_output_tokens": 12, "ignore_eos": True}
    plain = text_part(respond(service, **body))
    tokens = [bytes(e["bytes"]) for e in plain["logprobs"]]
    # A stop string from inside the fourth token to inside the fifth (or at their boundary).
    stop_bytes = tokens[3][len(tokens[3]) // 2 :] + tokens[4][:1]
    stop = stop_bytes.decode("utf-8", errors="ignore")
    assert stop, tokens
    cut = plain["text"][: plain["text"].index(stop)]
    r = respond(service, **body, stop=stop)
    part = text_part(r)
    assert part["text"] == cut
    joined = b"".join(bytes(e["bytes"]) for e in part["logprobs"])
    assert joined.startswith(cut.encode())
    assert len(joined) - len(part["logprobs"][-1]["bytes"]) < len(cut.encode())
    assert_same_logprobs(part["logprobs"], plain["logprobs"][: len(part["logprobs"])])
    events = streamed(service, {**body, "stop": stop})
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert_same_logprobs([e for d in deltas for e in d["logprobs"]], part["logprobs"])
