"""The conversations API in process, on SQLite and on Postgres: history on the server, reuse of
the pinned KV across turns and branches, idempotent retries, one turn at a time."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from kvchat.history import end_at_sentence, facts, missing_facts
from kvchat_testing.app_service import Service

REPLY = {"temperature": 0, "max_tokens": 8}


def create(service: Service, key: str | None = None, **fields: Any) -> dict[str, Any]:
    r = service.post("/v1/conversations", fields, key=key)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def say(
    service: Service,
    conv_id: str,
    content: str | None,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    **fields: Any,
) -> Any:
    body = {**REPLY, **fields}
    if content is not None:
        body["content"] = content
    return service.post(
        f"/v1/conversations/{conv_id}/messages", body, key=key, headers=headers or {}
    )


def branch(service: Service, conv_id: str, **params: Any) -> list[dict[str, Any]]:
    r = service.get(f"/v1/conversations/{conv_id}/messages", params=params)
    assert r.status_code == 200, r.text
    return r.json()["data"]  # type: ignore[no-any-return]


def test_crud_and_pagination_newest_first(service: Service) -> None:
    made = [
        create(service, title=f"c{i}", metadata={"i": i, "note": "héllo"})["id"] for i in range(45)
    ]
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
    patched = service.client.patch(
        f"/v1/conversations/{made[0]}",
        headers=service.headers(),
        json={"title": "renamed", "max_context_tokens": 900},
    ).json()
    assert patched["title"] == "renamed" and patched["max_context_tokens"] == 900
    r = service.client.delete(f"/v1/conversations/{made[0]}", headers=service.headers())
    assert r.json()["deleted"] is True
    assert service.get(f"/v1/conversations/{made[0]}").status_code == 404
    bad = service.get("/v1/conversations", params={"after": "garbage"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"


def test_another_owners_conversation_is_not_found(service: Service) -> None:
    conv = create(service, title="mine")
    for method, path in (("GET", ""), ("GET", "/messages"), ("DELETE", ""), ("PATCH", "")):
        r = service.client.request(
            method,
            f"/v1/conversations/{conv['id']}{path}",
            headers=service.headers(service.other_key),
            json={},
        )
        assert r.status_code == 404, (method, path, r.text)
    r = say(service, conv["id"], "hi", key=service.other_key)
    assert r.status_code == 404
    missing = service.get("/v1/conversations/conv_missing")
    assert missing.status_code == 404 and missing.json()["error"] == say(
        service, "conv_missing", "hi"
    ).json()["error"] | {"message": missing.json()["error"]["message"]}
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
            assert (
                usage["cached_tokens"] >= previous["prompt_tokens"] + previous["completion_tokens"]
            )
        previous = usage
    stored = branch(service, conv["id"])
    assert [m["role"] for m in stored] == ["user", "assistant"] * 5
    assert all(m["status"] == "complete" for m in stored)
    assert stored[-1]["usage"] == previous


def test_streamed_turn_events_and_the_stored_message(service: Service) -> None:
    conv = create(service)
    with service.client.stream(
        "POST",
        f"/v1/conversations/{conv['id']}/messages",
        headers=service.headers(),
        json={"content": "Stream please", "stream": True, **REPLY},
    ) as r:
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
    again = service.post(
        f"/v1/conversations/{conv['id']}/regenerate",
        {"temperature": 1.0, "seed": 3, "max_tokens": 6},
    ).json()
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
        results["long"] = say(
            service, conv["id"], "Go on and on", max_tokens=400, temperature=1.0, ignore_eos=True
        )

    thread = threading.Thread(target=long_turn)
    thread.start()
    started.wait()
    for _ in range(200):  # until the first turn holds the conversation
        if service.state.turns.running(conv["id"]) is not None:
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
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
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


def test_a_turn_is_checked_once_under_its_conversation_budget(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn's request is checked when it is planned, against the budget the conversation
    stores, and that checked request is what runs: no second check when it is queued."""
    checker = service.state.runtime.engine_client.engine.checker
    real = checker.check
    calls: list[tuple[Any, ...]] = []

    def counting(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(checker, "check", counting)
    conv = create(service, max_context_tokens=300, max_kv_tokens=64)
    r = say(service, conv["id"], "Hello there.")
    assert r.status_code == 200, r.text
    assert len(calls) == 1
    _, _, session_id, budget = calls[0]
    assert session_id == conv["id"]
    assert (budget.max_context_tokens, budget.max_kv_tokens) == (300, 64)


def test_a_turn_past_its_kv_budget_counts_as_a_window_turn(service: Service) -> None:
    """The engine says on a turn's final output that sink + window attention applied; the
    service counts it in the session's history (the engine keeps no history counters)."""
    conv = create(service, max_kv_tokens=48)
    history = service.state.runtime.history
    r = say(service, conv["id"], "Hi.", max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] + 4 < 48
    assert history.session(conv["id"]).window_turns == 0
    total = history.total().window_turns
    r = say(service, conv["id"], "Go on.", max_tokens=64, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 64
    assert history.session(conv["id"]).window_turns == 1
    assert history.total().window_turns == total + 1


@pytest.mark.parametrize("policy", ["drop", "summarize"])
def test_history_is_trimmed_to_the_conversation_budget(service: Service, policy: str) -> None:
    conv = create(service, max_context_tokens=200, history_policy=policy, max_summary_tokens=16)
    cached = []
    for turn in range(12):
        r = say(service, conv["id"], f"Message {turn}: " + "words to fill the budget " * 3)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + REPLY["max_tokens"] <= 200
        cached.append(usage["cached_tokens"])
    info = service.state.runtime.history.session(conv["id"])
    assert info.trims >= 1
    # Most turns (all but those that trimmed) reuse the pinned prefix.
    assert sum(1 for c in cached[1:] if c > 0) >= len(cached[1:]) - info.trims - 1


def patch(service: Service, conv_id: str, body: dict[str, Any], key: str | None = None) -> Any:
    return service.client.patch(
        f"/v1/conversations/{conv_id}", headers=service.headers(key), json=body
    )


def listed(service: Service, conv_id: str) -> dict[str, Any]:
    r = service.get("/v1/conversations", params={"limit": 100})
    assert r.status_code == 200, r.text
    (conv,) = [c for c in r.json()["data"] if c["id"] == conv_id]
    return conv  # type: ignore[no-any-return]


def test_settings_are_checked_together_with_what_is_stored(service: Service) -> None:
    conv = create(service, low_watermark=0.6)
    r = patch(service, conv["id"], {"high_watermark": 0.3})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "high_watermark"
    assert "low_watermark 0.6: stored" in error["message"], error["message"]
    # Nothing was written: the conversation reads, lists and runs a turn as before.
    got = service.get(f"/v1/conversations/{conv['id']}")
    assert got.status_code == 200, got.text
    assert (got.json()["low_watermark"], got.json()["high_watermark"]) == (0.6, None)
    assert listed(service, conv["id"])["high_watermark"] is None
    assert say(service, conv["id"], "Still fine?").status_code == 200
    # A change that fits is written; the next one is checked against it.
    assert patch(service, conv["id"], {"high_watermark": 0.7}).json()["high_watermark"] == 0.7
    r = patch(service, conv["id"], {"low_watermark": 0.9, "title": "not written either"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "low_watermark"
    assert service.get(f"/v1/conversations/{conv['id']}").json()["title"] is None
    # Back to the default is checked too: the default high_watermark (0.8) is under 0.85.
    assert (
        patch(service, conv["id"], {"low_watermark": 0.85, "high_watermark": 0.9}).status_code
        == 200
    )
    r = patch(service, conv["id"], {"high_watermark": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "high_watermark"
    assert "high_watermark 0.8: the server default" in r.json()["error"]["message"]
    # At creation, over the defaults, naming the field even when both come in one body.
    r = service.post("/v1/conversations", {"low_watermark": 0.9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "low_watermark"
    r = service.post("/v1/conversations", {"low_watermark": 0.9, "high_watermark": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "high_watermark"
    assert create(service, low_watermark=0.9, high_watermark=0.95)["low_watermark"] == 0.9


@pytest.mark.parametrize(
    "stored, param",
    [
        ({"low_watermark": 0.6, "high_watermark": 0.3}, "high_watermark"),
        ({"max_context_tokens": 5}, "max_context_tokens"),
        ({"max_kv_tokens": -1}, "max_kv_tokens"),
        ({"history_policy": "forget"}, "history_policy"),
        ({"max_tool_result_tokens": 3}, "max_tool_result_tokens"),
    ],
)
def test_a_stored_row_the_checks_refuse_still_lists_and_its_turn_says_why(
    service: Service, stored: dict[str, Any], param: str
) -> None:
    conv = create(service, title="written by hand")
    # As a row from before settings were checked together (or edited by hand) holds them.
    service.client.portal.call(
        lambda: service.state.store.update_conversation("alice", conv["id"], **stored)
    )
    got = service.get(f"/v1/conversations/{conv['id']}")
    assert got.status_code == 200, got.text
    assert {k: got.json()[k] for k in stored} == stored
    assert {k: listed(service, conv["id"])[k] for k in stored} == stored
    r = say(service, conv["id"], "Hello?")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_session_settings"
    assert f"PATCH /v1/conversations/{conv['id']}" in error["message"]
    assert branch(service, conv["id"]) == []  # the refused turn stored nothing
    # The owner repairs it.
    repaired = patch(service, conv["id"], {name: None for name in stored})
    assert repaired.status_code == 200, repaired.text
    assert say(service, conv["id"], "Hello again.").status_code == 200


def test_another_owners_conversation_never_tells_whether_a_message_exists(service: Service) -> None:
    conv = create(service)
    reply = say(service, conv["id"], "Hi").json()
    answers = [
        patch(service, conv["id"], {"current_leaf_id": leaf}, key=service.other_key)
        for leaf in (reply["id"], "msg_missing")
    ]
    assert [a.status_code for a in answers] == [404, 404]
    assert answers[0].json() == answers[1].json()
    assert answers[0].json()["error"]["param"] is None
    assert "conversation" in answers[0].json()["error"]["message"]
    # The owner is told which message is missing, and nothing changed for the refusals.
    own = patch(service, conv["id"], {"current_leaf_id": "msg_missing"})
    assert own.status_code == 404 and own.json()["error"]["param"] == "current_leaf_id"
    assert service.get(f"/v1/conversations/{conv['id']}").json()["current_leaf_id"] == reply["id"]


def test_a_summary_for_a_conversation_deleted_meanwhile_ends_quietly(
    service: Service, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio
    import logging

    state = service.state
    conv = create(
        service, max_context_tokens=200, history_policy="summarize", max_summary_tokens=8
    )["id"]
    real = state.store.add_summary
    reached = threading.Event()
    proceed = asyncio.Event()
    jobs: list[asyncio.Task[Any]] = []

    async def held(conversation_id: str, **fields: Any) -> Any:
        """The summary is made: hold it here, before it is stored, until the test says."""
        task = asyncio.current_task()
        assert task is not None
        jobs.append(task)
        reached.set()
        await proceed.wait()
        return await real(conversation_id, **fields)

    monkeypatch.setattr(state.store, "add_summary", held)
    for turn in range(12):  # until a turn drops messages, which starts a summary
        r = say(service, conv, f"Message {turn}: " + "words to fill the budget " * 3)
        assert r.status_code == 200, r.text
        if state.runtime.history.session(conv).trims:
            break
    assert reached.wait(120), "no summary was started"
    deleted = service.client.delete(f"/v1/conversations/{conv}", headers=service.headers())
    assert deleted.status_code == 200, deleted.text
    caplog.set_level(logging.DEBUG, logger="kvchat.app.turns.pipeline")
    service.client.portal.call(proceed.set)
    service.client.portal.call(asyncio.wait_for, jobs[0], 60)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
    assert any(conv in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
    assert service.client.portal.call(real.__self__.latest_summary, conv) is None
    assert state.runtime.history.session(conv).summaries == 0


# -- a turn's end, whatever happens around it ------------------------------------------------------

LONG_REPLY = {"max_tokens": 400, "temperature": 1.0, "ignore_eos": True}


def sse_events(response: Any) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")
    ]


def test_a_delete_racing_a_turn_never_hangs_or_fails(service: Service) -> None:
    """DELETE sent 0-20 ms after POST .../messages: the turn is stopped and stored, then the
    conversation deleted; the POST answers 200 (the reply as stored) or 404 (the delete came
    first), never 500 or a hang; nothing is left running or locked."""
    outcomes = []
    for attempt in range(12):
        conv = create(service)["id"]
        answers: dict[str, Any] = {}
        posting = threading.Thread(
            target=lambda c=conv, out=answers: out.update(
                post=say(service, c, "Race me", **LONG_REPLY)
            )
        )
        posting.start()
        threading.Event().wait((attempt % 6) * 0.004)
        deleted = service.client.delete(f"/v1/conversations/{conv}", headers=service.headers())
        posting.join(120)
        assert not posting.is_alive(), "the POST hung"
        assert deleted.status_code == 200, deleted.text
        post = answers["post"]
        assert post.status_code in (200, 404), post.text
        if post.status_code == 404:
            assert post.json()["error"]["code"] in ("conversation_not_found", "not_found")
        else:
            assert post.json()["status"] in ("cancelled", "complete")
        outcomes.append(post.status_code)
        assert service.get(f"/v1/conversations/{conv}").status_code == 404
        assert service.state.turns.running(conv) is None
        holder = service.client.portal.call(
            lambda c=conv: service.state.coord.lock_holder(f"turn:{c}")
        )
        assert holder is None
    assert set(outcomes) <= {200, 404}


def test_a_conversation_deleted_under_a_turn_ends_it_with_one_404(service: Service) -> None:
    """The store loses the conversation while its reply is generated (deleted around the
    turn lock, as an operator's SQL would): the turn still ends with exactly one terminal
    event, a 404 error, and frees its lock."""
    conv = create(service)["id"]
    state, portal = service.state, service.client.portal
    answers: dict[str, Any] = {}
    posting = threading.Thread(
        target=lambda: answers.update(
            post=say(service, conv, "Delete me", stream=True, **LONG_REPLY)
        )
    )
    posting.start()
    deadline = threading.Event()
    for _ in range(6000):
        turn = state.turns.running(conv)
        if turn is not None and turn.text_sent:
            break
        deadline.wait(0.01)
    assert portal.call(lambda: state.store.delete_conversation("alice", conv))
    posting.join(120)
    assert not posting.is_alive()
    events = sse_events(answers["post"])
    terminal = [e for e in events if e["type"] in ("done", "error")]
    assert len(terminal) == 1 and terminal[0] == events[-1]
    assert terminal[0]["type"] == "error" and terminal[0]["code"] == "conversation_not_found"
    assert state.turns.running(conv) is None
    assert portal.call(lambda: state.coord.lock_holder(f"turn:{conv}")) is None


def test_a_reply_that_cannot_be_stored_still_ends_the_turn(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An injected fault: the final write of the reply fails. The stream gets one error
    event, the lock is released, the conversation takes its next turn."""
    conv = create(service)["id"]
    store = service.state.store
    real = store.update_message

    async def failing(message_id: str, **fields: Any) -> Any:
        if "status" in fields:  # the final write, not a checkpoint
            raise RuntimeError("disk full")
        return await real(message_id, **fields)

    monkeypatch.setattr(store, "update_message", failing)
    r = say(service, conv, "Store me", stream=True)
    monkeypatch.setattr(store, "update_message", real)
    events = sse_events(r)
    assert [e["type"] for e in events].count("error") == 1 and events[-1]["type"] == "error"
    assert events[-1]["code"] == "internal_error"
    assert not [e for e in events if e["type"] == "done"]
    after = say(service, conv, "And now?")
    assert after.status_code == 200, after.text


def settle_background(service: Service, timeout: float = 120.0) -> None:
    """Wait until the background work the turns spawned (summaries) has finished; the
    timeout is only a safety net."""

    async def settle() -> None:
        async with asyncio.timeout(timeout):
            while service.state.tasks:
                await service.state.tasks.wait(timeout)

    service.client.portal.call(settle)


def test_a_summary_never_locks_a_small_budget_conversation_out(service: Service) -> None:
    # Budget 256 under summarize, with the default max_summary_tokens (512): the summary that
    # lands must fit beside the next turns, even ones that reserve only 4 tokens.
    conv = create(service, max_context_tokens=256, history_policy="summarize")["id"]
    store = service.state.store
    for turn in range(40):
        r = say(service, conv, f"Message {turn}: " + "words to fill the budget " * 3, max_tokens=8)
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
    # turn goes on without it.
    r = service.client.patch(
        f"/v1/conversations/{conv}", json={"max_context_tokens": 64}, headers=service.headers()
    )
    assert r.status_code == 200, r.text
    for turn in range(3):
        r = say(service, conv, f"Lowered {turn}", max_tokens=4)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + 4 <= 64
        if turn == 0:
            assert usage["prompt_tokens"] < made.num_tokens  # the summary was left out
        settle_background(service)
    # A later summary is made to the new share (16 tokens), or, when not even the oldest
    # message's facts fit one, none is: the turns go on without a summary.
    latest = service.client.portal.call(store.latest_summary, conv)
    assert latest is not None
    assert latest.id == made.id or latest.num_tokens <= 64 // 4
    if latest.id == made.id:  # that job is not run again until a trim changes what it folds
        covered, newly = service.state.turns.planner.unsummarized[conv]
        assert covered == tuple(made.covers) and newly


def test_a_stored_summary_states_the_facts_of_every_message_it_covers(service: Service) -> None:
    # Random weights write no summary worth keeping: each one the service stores is the
    # extract, which states every number and name of the user messages it claims to cover.
    conv = create(service, max_context_tokens=256, history_policy="summarize")["id"]
    store = service.state.store
    people = ["Ada", "Bruno", "Carmen", "Dmitri", "Esther", "Farid", "Greta", "Hugo", "Ines"]
    summaries = []
    for turn in range(45):
        if turn % 3 == 0:
            text = f"My friend {people[turn // 3 % len(people)]} lives at number {turn + 10}."
        else:
            text = "just some words to fill the budget " * 2
        r = say(service, conv, text, max_tokens=8)
        assert r.status_code == 200, r.text
        settle_background(service)
        made = service.client.portal.call(store.latest_summary, conv)
        if made is not None and (not summaries or made.id != summaries[-1].id):
            summaries.append(made)
        if len(summaries) >= 3:
            break
    assert len(summaries) >= 3, "too few summaries landed"
    content = {m["id"]: m for m in branch(service, conv, limit=100)}
    for made in summaries:
        said = [content[i]["content"] for i in made.covers if content[i]["role"] == "user"]
        assert missing_facts(made.text, set().union(*map(facts, said))) == []
        assert end_at_sentence(made.text) == made.text  # never ends mid-sentence
        assert made.num_tokens <= 256 // 4
    assert "My friend Ada lives at number 10." in summaries[0].text
    history = service.state.runtime.history.session(conv)
    assert history.summaries_extracted == history.summaries >= 3
    metrics = service.get("/metrics").text.splitlines()
    line = next(m for m in metrics if m.startswith("kvchat:history_summaries_extracted_total "))
    assert float(line.split()[1]) >= history.summaries_extracted  # every session's, summed


def test_a_turn_cut_off_by_a_lost_lock_is_run_again_by_its_retry(
    dev_model: Path, tmp_path: Path
) -> None:
    """A process that hangs past its turn lock's TTL (here: its lock released under it, an
    injected fault) stops its turn; the client's retry with the same key and body gets a new
    reply, not the cut-off one, and a further retry replays that new reply."""
    from fastapi.testclient import TestClient

    from kvchat.app.main import create_app
    from kvchat.app.turns.service import lock_key
    from kvchat_testing.app_service import service_settings

    settings = service_settings(dev_model, tmp_path, None).model_copy(update={"turn_lock_ttl": 0.6})
    app = create_app(settings)
    with TestClient(app) as client:
        state = app.state.kvchat
        _, key = client.portal.call(state.store.create_key, "alice")
        auth = {"Authorization": f"Bearer {key}"}
        conv = client.post("/v1/conversations", json={}, headers=auth).json()["id"]
        retry = {**auth, "Idempotency-Key": "cut-off-1"}
        body = {"content": "Go on and on", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with client.stream(
            "POST", f"/v1/conversations/{conv}/messages", json=body, headers=retry
        ) as r:
            lines = r.iter_lines()
            for line in lines:
                if '"delta"' in line:  # generating: its lock is held
                    break
            turn = state.turns.running(conv)
            assert turn is not None and turn.lock_token is not None
            client.portal.call(state.coord.lock_release, lock_key(conv), turn.lock_token)
            rest = "\n".join(lines)
        assert '"cancelled"' in rest, rest[-500:]
        assert turn.lock_lost
        first = branch(client_service(client, auth), conv)[-1]
        assert first["status"] == "cancelled"

        again = client.post(f"/v1/conversations/{conv}/messages", json=body, headers=retry)
        assert again.status_code == 200, again.text
        done = [m for m in branch(client_service(client, auth), conv)]
        assert done[-1]["status"] == "complete" and done[-1]["id"] != first["id"]
        replay = client.post(f"/v1/conversations/{conv}/messages", json=body, headers=retry)
        assert replay.status_code == 200
        assert done[-1]["id"] in replay.text
        users = [m for m in done if m["role"] == "user"]
        assert len(users) == 1  # the user's message was stored once


def client_service(client: Any, auth: dict[str, str]) -> Any:
    """Enough of a Service for branch(): its get() with this key."""

    class Reader:
        def get(self, path: str, **kw: Any) -> Any:
            return client.get(path, headers=auth, **kw)

    return Reader()
