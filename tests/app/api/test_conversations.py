"""The conversations API in process, on SQLite and on Postgres: history on the server, reuse of
the pinned KV across turns and branches, idempotent retries, one turn at a time."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from tests.app.conftest import Service

REPLY = {"temperature": 0, "max_tokens": 8}


def create(service: Service, key: str | None = None, **fields: Any) -> dict[str, Any]:
    r = service.post("/v1/conversations", fields, key=key)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def say(service: Service, conv_id: str, content: str | None, key: str | None = None,
        headers: dict[str, str] | None = None, **fields: Any) -> Any:
    body = {**REPLY, **fields}
    if content is not None:
        body["content"] = content
    return service.post(f"/v1/conversations/{conv_id}/messages", body, key=key,
                        headers=headers or {})


def branch(service: Service, conv_id: str, **params: Any) -> list[dict[str, Any]]:
    r = service.get(f"/v1/conversations/{conv_id}/messages", params=params)
    assert r.status_code == 200, r.text
    return r.json()["data"]  # type: ignore[no-any-return]


def test_crud_and_pagination_newest_first(service: Service) -> None:
    made = [create(service, title=f"c{i}", metadata={"i": i, "note": "héllo"})["id"]
            for i in range(45)]
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 20, **({"after": cursor} if cursor else {})}
        page = service.get("/v1/conversations", params=params).json()
        seen += [c["id"] for c in page["data"]]
        cursor = page["next_cursor"]
        assert page["has_more"] == (cursor is not None)
        if cursor is None:
            break
    mine = [c for c in seen if c in set(made)]
    assert mine == list(reversed(made))  # newest first, no gaps, no repeats
    conv = service.get(f"/v1/conversations/{made[0]}").json()
    assert conv["metadata"] == {"i": 0, "note": "héllo"}
    patched = service.client.patch(f"/v1/conversations/{made[0]}", headers=service.headers(),
                                   json={"title": "renamed", "max_context_tokens": 900}).json()
    assert patched["title"] == "renamed" and patched["max_context_tokens"] == 900
    r = service.client.delete(f"/v1/conversations/{made[0]}", headers=service.headers())
    assert r.json()["deleted"] is True
    assert service.get(f"/v1/conversations/{made[0]}").status_code == 404
    bad = service.get("/v1/conversations", params={"after": "garbage"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"


def test_another_owners_conversation_is_not_found(service: Service) -> None:
    conv = create(service, title="mine")
    for method, path in (("GET", ""), ("GET", "/messages"), ("DELETE", ""), ("PATCH", "")):
        r = service.client.request(method, f"/v1/conversations/{conv['id']}{path}",
                                   headers=service.headers(service.other_key), json={})
        assert r.status_code == 404, (method, path, r.text)
    r = say(service, conv["id"], "hi", key=service.other_key)
    assert r.status_code == 404
    missing = service.get("/v1/conversations/conv_missing")
    assert missing.status_code == 404 and missing.json()["error"] == say(
        service, "conv_missing", "hi").json()["error"] | {
            "message": missing.json()["error"]["message"]}
    theirs = create(service, key=service.other_key)
    assert service.get(f"/v1/conversations/{theirs['id']}").status_code == 404


def test_five_turns_reuse_everything_before(service: Service) -> None:
    conv = create(service, system="You are a terse assistant.")
    previous = None
    for turn in range(5):
        r = say(service, conv["id"], f"Tell me fact number {turn}.")
        assert r.status_code == 200, r.text
        message = r.json()
        assert message["role"] == "assistant" and message["status"] == "complete"
        usage = message["usage"]
        assert message["timings"]["ttft_ms"] > 0 and message["timings"]["total_ms"] > 0
        if previous is not None:
            assert usage["cached_tokens"] >= previous["prompt_tokens"] + previous[
                "completion_tokens"]
        previous = usage
    stored = branch(service, conv["id"])
    assert [m["role"] for m in stored] == ["user", "assistant"] * 5
    assert all(m["status"] == "complete" for m in stored)
    assert stored[-1]["usage"] == previous


def test_streamed_turn_events_and_the_stored_message(service: Service) -> None:
    conv = create(service)
    with service.client.stream("POST", f"/v1/conversations/{conv['id']}/messages",
                               headers=service.headers(),
                               json={"content": "Stream please", "stream": True, **REPLY}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[0] == "start" and types[-1] == "done"
    assert set(types[1:-1]) <= {"delta"}
    text = "".join(e["text"] for e in events if e["type"] == "delta")
    offsets = [e["offset"] for e in events if e["type"] == "delta"]
    assert offsets == sorted(offsets) and (not offsets or offsets[0] == 0)
    stored = branch(service, conv["id"])[-1]
    assert stored["id"] == events[0]["message_id"] == events[-1]["message_id"]
    assert stored["content"] == text
    assert events[-1]["usage"]["completion_tokens"] == stored["usage"]["completion_tokens"]


def test_edit_an_earlier_message_branches_and_reuses_the_shared_prefix(service: Service) -> None:
    conv = create(service, system="You answer in one short sentence. " * 4)
    first = say(service, conv["id"], "First question, about rivers.").json()
    say(service, conv["id"], "Second question, about mountains.")
    old = branch(service, conv["id"])
    user1 = old[0]
    # Edit the first user message: a sibling of it, under the root.
    edited = say(service, conv["id"], "First question, about lakes.", parent_id="root").json()
    now = branch(service, conv["id"])
    assert [m["role"] for m in now] == ["user", "assistant"]
    assert now[0]["id"] != user1["id"] and now[0]["siblings"] == [user1["id"], now[0]["id"]]
    # The system prompt and what the two first messages share came from the pinned session.
    assert edited["usage"]["cached_tokens"] > 0
    assert edited["usage"]["cached_tokens"] < first["usage"]["prompt_tokens"]
    # Switch back to the first branch: its newest leaf.
    back = branch(service, conv["id"], leaf=user1["id"])
    assert [m["id"] for m in back] == [m["id"] for m in old]
    tree = branch(service, conv["id"], all="true")
    assert len(tree) == 6
    roots = [m for m in tree if m["parent_id"] is None]
    assert len(roots) == 2 and roots[0]["children"]


def test_regenerate_adds_a_sibling_reply(service: Service) -> None:
    conv = create(service)
    reply = say(service, conv["id"], "Say something.").json()
    again = service.post(f"/v1/conversations/{conv['id']}/regenerate",
                         {"temperature": 1.0, "seed": 3, "max_tokens": 6}).json()
    assert again["parent_id"] == reply["parent_id"] and again["id"] != reply["id"]
    assert again["siblings"] == [reply["id"], again["id"]]
    # The prompt is the same as the first reply's: all of it but the last token is reused.
    assert again["usage"]["cached_tokens"] == reply["usage"]["prompt_tokens"] - 1
    also = say(service, conv["id"], None, parent_id=reply["parent_id"], max_tokens=4).json()
    assert also["parent_id"] == reply["parent_id"]


def test_idempotent_retry_returns_the_first_message_and_appends_once(service: Service) -> None:
    conv = create(service)
    headers = {"Idempotency-Key": "retry-1"}
    first = say(service, conv["id"], "Once only", headers=headers).json()
    second = say(service, conv["id"], "Once only", headers=headers).json()
    assert second["id"] == first["id"] and second["content"] == first["content"]
    assert len(branch(service, conv["id"])) == 2
    different = say(service, conv["id"], "Something else", headers=headers)
    assert different.status_code == 400
    assert different.json()["error"]["code"] == "idempotency_key_reused"


def test_a_second_concurrent_turn_is_busy(service: Service) -> None:
    conv = create(service)
    results: dict[str, Any] = {}
    started = threading.Event()

    def long_turn() -> None:
        started.set()
        results["long"] = say(service, conv["id"], "Go on and on", max_tokens=400,
                              temperature=1.0, ignore_eos=True)

    thread = threading.Thread(target=long_turn)
    thread.start()
    started.wait()
    for _ in range(200):  # until the first turn holds the conversation
        if conv["id"] in service.state.turns:
            break
        threading.Event().wait(0.01)
    busy = say(service, conv["id"], "Me too")
    assert busy.status_code == 409, busy.text
    assert busy.json()["error"]["code"] == "conversation_busy"
    assert "x-should-retry" not in busy.headers
    stop = service.post(f"/v1/conversations/{conv['id']}/stop", {})
    assert stop.json()["stopped"] is True
    thread.join(60)
    long = results["long"].json()
    assert long["status"] == "cancelled" and long["finish_reason"] == "cancelled"
    assert long["usage"]["completion_tokens"] < 400
    assert say(service, conv["id"], "Now me").status_code == 200


def test_tool_result_turns(service: Service) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    conv = create(service)
    say(service, conv["id"], "Look it up", tools=tools)
    orphan = say(service, conv["id"], "result", role="tool", tool_call_id="call_x", tools=tools)
    assert orphan.status_code == 400 and "tool" in orphan.json()["error"]["message"]
    assert len(branch(service, conv["id"])) == 2  # the refused message was not stored


def test_bad_conversation_requests(service: Service) -> None:
    conv = create(service)
    cases = [
        ({"max_tokens": 0, "content": "x"}, "max_tokens"),
        ({"content": "x", "parent_id": "msg_nope"}, "parent_id"),
        ({"temperature": -1, "content": "x"}, "temperature"),
        ({"content": "x", "role": "system"}, "role"),
        ({}, "content"),
    ]
    for body, param in cases:
        r = service.post(f"/v1/conversations/{conv['id']}/messages", body)
        assert r.status_code in (400, 404), r.text
        assert r.json()["error"]["param"] == param, (body, r.text)
    assert branch(service, conv["id"]) == []
    r = service.post("/v1/conversations", {"history_policy": "forget"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "history_policy"
    r = service.post("/v1/conversations", {"max_context_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_context_tokens"


@pytest.mark.parametrize("policy", ["drop", "summarize"])
def test_history_is_trimmed_to_the_conversation_budget(service: Service, policy: str) -> None:
    conv = create(service, max_context_tokens=200, history_policy=policy,
                  max_summary_tokens=16)
    cached = []
    for turn in range(12):
        r = say(service, conv["id"], f"Message {turn}: " + "words to fill the budget " * 3)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + REPLY["max_tokens"] <= 200
        cached.append(usage["cached_tokens"])
    info = service.state.runtime.engine.session_history(conv["id"])
    assert info["trims"] >= 1
    # Most turns (all but those that trimmed) reuse the pinned prefix.
    assert sum(1 for c in cached[1:] if c > 0) >= len(cached[1:]) - info["trims"] - 1


def settle_background(service: Service, timeout: float = 120.0) -> None:
    """Wait until the background work the turns spawned (summaries) has finished; the
    timeout is only a safety net."""

    async def settle() -> None:
        async with asyncio.timeout(timeout):
            while service.state.background:
                await asyncio.wait(list(service.state.background))

    service.client.portal.call(settle)


def test_a_summary_never_locks_a_small_budget_conversation_out(service: Service) -> None:
    # Budget 256 under summarize, with the default max_summary_tokens (512): the summary that
    # lands must fit beside the next turns, even ones that reserve only 4 tokens.
    conv = create(service, max_context_tokens=256, history_policy="summarize")["id"]
    store = service.state.store
    for turn in range(40):
        r = say(service, conv, f"Message {turn}: " + "words to fill the budget " * 3,
                max_tokens=8)
        assert r.status_code == 200, r.text
        settle_background(service)
        made = service.client.portal.call(store.latest_summary, conv)
        if made is not None:
            break
    assert made is not None, "no summary landed"
    assert made.text and made.num_tokens <= 256 // 4  # generated within its share
    for turn in range(6):
        r = say(service, conv, f"After the summary {turn}: a short one", max_tokens=4)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] + 4 <= 256
        settle_background(service)
    made = service.client.portal.call(store.latest_summary, conv)
    assert made is not None and made.num_tokens <= 256 // 4
    # The owner lowers the budget to 64: that summary no longer fits beside a turn, so the
    # turn goes on without it (later summaries are made to the new share, 16 tokens).
    r = service.client.patch(f"/v1/conversations/{conv}", json={"max_context_tokens": 64},
                             headers=service.headers())
    assert r.status_code == 200, r.text
    for turn in range(3):
        r = say(service, conv, f"Lowered {turn}", max_tokens=4)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + 4 <= 64
        if turn == 0:
            assert usage["prompt_tokens"] < made.num_tokens  # the summary was left out
        settle_background(service)
    latest = service.client.portal.call(store.latest_summary, conv)
    assert latest is not None and latest.num_tokens <= 64 // 4
    assert service.state.runtime.engine.session_history(conv)["summaries"] >= 2
