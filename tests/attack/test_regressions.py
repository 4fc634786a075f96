"""Defects the attack campaign found, kept fixed against a started `kvchat serve` (SQLite):
a conversation far past SQLite's trigger depth is deleted; `Idempotency-Key` holds on
`POST /v1/responses`; integers are integers (no "8", no true); a Responses input past its item
cap is a 400 naming the limit and stores nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvchat_testing.attack_servers import assert_openai_error, started_server
from kvchat_testing.service import Server

LONG = 1200  # messages: past SQLite's 1,000 levels of recursive foreign-key actions


@pytest.fixture(scope="module")
def server(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with started_server(dev_model, tmp_path_factory.mktemp("data"), "sqlite") as server:
        yield server


def post(server: Server, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}{path}", json=body, headers={**server.headers(), **headers}, timeout=300
    )


def conversation_ids(server: Server) -> set[str]:
    r = httpx.get(f"{server.url}/v1/conversations?limit=100", headers=server.headers(), timeout=60)
    return {c["id"] for c in r.json()["data"]}


def test_a_conversation_of_1200_items_is_deleted(server: Server) -> None:
    conv = post(server, "/v1/conversations", {})
    conv_id = conv.json()["id"]
    for start in range(0, LONG, 20):  # the Conversations API's 20 items per call
        items = [
            {"type": "message", "role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
            for i in range(start, start + 20)
        ]
        r = post(server, f"/v1/conversations/{conv_id}/items", {"items": items})
        assert r.status_code == 200, r.text
    gone = httpx.delete(f"{server.url}/v1/conversations/{conv_id}", headers=server.headers())
    assert gone.status_code == 200, gone.text
    again = httpx.get(f"{server.url}/v1/conversations/{conv_id}", headers=server.headers())
    assert again.status_code == 404


def test_an_idempotency_key_gives_one_response(server: Server) -> None:
    before = conversation_ids(server)
    body = {"model": "dev", "input": "Once, please.", "max_output_tokens": 4}
    first = post(server, "/v1/responses", body, **{"Idempotency-Key": "attack-once"})
    second = post(server, "/v1/responses", body, **{"Idempotency-Key": "attack-once"})
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert first.json()["id"] == second.json()["id"]
    assert len(conversation_ids(server) - before) == 1
    other = post(
        server, "/v1/responses", {**body, "input": "Twice?"}, **{"Idempotency-Key": "attack-once"}
    )
    assert other.status_code == 400
    assert assert_openai_error(other.json())["code"] == "idempotency_key_reused"


@pytest.mark.parametrize("value", ["8", True, 8.5])
def test_integers_are_integers(server: Server, value: Any) -> None:
    before = conversation_ids(server)
    r = post(server, "/v1/responses", {"model": "dev", "input": "hi", "max_output_tokens": value})
    assert r.status_code == 400, r.text
    assert assert_openai_error(r.json())["param"] == "max_output_tokens"
    chat = post(
        server,
        "/v1/chat/completions",
        {"model": "dev", "messages": [{"role": "user", "content": "hi"}], "max_tokens": value},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"
    assert conversation_ids(server) == before


def test_too_many_input_items_store_nothing(server: Server) -> None:
    before = conversation_ids(server)
    items = [{"role": "user", "content": "x"}] * 40_000
    r = post(server, "/v1/responses", {"model": "dev", "input": items, "max_output_tokens": 4})
    assert r.status_code == 400, r.text[:300]
    error = assert_openai_error(r.json())
    assert error["param"] == "input" and "4096" in error["message"]
    assert conversation_ids(server) == before
