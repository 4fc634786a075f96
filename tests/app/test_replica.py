"""What one replica of a fleet says about itself, in process: the replica that served each
response (`X-Kvchat-Replica`, on a WebSocket's handshake too) and in `/metrics`; keyless
stateless clients in a session named by their opening; `/readyz` while draining; the exit
hooks at shutdown."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvchat_testing.app_service import Service, service_settings

REPLICA = "replica-under-test"


@pytest.fixture(scope="module")
def replica(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from kvchat.app.main import create_app

    settings = service_settings(dev_model, tmp_path_factory.mktemp("replica"), None)
    settings.replica_id = REPLICA
    settings.keyless_sessions = True
    app = create_app(settings)
    with TestClient(app) as client:
        state = app.state.kvchat
        _, alice = client.portal.call(lambda: state.store.create_key("alice"))
        _, bob = client.portal.call(lambda: state.store.create_key("bob"))
        yield Service(client, state, alice, bob, "sqlite")


def chat(service: Service, messages: list[dict[str, Any]], key: str | None = None) -> Any:
    r = service.post(
        "/v1/chat/completions",
        {"model": service.model, "messages": messages, "max_tokens": 6, "temperature": 0},
        key=key,
    )
    assert r.status_code == 200, r.text
    return r.json()


def wait_until_pinned(service: Service, timeout: float = 60.0) -> None:
    """Until no finished turn waits for its last token's KV (the engine's FINISHING step)."""
    scheduler = service.state.runtime.engine_client.engine.scheduler
    deadline = time.monotonic() + timeout
    while scheduler.finishing:
        assert time.monotonic() < deadline, "a finished turn was never pinned"
        time.sleep(0.005)


def test_every_response_names_the_replica_that_served_it(replica: Service) -> None:
    for response in (
        replica.client.get("/healthz"),
        replica.get("/v1/models"),
        replica.client.get("/v1/models"),  # a 401
        replica.post("/v1/conversations", {"title": 7}),
    ):  # a 400
        assert response.headers["x-kvchat-replica"] == REPLICA, response.status_code
    conv = replica.post("/v1/conversations", {}).json()["id"]
    with replica.client.websocket_connect(
        f"/v1/conversations/{conv}/ws", headers=replica.headers()
    ) as ws:
        assert dict(ws.extra_headers or [])[b"x-kvchat-replica"] == REPLICA.encode()
    assert replica.client.get("/readyz").json()["replica"] == REPLICA


def test_metrics_carry_the_replica_name(replica: Service) -> None:
    text = replica.client.get("/metrics").text
    assert f'kvchat:replica_info{{replica="{REPLICA}"}} 1.0' in text
    assert "kvchat:session_moves_total 0.0" in text


def test_a_keyless_client_resending_its_history_reuses_all_of_it(replica: Service) -> None:
    """No X-Session-Id: the calls of one conversation share the session its opening names,
    so each reuses the last one's prompt and reply exactly (the reply spliced back by its ids,
    never re-tokenized); another conversation with the same system prompt, and another owner
    with the same opening, get sessions of their own."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "A system prompt every user shares."},
        {"role": "user", "content": "Hello, this is the first user."},
    ]
    previous = None
    for turn in range(4):
        usage = (body := chat(replica, messages))["usage"]
        # A turn's last sampled token gets its KV in a step after the reply is out; a next turn
        # arriving before that step computes it itself (one token less cached, by design).
        # Wait for the pin, so the count below is exact on a loaded machine too.
        wait_until_pinned(replica)
        if previous is not None:
            assert usage["prompt_tokens_details"]["cached_tokens"] == (
                previous["prompt_tokens"] + previous["completion_tokens"]
            )
        previous = usage
        messages += [
            body["choices"][0]["message"],
            {"role": "user", "content": f"Follow-up number {turn}."},
        ]
    others = [
        chat(replica, [messages[0], {"role": "user", "content": "A second user opens."}]),
        chat(replica, messages[:2], key=replica.other_key),
    ]
    for other in others:
        # The shared system prompt's full blocks come from the prefix cache at most.
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < 32


def test_readyz_says_draining_and_the_exit_hooks_run_with_the_sessions_still_pinned(
    dev_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvchat.app.main import create_app

    settings = service_settings(dev_model, tmp_path, None)
    settings.drain_grace, settings.drain_probes = 30.0, 2
    app = create_app(settings)
    seen: list[tuple[bool, int]] = []

    with caplog.at_level(logging.INFO, logger="kvchat.app.ops.drain"), TestClient(app) as client:
        state = app.state.kvchat

        async def hook() -> None:
            from kvchat.app.ops.drain import pinned_sessions

            report = await state.runtime.engine_client.memory_report()
            seen.append((state.runtime.is_running, pinned_sessions(report).num_sessions))

        state.drain.exit_hooks.append(hook)
        _, key = client.portal.call(lambda: state.store.create_key("alice"))
        headers = {"Authorization": f"Bearer {key}"}
        conv = client.post("/v1/conversations", json={}, headers=headers).json()["id"]
        r = client.post(
            f"/v1/conversations/{conv}/messages",
            headers=headers,
            json={"content": "Pin me", "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        assert client.get("/readyz").status_code == 200
        state.drain.begin()
        first = client.get("/readyz")
        assert (first.status_code, first.json()["status"]) == (503, "draining")
        assert not state.drain.is_grace_over()
        client.get("/readyz")
        assert state.drain.is_grace_over()  # the balancer's checks saw it twice
        # Still serving while the balancer takes it out.
        again = client.post(
            f"/v1/conversations/{conv}/messages",
            headers=headers,
            json={"content": "Still here?", "max_tokens": 4},
        )
        assert again.status_code == 200 and again.json()["status"] == "complete"
        assert client.get("/healthz").status_code == 200
    # persist_pinned_sessions, then this hook: the engine stopped, the session still pinned.
    assert seen == [(False, 1)]
    assert any("KV store: 1 pinned sessions" in r.getMessage() for r in caplog.records)
    # Its blocks are on disk: every full block of the conversation, once.
    usage = again.json()["usage"]
    files = list(settings.kv_store_path.glob("*/*.safetensors"))
    assert len(files) == (usage["prompt_tokens"] + usage["completion_tokens"]) // 16
