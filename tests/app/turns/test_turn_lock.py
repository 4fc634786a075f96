"""A client that has its reply may send the next turn at once: the turn before it has
published its end but still holds the conversation's lock while its end hooks run (an
Idempotency-Key's record is stored there). The next turn waits for that lock rather than
answering 409 conversation_busy; a turn that is still generating is answered 409 at once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvchat.app.errors import APIError
from kvchat.app.schemas.chat import SamplingFields
from kvchat.inference.text.chat_template import ChatMessage
from kvchat_testing.app_service import service_settings


@pytest.fixture(scope="module")
def served(
    dev_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TestClient, Any, Any, str]]:
    from kvchat.app.main import create_app

    app = create_app(service_settings(dev_model, tmp_path_factory.mktemp("data"), None))
    with TestClient(app) as client:
        state = app.state.kvchat
        record, key = client.portal.call(lambda: state.store.create_key("alice"))
        yield client, state, record, key


def new_conversation(client: TestClient, key: str) -> str:
    r = client.post("/v1/conversations", json={}, headers={"Authorization": f"Bearer {key}"})
    return str(r.json()["id"])


def test_the_next_turn_waits_for_the_ended_turn_to_release_its_lock(
    served: tuple[TestClient, Any, Any, str],
) -> None:
    client, state, record, key = served
    conv = new_conversation(client, key)
    fields = SamplingFields(max_tokens=2, temperature=0)

    async def scenario() -> tuple[list[str], str, str]:
        gate = asyncio.Event()
        hooks: list[str] = []

        async def held_end(turn: Any) -> None:
            hooks.append("end hook entered")
            await gate.wait()
            hooks.append("end hook left")

        def start(text: str, on_end: Any = None) -> Any:
            return state.turns.start(
                record,
                conv,
                fields,
                new_message=ChatMessage(role="user", content=text),
                parent_id=None,
                on_end=on_end,
                key_verified=True,
            )

        first = await start("one", held_end)
        reply = await first.wait()  # what a client is answered with: the turn has ended
        assert hooks == ["end hook entered"] and state.turns.running(conv) is None
        second = asyncio.create_task(start("two"))
        await asyncio.sleep(0.2)
        assert not second.done()  # waiting for the lock, not answered 409
        gate.set()
        turn = await second
        answered = await turn.wait()
        return hooks, reply.id, answered.parent_id

    hooks, first_reply, second_parent = client.portal.call(scenario)
    assert hooks == ["end hook entered", "end hook left"]
    stored = client.get(
        f"/v1/conversations/{conv}/messages", headers={"Authorization": f"Bearer {key}"}
    ).json()["data"]
    assert [m["role"] for m in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[1]["id"] == first_reply
    assert stored[2]["id"] == second_parent


def test_a_turn_while_one_generates_is_refused_at_once(
    served: tuple[TestClient, Any, Any, str],
) -> None:
    client, state, record, key = served
    conv = new_conversation(client, key)

    async def scenario() -> APIError:
        def start(text: str, max_tokens: int) -> Any:
            return state.turns.start(
                record,
                conv,
                SamplingFields(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                new_message=ChatMessage(role="user", content=text),
                parent_id=None,
                key_verified=True,
            )

        first = await start("one", 512)
        try:
            with pytest.raises(APIError) as refused:
                await start("two", 2)
        finally:
            first.stop()
            await first.wait()
        return refused.value

    refused = client.portal.call(scenario)
    assert (refused.status, refused.code) == (409, "conversation_busy")
