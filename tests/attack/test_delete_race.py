"""A conversation deleted while its turn is being posted, 1 to 20 ms after the POST (60 tries,
each delay three times), on SQLite and on Postgres + Redis: every POST ends (with the stored
reply, or a typed 404), never a 500 or a hang; every DELETE is answered; afterwards nothing
runs, the deleted conversations hold no session, and the KV pool holds just what the live
sessions hold."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvchat.bench.soak import pool_use
from kvchat_testing.attack_servers import BACKENDS, assert_openai_error, idle_memory, started_server
from kvchat_testing.service import Server

TRIES = 60
ENDS_WITHIN_S = 30.0  # a POST still unanswered after this is a hang
NOT_FOUND = ("conversation_not_found", "not_found")
MAX_FAILURES = 5  # the tries stop here: a broken server fails in minutes, not an hour


@pytest.fixture(scope="module", params=BACKENDS)
def server(
    request: pytest.FixtureRequest, dev_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    with started_server(dev_model, tmp_path_factory.mktemp("data"), request.param) as server:
        yield server


def outcome(response: httpx.Response | BaseException) -> str:
    """What a request got: "200", a typed "404 <code>", or what went wrong."""
    if isinstance(response, httpx.TimeoutException):
        return f"no answer within {ENDS_WITHIN_S:.0f} s"
    if isinstance(response, BaseException):
        return f"{type(response).__name__}: {response}"
    if response.status_code == 200:
        return "200"
    if response.status_code == 404:
        try:
            return f"404 {assert_openai_error(response.json())['code']}"
        except (AssertionError, ValueError):
            pass
    return f"{response.status_code} {response.text[:200]}"


def test_deleting_a_conversation_during_its_turn(server: Server) -> None:
    async def race(i: int) -> tuple[str, str]:
        # A connection of its own: a connection the server drops is this try's outcome.
        async with httpx.AsyncClient(
            base_url=server.url, headers=server.headers(), timeout=ENDS_WITHIN_S
        ) as client:
            r = await client.post("/v1/conversations", json={"title": f"race {i}"})
            conv = r.json()["id"]
            # Each first message its own: no KV block is shared between conversations.
            post = asyncio.ensure_future(
                client.post(
                    f"/v1/conversations/{conv}/messages",
                    json={"content": f"try {i}: tell me a long story", "max_tokens": 64},
                )
            )
            await asyncio.sleep((1 + i % 20) / 1000)
            deleted = await asyncio.gather(
                client.delete(f"/v1/conversations/{conv}"), return_exceptions=True
            )
            posted = await asyncio.gather(post, return_exceptions=True)
            return outcome(posted[0]), outcome(deleted[0])

    allowed = {"200", *(f"404 {code}" for code in NOT_FOUND)}

    async def attack() -> list[tuple[str, str]]:
        results = []
        for i in range(TRIES):
            results.append(await race(i))
            if sum(p not in allowed or d not in allowed for p, d in results) >= MAX_FAILURES:
                break  # enough to show it; each hang costs ENDS_WITHIN_S
        return results

    results = asyncio.run(attack())
    counts: dict[str, int] = {}
    for posted, _ in results:
        counts[posted] = counts.get(posted, 0) + 1
    print(f"\ndelete racing a turn, the POSTs got: {counts}")
    wrong = [
        (i, posted, deleted)
        for i, (posted, deleted) in enumerate(results)
        if posted not in allowed or deleted not in allowed
    ]
    assert not wrong, (
        f"{len(wrong)} of {len(results)} tries went wrong (try, POST, DELETE): {wrong}"
    )
    assert len(results) == TRIES

    report = idle_memory(server)
    assert report["requests"] == {"running": 0, "waiting": 0, "swapped": 0}
    listed = httpx.get(
        f"{server.url}/v1/conversations?limit=100", headers=server.headers(), timeout=60
    ).json()["data"]
    assert not [c for c in listed if (c["title"] or "").startswith("race ")]  # all deleted
    live = {c["id"] for c in listed}
    assert {s["conversation_id"] for s in report["sessions"]} <= live
    used, held = pool_use(report)
    assert used == held, f"the pool has {used} blocks in use; live sessions hold {held}"
