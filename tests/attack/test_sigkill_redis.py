"""SIGKILL in the middle of a streamed reply, on Postgres + Redis: a streaming
`POST /v1/conversations/{id}/messages` with an `Idempotency-Key` is cut off by killing the
server; the server is started again on the same database and Redis prefix. Then, at once: the
conversation takes a new turn, the killed request retried with its key gets a clear answer
(not a hang, not 409 for as long as a lock or a record left in Redis lives), and the reply it
interrupted kept the text its client had seen.

The 10-second windows are the contract (what a client retrying after a crash may expect),
far apart from what a leftover lock or record costs (its TTL: an hour, a day)."""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvchat_testing.attack_servers import restarted, started_server
from kvchat_testing.service import Server

WINDOW_S = 10.0  # a crash's leftovers must not hold a conversation longer than this
DELTAS_BEFORE_KILL = 24
STREAM = {
    "content": "Please write at length",
    "max_tokens": 3000,
    "temperature": 1.0,
    "ignore_eos": True,
    "stream": True,
}


@dataclass
class Crash:
    server: Server  # the restarted server
    ready_at: float  # time.monotonic() when it answered /readyz
    conversation: str
    idempotency_key: str
    message_id: str  # the interrupted reply
    seen: str  # the text its client had been sent before the kill
    stored: list[dict[str, Any]]  # the conversation as the restarted server first shows it


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[6:])


@pytest.fixture(scope="module")
def crash(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Crash]:
    with started_server(dev_model, tmp_path_factory.mktemp("data"), "postgres+redis") as first:
        conv = httpx.post(
            f"{first.url}/v1/conversations",
            headers=first.headers(),
            json={"title": "killed"},
            timeout=60,
        ).json()["id"]
        key = f"retry-{uuid.uuid4().hex}"
        seen, message_id, deltas = "", None, 0
        with httpx.stream(
            "POST",
            f"{first.url}/v1/conversations/{conv}/messages",
            headers={**first.headers(), "Idempotency-Key": key},
            json=STREAM,
            timeout=120,
        ) as r:
            assert r.status_code == 200, r.read()
            for event in sse_events(r):
                if event["type"] == "start":
                    message_id = event["message_id"]
                elif event["type"] == "delta":
                    seen = seen[: event["offset"]] + event["text"]
                    deltas += 1
                    if deltas == DELTAS_BEFORE_KILL:
                        first.stop(signal.SIGKILL)
                        break
                else:
                    pytest.fail(f"the reply ended before the kill: {event}")
        assert first.process is not None and first.process.returncode == -signal.SIGKILL
        assert message_id is not None and seen
        server = restarted(first)
        ready_at = time.monotonic()
        try:
            stored = httpx.get(
                f"{server.url}/v1/conversations/{conv}/messages",
                headers=server.headers(),
                timeout=60,
            ).json()["data"]
            yield Crash(server, ready_at, conv, key, message_id, seen, stored)
        finally:
            server.stop()


def test_the_conversation_takes_a_new_turn_at_once(crash: Crash) -> None:
    server = crash.server
    while True:
        sent_at = time.monotonic()
        r = httpx.post(
            f"{server.url}/v1/conversations/{crash.conversation}/messages",
            headers=server.headers(),
            json={"content": "Are you back?", "max_tokens": 8},
            timeout=120,
        )
        if r.status_code != 409 or sent_at - crash.ready_at > WINDOW_S:
            break
        time.sleep(0.2)
    assert r.status_code == 200, (
        f"{sent_at - crash.ready_at:.1f} s after the restart",
        r.status_code,
        r.text[:300],
    )
    assert sent_at - crash.ready_at <= WINDOW_S
    assert r.json()["status"] == "complete"


def test_the_killed_request_retried_with_its_key_gets_a_clear_answer(crash: Crash) -> None:
    """A replayed or re-run reply, or the interrupted one: its SSE `start` and the next event
    within the window (a 409 while the first request's leftovers clear is retried)."""
    server = crash.server
    started = time.monotonic()
    answers: list[Any] = []  # the 409s met on the way
    while True:
        left = WINDOW_S - (time.monotonic() - started)
        assert left > 0, f"no clear answer within {WINDOW_S:.0f} s: {answers}"
        try:
            with httpx.stream(
                "POST",
                f"{server.url}/v1/conversations/{crash.conversation}/messages",
                headers={**server.headers(), "Idempotency-Key": crash.idempotency_key},
                json=STREAM,
                timeout=httpx.Timeout(120, read=left),
            ) as r:
                if r.status_code == 409:
                    answers.append(json.loads(r.read()))
                    time.sleep(0.2)
                    continue
                assert r.status_code == 200, (r.status_code, r.read()[:300])
                events = sse_events(r)
                first = next(events)
                assert first["type"] == "start", first
                after = next(events, None)  # the reply's text or its end; a re-run goes on
                assert after is not None and after["type"] in ("delta", "tool_call", "done"), after
                return
        except httpx.ReadTimeout:
            pytest.fail(f"the retry hung: no answer within {WINDOW_S:.0f} s ({answers})")


def test_the_interrupted_reply_kept_the_text_its_client_had_seen(crash: Crash) -> None:
    replies = {m["id"]: m for m in crash.stored}
    assert crash.message_id in replies, [m["id"] for m in crash.stored]
    reply = replies[crash.message_id]
    assert reply["status"] == "interrupted", reply
    content = reply["content"] or ""
    assert content, f"the client had seen {len(crash.seen)} characters; none were stored"
    # What was stored and what was seen agree as far as both go.
    shorter = min(len(content), len(crash.seen))
    assert content[:shorter] == crash.seen[:shorter], (content[:200], crash.seen[:200])
