"""A burst against the per-key rate limit through the server, on a real Redis: with
`KVCHAT_RATE_LIMIT_REQUESTS=5`, 30 requests sent at once admit exactly 5; the others get 429
in OpenAI's shape with `Retry-After`. Three bursts per route (chat, turns, and tokenizing, which
is work per byte too), each on a key of its own."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvchat_testing.attack_servers import (
    assert_openai_error,
    create_key,
    database_of,
    started_server,
)
from kvchat_testing.service import Server

LIMIT = 5
BURST = 30
BURSTS = 3  # each on a key of its own: a limiter that races lets more in, most bursts


@pytest.fixture(scope="module")
def server(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"KVCHAT_RATE_LIMIT_REQUESTS": str(LIMIT)}
    with started_server(
        dev_model, tmp_path_factory.mktemp("data"), "postgres+redis", env
    ) as server:
        yield server


@pytest.mark.parametrize("route", ["chat completions", "conversation turns", "tokenize"])
def test_bursts_admit_exactly_the_limit(server: Server, route: str) -> None:
    admitted = [burst(server, route) for _ in range(BURSTS)]
    assert admitted == [LIMIT] * BURSTS, f"admitted per burst of {BURST}: {admitted}"


def burst(server: Server, route: str) -> int:
    """One burst of BURST requests at once on a new key; how many were admitted (the others
    are checked to be 429s in OpenAI's shape)."""
    key = create_key(database_of(server), f"burst-{uuid.uuid4().hex[:8]}")  # a fresh window
    headers = server.headers(key)
    convs = [
        httpx.post(f"{server.url}/v1/conversations", headers=headers, json={}, timeout=60).json()[
            "id"
        ]
        for _ in range(BURST)
    ]

    def request(client: httpx.AsyncClient, i: int) -> httpx.Request:
        if route == "chat completions":
            return client.build_request(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": "dev",
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": f"burst {i}"}],
                },
            )
        if route == "tokenize":  # work per byte, limited like chat
            return client.build_request(
                "POST",
                "/v1/tokenize",
                json={"messages": [{"role": "user", "content": f"burst {i} " * 200}]},
            )
        return client.build_request(
            "POST",
            f"/v1/conversations/{convs[i]}/messages",
            json={"content": f"burst {i}", "max_tokens": 1},
        )

    async def send_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
        async with httpx.AsyncClient(
            base_url=server.url, headers=headers, timeout=120, limits=limits
        ) as client:
            requests = [request(client, i) for i in range(BURST)]
            return list(await asyncio.gather(*(client.send(r) for r in requests)))

    responses = asyncio.run(send_all())
    for r in responses:
        assert r.status_code in (200, 429), (r.status_code, r.text[:300])
        if r.status_code == 429:
            assert assert_openai_error(r.json())["code"] == "rate_limit_exceeded"
            assert int(r.headers["retry-after"]) >= 1
    return sum(r.status_code == 200 for r in responses)
