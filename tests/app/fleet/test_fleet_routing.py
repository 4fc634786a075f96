"""Routing with affinity through real HAProxy in front of three replicas: a conversation's turns
stay on one replica and reuse its whole history; so do a keyless stateless client's calls, and
those of a client naming a prompt_cache_key; conversations and keys spread over the replicas;
a WebSocket streams, stops and resumes through the proxy; and a replica whose pinned copy of a
session went stale (another replica served turns in between) reuses only the prefix both share
and produces what a recompute does.

These replicas run without the KV store, so every reuse seen here is a replica's own memory
(the store's part is test_fleet_failover's)."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from websockets.sync.client import connect

from kvchat.app.fleet import Fleet
from kvchat_testing.fleet import Api, fleet_config, metric, wait_for
from kvchat_testing.service import postgres_database


@pytest.fixture(scope="module")
def fleet(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Three replicas behind HAProxy, KV store off."""
    with (
        postgres_database() as url,
        Fleet(
            fleet_config(
                dev_model,
                url,
                tmp_path_factory.mktemp("fleet"),
                num_replicas=3,
                replica_env={"KVCHAT_KV_STORE_BYTES": "0"},
            )
        ) as running,
    ):
        assert running.admin_key is not None
        yield running


def api(fleet: Fleet, replica: str | None = None) -> Api:
    assert fleet.admin_key is not None
    return Api(fleet.replica(replica).url if replica else fleet.url, fleet.admin_key)


def test_a_conversations_ten_turns_are_served_by_one_replica_reusing_its_history(
    fleet: Fleet,
) -> None:
    proxy = api(fleet)
    conv = proxy.new_conversation(system="You answer in a few words.")
    served = [proxy.turn(conv, f"Question {i} of ten: what comes next?") for i in range(10)]
    assert {s.route for s in served} == {"path"}
    assert len({s.replica for s in served}) == 1, [s.replica for s in served]
    for previous, now in itertools.pairwise(served):
        # The whole history before the new message came from the replica's pinned KV.
        assert now.usage["cached_tokens"] >= (
            previous.usage["prompt_tokens"] + previous.usage["completion_tokens"]
        )


def test_a_keyless_client_resending_its_history_stays_on_one_replica(fleet: Fleet) -> None:
    """The openai client with no session header: HAProxy routes each call by the
    conversation's opening, the replica runs it in the session that opening names."""
    client = OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.admin_key, max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": "A system prompt shared by all."},
        {"role": "user", "content": "Hello from a keyless client."},
    ]
    replicas, previous = [], None
    for i in range(10):
        raw = client.chat.completions.with_raw_response.create(
            model="dev", messages=messages, max_tokens=6, temperature=0
        )
        completion = raw.parse()
        assert raw.headers["x-kvchat-route"] == "opening"
        replicas.append(raw.headers["x-kvchat-replica"])
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        if previous is not None:
            # All of the last turn; its last sampled token is pinned in a step after the reply
            # is out, or, when this turn arrives before that step, computed with its new tokens.
            whole = previous.prompt_tokens + previous.completion_tokens
            assert usage.prompt_tokens_details.cached_tokens in (whole - 1, whole)
        previous = usage
        messages += [
            {"role": "assistant", "content": completion.choices[0].message.content},
            {"role": "user", "content": f"And then {i}?"},
        ]
    assert len(set(replicas)) == 1, replicas


def test_a_prompt_cache_key_keeps_its_calls_on_one_replica(fleet: Fleet) -> None:
    """The openai client with a prompt_cache_key and no session header: HAProxy routes each call
    by the key, whatever its messages open with, and the replica runs it in the session the key
    names, reusing the previous call's KV; a store-false response with the key lands there too.
    Twenty keys of fixed names land on more than one replica (a consistent hash of fixed names:
    deterministic), each always on the same one; an X-Session-Id still wins."""
    client = OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.admin_key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Hello from a client with a key."}]
    replicas, previous = [], None
    for i in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model="dev",
            messages=messages,
            max_tokens=6,
            temperature=0,
            prompt_cache_key="fleet-agent",
            prompt_cache_retention="24h",
        )
        completion = raw.parse()
        assert raw.headers["x-kvchat-route"] == "cache_key"
        replicas.append(raw.headers["x-kvchat-replica"])
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        if previous is not None:
            # All of the last turn (its last sampled token is pinned a step after the reply).
            whole = previous.prompt_tokens + previous.completion_tokens
            assert usage.prompt_tokens_details.cached_tokens in (whole - 1, whole)
        previous = usage
        messages += [
            {"role": "assistant", "content": completion.choices[0].message.content},
            {"role": "user", "content": f"And then {i}?"},
        ]
    response = client.responses.with_raw_response.create(
        model="dev",
        input="A different opening, the same key.",
        store=False,
        max_output_tokens=4,
        temperature=0,
        prompt_cache_key="fleet-agent",
    )
    assert response.headers["x-kvchat-route"] == "cache_key"
    replicas.append(response.headers["x-kvchat-replica"])
    assert len(set(replicas)) == 1, replicas

    by_key: dict[str, set[str]] = {}
    for round_ in range(2):
        for n in range(20):
            key = f"cache-key-{n}"
            raw = client.chat.completions.with_raw_response.create(
                model="dev",
                max_tokens=2,
                temperature=0,
                messages=[{"role": "user", "content": f"Round {round_} of {key}."}],
                prompt_cache_key=key,
            )
            assert raw.headers["x-kvchat-route"] == "cache_key"
            by_key.setdefault(key, set()).add(raw.headers["x-kvchat-replica"])
    assert all(len(r) == 1 for r in by_key.values()), by_key
    assert len({next(iter(r)) for r in by_key.values()}) > 1, by_key
    header = client.chat.completions.with_raw_response.create(
        model="dev",
        max_tokens=2,
        temperature=0,
        messages=[{"role": "user", "content": "Both named."}],
        prompt_cache_key="cache-key-0",
        extra_headers={"X-Session-Id": "cache-key-header"},
    )
    assert header.headers["x-kvchat-route"] == "header"


def test_conversations_spread_over_the_replicas(fleet: Fleet) -> None:
    """Twenty session keys of fixed names land on all three replicas (a consistent hash of
    fixed names: deterministic), each key always on the same one; twenty conversations with
    random ids use more than one replica, each always the same."""
    client = OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.admin_key, max_retries=0)
    by_session: dict[str, set[str]] = {}
    for round_ in range(2):
        for user in range(20):
            raw = client.chat.completions.with_raw_response.create(
                model="dev",
                max_tokens=2,
                temperature=0,
                messages=[{"role": "user", "content": f"User {user}, round {round_}."}],
                extra_headers={"X-Session-Id": f"user-{user}"},
            )
            assert raw.headers["x-kvchat-route"] == "header"
            by_session.setdefault(f"user-{user}", set()).add(raw.headers["x-kvchat-replica"])
    assert all(len(replicas) == 1 for replicas in by_session.values()), by_session
    counts = Counter(next(iter(r)) for r in by_session.values())
    assert set(counts) == set(fleet.names), counts

    proxy = api(fleet)
    by_conversation: dict[str, set[str]] = {}
    for i in range(20):
        conv = proxy.new_conversation()
        for j in range(2):
            by_conversation.setdefault(conv, set()).add(
                proxy.turn(conv, f"Conversation {i}, turn {j}", max_tokens=2).replica
            )
    assert all(len(replicas) == 1 for replicas in by_conversation.values())
    assert len({next(iter(r)) for r in by_conversation.values()}) > 1


def test_each_replica_names_itself_and_haproxy_shows_its_stats(fleet: Fleet) -> None:
    for name in fleet.names:
        replica = fleet.replica(name)
        assert httpx.get(f"{replica.url}/healthz").headers["x-kvchat-replica"] == name
        text = httpx.get(f"{replica.url}/metrics").text
        assert f'kvchat:replica_info{{replica="{name}"}} 1.0' in text
    assert fleet.haproxy.server_status() == dict.fromkeys(fleet.names, "UP")
    assert fleet.haproxy.server_status("kvchat_any") == dict.fromkeys(fleet.names, "UP")
    page = httpx.get(fleet.stats_url)
    assert page.status_code == 200 and all(name in page.text for name in fleet.names)
    exporter = httpx.get(f"{fleet.stats_url}metrics").text
    assert "haproxy_server_check_status" in exporter
    # Requests without a routing key go to least connections.
    assert httpx.get(f"{fleet.url}/v1/models").headers["x-kvchat-route"] == "none"


def ws_url(fleet: Fleet, conv: str) -> str:
    return f"ws://127.0.0.1:{fleet.port}/v1/conversations/{conv}/ws"


def frames_until(ws: Any, kind: str) -> list[dict[str, Any]]:
    frames = []
    while True:
        frame = json.loads(ws.recv(timeout=120))
        frames.append(frame)
        if frame["type"] in (kind, "error"):
            return frames


def test_a_websocket_through_haproxy_streams_stops_and_resumes(fleet: Fleet) -> None:
    proxy = api(fleet)
    conv = proxy.new_conversation()
    auth = {"Authorization": f"Bearer {fleet.admin_key}"}
    with connect(ws_url(fleet, conv), additional_headers=auth) as ws:
        assert ws.response is not None
        replica = ws.response.headers["x-kvchat-replica"]
        ws.send(
            json.dumps(
                {"type": "message", "content": "Stream to me", "max_tokens": 5, "temperature": 0}
            )
        )
        frames = frames_until(ws, "done")
        assert frames[0]["type"] == "start" and frames[-1]["status"] == "complete"
        streamed = "".join(f["text"] for f in frames if f["type"] == "delta")
        assert streamed == proxy.messages(conv)[-1]["content"]
        # Stop a long reply.
        ws.send(
            json.dumps(
                {
                    "type": "message",
                    "content": "Go on and on",
                    "max_tokens": 3000,
                    "temperature": 1.0,
                    "ignore_eos": True,
                }
            )
        )
        frames_until(ws, "delta")
        ws.send(json.dumps({"type": "stop"}))
        done = frames_until(ws, "done")[-1]
        assert done["status"] == "cancelled" and done["usage"]["completion_tokens"] < 3000
    # A drop mid-reply, and a resume on a new socket: the rest, no gap, no repeat.
    seen = ""
    with connect(ws_url(fleet, conv), additional_headers=auth) as ws:
        ws.send(
            json.dumps(
                {
                    "type": "message",
                    "content": "A long answer",
                    "max_tokens": 40,
                    "temperature": 1.0,
                    "seed": 3,
                    "ignore_eos": True,
                }
            )
        )
        start = json.loads(ws.recv(timeout=120))
        assert start["type"] == "start"
        while len(seen) < 5:
            frame = json.loads(ws.recv(timeout=120))
            if frame["type"] == "delta":
                assert frame["offset"] == len(seen)
                seen += frame["text"]
    with connect(ws_url(fleet, conv), additional_headers=auth) as ws:
        assert ws.response is not None and ws.response.headers["x-kvchat-replica"] == replica
        ws.send(
            json.dumps({"type": "resume", "message_id": start["message_id"], "offset": len(seen)})
        )
        rest = frames_until(ws, "done")
    text = seen + "".join(f["text"] for f in rest if f["type"] == "delta")
    reply = proxy.messages(conv)[-1]
    assert rest[-1]["type"] == "done" and reply["status"] == "complete"
    assert reply["content"] == text


def test_a_stale_pinned_copy_is_reused_only_where_the_token_ids_agree(fleet: Fleet) -> None:
    """Replica A serves turns 1-3, replica B turns 4-5 (talked to directly), then A turn 6.
    A's pinned KV ends after turn 3: it must reuse exactly that (not B's turns) and produce
    the same greedy reply as replica C recomputing the whole prompt; the lease follows the
    turns and each move is counted."""
    a_name, b_name, c_name = fleet.names
    a, b, c = api(fleet, a_name), api(fleet, b_name), api(fleet, c_name)
    conv = a.new_conversation()

    def session(replica: Api, holder: str) -> dict[str, Any]:
        """The replica's view of the session once the last turn has pinned it and leased it
        to `holder`."""
        return wait_for(
            lambda: (
                (s := replica.http.get(f"/v1/admin/sessions/{conv}").json())["lease_holder"]
                == holder
                and (s["engine"] or {}).get("state") == "resident"
                and s
            )
        )

    def moves(replica: Api) -> float:
        return metric(replica.http.get("/metrics").text, "kvchat:session_moves_total")

    a_moves, b_moves = moves(a), moves(b)
    first = [a.turn(conv, f"Stale test {i}: a message of its own") for i in (1, 2, 3)]
    pinned = session(a, a_name)["engine"]["tokens"]
    assert pinned == first[-1].usage["prompt_tokens"] + first[-1].usage["completion_tokens"]

    fourth = b.turn(conv, "Stale test 4: now on B")
    assert fourth.replica == b_name and fourth.usage["cached_tokens"] == 0  # B recomputes
    fifth = b.turn(conv, "Stale test 5: still on B")
    assert fifth.usage["cached_tokens"] >= (
        fourth.usage["prompt_tokens"] + fourth.usage["completion_tokens"]
    )
    session(b, b_name)
    assert moves(b) == b_moves + 1  # the lease came from A once

    sixth = a.turn(conv, "Stale test 6: back on A")
    assert sixth.replica == a_name
    # A reused its pinned turns 1-3 and nothing of B's: the prefix the two share.
    assert sixth.usage["cached_tokens"] == pinned
    assert sixth.usage["cached_tokens"] < fifth.usage["prompt_tokens"]
    session(a, a_name)
    assert moves(a) == a_moves + 1

    # C has never seen the conversation: it recomputes the sixth prompt from the stored
    # history and must produce the same greedy reply.
    r = c.http.post(
        f"/v1/conversations/{conv}/regenerate", json={"max_tokens": 6, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    fresh = r.json()
    assert fresh["usage"]["cached_tokens"] == 0
    assert fresh["usage"]["prompt_tokens"] == sixth.usage["prompt_tokens"]
    assert fresh["content"] == sixth.body["content"]
    assert fresh["num_tokens"] == sixth.body["num_tokens"]
