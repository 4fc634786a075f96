"""A fleet losing replicas, through real HAProxy: a replica SIGKILLed mid-reply (the retry,
by the openai client, is answered by another replica and nothing acknowledged is lost), and a
rolling restart (SIGTERM each replica in turn while six clients chat: no request fails after
the clients' own retries, no message is lost)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from kvchat.app.fleet import Fleet
from kvchat_testing.fleet import Api, metric

# The openai client's own policy (exponential backoff from 0.5 s, at most 8 s apart) on
# connection errors, 409 (a turn lock another replica still holds), 429 and 5xx.
MAX_RETRIES = 8
BLOCK = 16  # the replicas' KV block size (the default)


def sdk(fleet: Fleet) -> OpenAI:
    return OpenAI(
        base_url=f"{fleet.url}/v1", api_key=fleet.admin_key, max_retries=MAX_RETRIES, timeout=120
    )


def post_turn(client: OpenAI, conv: str, body: dict[str, Any], idempotency_key: str) -> Any:
    """A conversations-API turn through the openai client's generic POST (its retries)."""
    return client.post(
        f"/conversations/{conv}/messages",
        cast_to=object,
        body=body,
        options={"headers": {"Idempotency-Key": idempotency_key}},
    )


def stream_turn(
    client: OpenAI, conv: str, body: dict[str, Any], idempotency_key: str
) -> openai.Stream[object]:
    """A streamed conversations-API turn through the openai client's generic POST."""
    return client.post(  # type: ignore[call-overload, no-any-return]
        f"/conversations/{conv}/messages",
        cast_to=object,
        body=body,
        stream=True,
        stream_cls=openai.Stream[object],
        options={"headers": {"Idempotency-Key": idempotency_key}},
    )


def test_sigkill_mid_reply_the_retry_is_answered_by_another_replica(fleet: Fleet) -> None:
    assert fleet.admin_key is not None
    proxy = Api(fleet.url, fleet.admin_key)
    client = sdk(fleet)
    conv = proxy.new_conversation()
    acked = [proxy.turn(conv, f"An acknowledged turn {i}") for i in (1, 2)]
    holder = acked[0].replica
    assert {s.replica for s in acked} == {holder}
    body = {
        "content": "A reply that will be cut",
        "max_tokens": 60,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
        "stream": True,
    }
    start: dict[str, Any] | None = None
    deltas = 0
    with pytest.raises((httpx.HTTPError, openai.APIError)):  # the stream is cut
        stream = stream_turn(client, conv, body, "cut-1")
        assert stream.response.headers["x-kvchat-replica"] == holder
        for event in stream:
            assert isinstance(event, dict)
            if event["type"] == "start":
                start = event
            elif event["type"] == "delta":
                deltas += 1
                if deltas == 3:
                    fleet.kill(holder)
    assert start is not None and deltas >= 3

    # The client retries the same request (same Idempotency-Key and body).
    retry = stream_turn(client, conv, body, "cut-1")
    other = retry.response.headers["x-kvchat-replica"]
    events = [e for e in retry if isinstance(e, dict)]
    assert other != holder
    assert events[0]["type"] == "start" and events[0]["parent_id"] == start["parent_id"]
    assert events[-1]["type"] == "done" and events[-1]["status"] == "complete"
    text = "".join(e["text"] for e in events if e["type"] == "delta")
    # The other replica never held the conversation: it loaded the acknowledged turns' full
    # blocks from the KV store the holder wrote behind each of them, and computed the rest.
    acked_tokens = acked[-1].usage["prompt_tokens"] + acked[-1].usage["completion_tokens"]
    assert events[-1]["usage"]["cached_tokens"] >= acked_tokens // BLOCK * BLOCK

    tree = proxy.messages(conv, all="true")
    user = [m for m in tree if m["role"] == "user"]
    assert [m["content"] for m in user] == [
        "An acknowledged turn 1",
        "An acknowledged turn 2",
        "A reply that will be cut",
    ]  # stored once
    for served, reply in zip(acked, [m for m in tree if m["role"] == "assistant"]):
        assert (reply["id"], reply["content"], reply["status"]) == (
            served.body["id"],
            served.body["content"],
            "complete",
        )
    cut = next(m for m in tree if m["id"] == start["message_id"])
    assert cut["status"] == "interrupted" and cut["parent_id"] == user[-1]["id"]
    rerun = next(m for m in tree if m["id"] == events[0]["message_id"])
    assert rerun["parent_id"] == user[-1]["id"] and rerun["status"] == "complete"
    assert rerun["content"] == text
    # The conversation goes on where it now lives; the killed replica comes back.
    assert proxy.turn(conv, "Still there?").replica == other
    fleet.start_replica(holder)


@dataclass
class ChatClient:
    """One of the clients chatting through a rolling restart: it records every turn it was
    answered for and every request that failed after the openai client's retries."""

    name: str
    run: Callable[[ChatClient], None]
    answered: list[tuple[str, str, str]] = field(default_factory=list)  # conv, user, reply
    failures: list[str] = field(default_factory=list)
    turns: int = 0
    conversation: str | None = None  # a conversation client's current one
    last_usage: dict[str, int] = field(default_factory=dict)  # of its last answered turn


def conversation_client(fleet: Fleet, stop: threading.Event) -> Callable[[ChatClient], None]:
    def new_conversation(client: OpenAI) -> str:
        return str(client.post("/conversations", cast_to=object, body={})["id"])  # type: ignore[index]

    def run(me: ChatClient) -> None:
        client = sdk(fleet)
        conv = new_conversation(client)
        while not stop.is_set() or me.turns < 3:
            if me.turns and me.turns % 8 == 0:
                conv = new_conversation(client)  # keep prompts short
            content = f"{me.name} turn {me.turns}"
            try:
                reply = post_turn(
                    client,
                    conv,
                    {"content": content, "max_tokens": 4, "temperature": 0},
                    f"{me.name}-{me.turns}",
                )
                assert reply["status"] == "complete", reply
                me.answered.append((conv, content, reply["content"]))
                me.conversation, me.last_usage = conv, reply["usage"]
            except Exception as e:
                me.failures.append(f"{content}: {e!r}")
            me.turns += 1

    return run


def stateless_client(
    fleet: Fleet, stop: threading.Event, session: str | None
) -> Callable[[ChatClient], None]:
    def run(me: ChatClient) -> None:
        client = sdk(fleet)
        headers = {"X-Session-Id": session} if session else {}
        messages: list[Any] = []
        while not stop.is_set() or me.turns < 3:
            if me.turns % 8 == 0:
                messages = [{"role": "system", "content": "Shared by the stateless clients."}]
            messages.append({"role": "user", "content": f"{me.name} turn {me.turns}"})
            try:
                completion = client.chat.completions.create(
                    model="dev",
                    messages=messages,
                    max_tokens=4,
                    temperature=0,
                    extra_headers=headers,
                )
                messages.append(
                    {"role": "assistant", "content": completion.choices[0].message.content}
                )
            except Exception as e:
                me.failures.append(f"turn {me.turns}: {e!r}")
                messages.pop()
            me.turns += 1

    return run


def test_a_rolling_restart_fails_no_request_and_loses_no_message(fleet: Fleet) -> None:
    stop = threading.Event()
    clients = [ChatClient(f"conv{i}", conversation_client(fleet, stop)) for i in range(3)]
    clients += [
        ChatClient("keyless0", stateless_client(fleet, stop, None)),
        ChatClient("keyless1", stateless_client(fleet, stop, None)),
        ChatClient("session0", stateless_client(fleet, stop, "rolling-0")),
    ]
    errors: list[BaseException] = []

    def guarded(client: ChatClient) -> None:
        try:
            client.run(client)
        except BaseException as e:  # a bug in the client itself: the test must see it
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(c,), daemon=True) for c in clients]
    logs = {name: Path(fleet.replica(name).log_path) for name in fleet.names}
    logged = {name: log.stat().st_size if log.exists() else 0 for name, log in logs.items()}
    for thread in threads:
        thread.start()
    codes = {}
    try:
        for name in fleet.names:
            before = sum(c.turns for c in clients)
            codes[name] = fleet.restart(name, signal.SIGTERM)
            assert sum(c.turns for c in clients) > before  # they chatted meanwhile
    finally:
        stop.set()
        for thread in threads:
            thread.join(600)
    assert not errors, errors
    assert all(code in (0, -signal.SIGTERM) for code in codes.values()), codes
    for name in fleet.names:
        log = logs[name].read_bytes()[logged[name] :].decode(errors="replace")
        assert "draining: /readyz answers 503" in log, name
        # Each replica drained its turns before it stopped, and none of them, starting
        # again, took a reply another replica was generating for a dead one's.
        assert "cut off by a restart" not in log, (name, log)
    assert all(c.turns >= 3 for c in clients)
    assert [f for c in clients for f in c.failures] == []

    # Every answered turn is stored once, with the reply its client got, in order.
    proxy = Api(fleet.url, fleet.admin_key or "")
    stored: dict[str, list[tuple[str, str]]] = {}
    for client in clients[:3]:
        for conv, user, reply in client.answered:
            if conv not in stored:
                messages = proxy.messages(conv)
                assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
                assert all(m["status"] == "complete" for m in messages)
                stored[conv] = [
                    (u["content"], r["content"]) for u, r in zip(messages[::2], messages[1::2])
                ]
            assert (user, reply) in stored[conv]
        answered = [(u, r) for conv, u, r in client.answered]
        assert [
            pair
            for conv in dict.fromkeys(c for c, _, _ in client.answered)
            for pair in stored[conv]
        ] == answered

    # Every replica restarted, and none recomputes a conversation: the next turn of each
    # reuses its whole history but the partial last block (from memory or from the KV store).
    after = sdk(fleet)
    for me in clients[:3]:
        assert me.conversation is not None
        reply = post_turn(
            after,
            me.conversation,
            {"content": "After the restarts", "max_tokens": 4, "temperature": 0},
            f"{me.name}-after",
        )
        history = me.last_usage["prompt_tokens"] + me.last_usage["completion_tokens"]
        assert reply["usage"]["cached_tokens"] >= history // BLOCK * BLOCK, (me.name, reply)


def test_a_restarted_replica_loads_its_conversations_from_the_kv_store(fleet: Fleet) -> None:
    """SIGTERM (a drain: the pinned sessions' blocks are in the store before the exit), then
    the same replica back: the conversation's next turn computes only its new tokens and the
    partial last block, the rest loaded from the store."""
    assert fleet.admin_key is not None
    proxy = Api(fleet.url, fleet.admin_key)
    conv = proxy.new_conversation()
    turns = [
        proxy.turn(conv, f"A turn before the restart, number {i}", max_tokens=8) for i in (1, 2, 3)
    ]
    holder = turns[0].replica
    assert {t.replica for t in turns} == {holder}
    assert fleet.restart(holder, signal.SIGTERM) in (0, -signal.SIGTERM)
    direct = Api(fleet.replica(holder).url, fleet.admin_key)
    loaded_before = metric(
        direct.http.get("/metrics").text, 'kvchat:cached_tokens_total{source="kv_store"}'
    )
    after = proxy.turn(conv, "The first turn after the restart", max_tokens=8)
    assert after.replica == holder  # the ring is the same: it comes back to its replica
    history = turns[-1].usage["prompt_tokens"] + turns[-1].usage["completion_tokens"]
    stored = history // BLOCK * BLOCK
    assert after.usage["cached_tokens"] >= stored
    computed = after.usage["prompt_tokens"] - after.usage["cached_tokens"]
    assert computed <= after.usage["prompt_tokens"] - stored
    loaded = (
        metric(direct.http.get("/metrics").text, 'kvchat:cached_tokens_total{source="kv_store"}')
        - loaded_before
    )
    assert loaded == after.usage["cached_tokens"]  # all of it from the store: memory was new


def test_a_hung_replica_leaves_the_rotation_and_its_conversation_goes_on(fleet: Fleet) -> None:
    """SIGSTOP the replica serving a conversation: HAProxy's health checks time out and take it
    out of rotation (seconds: check_timeout_ms), and the conversation's next turn, retried by
    the openai client under its Idempotency-Key, is answered by another replica. SIGCONT brings
    it back."""
    assert fleet.admin_key is not None
    api = Api(fleet.url, fleet.admin_key)
    conv = api.new_conversation()
    victim = api.turn(conv, "Before the hang.").replica
    process = fleet.replica(victim).process
    assert process is not None
    process.send_signal(signal.SIGSTOP)
    try:
        fleet.wait_routed(victim, up=False, timeout=60)
        reply = post_turn(
            sdk(fleet), conv, {"content": "After the hang.", "max_tokens": 6}, "hung-1"
        )
        assert isinstance(reply, dict) and reply["status"] == "complete", reply
        contents = [m["content"] for m in api.messages(conv, limit=100)]
        assert contents.count("After the hang.") == 1
    finally:
        process.send_signal(signal.SIGCONT)
    fleet.wait_routed(victim)
