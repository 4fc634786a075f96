"""The turn service built from its collaborators alone, as the composition root builds it (no
app, no AppState, no HTTP): a real SQLite store, the dev model's runtime, in-process
coordination. Two turns run; the second's prompt extends the first's pinned KV, both replies
are stored with their exact ids; the session's budget reaches the engine with the turn (once,
with the request), and an operator's lower default applies from the next turn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvchat_testing.app_service import service_settings

pytestmark = pytest.mark.anyio


@pytest.fixture
async def built(dev_model: Path, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    import asyncio

    from kvchat.app.coord import ProcessIdentity, make_coordinator
    from kvchat.app.ops.limits import Limits
    from kvchat.app.ops.tasks import BackgroundTasks
    from kvchat.app.runtime import Runtime
    from kvchat.app.store import Store
    from kvchat.app.turns.service import TurnService

    settings = service_settings(dev_model, tmp_path, None)
    store = await Store.open(settings.database)
    runtime = await asyncio.to_thread(Runtime, settings)
    runtime.start()
    coord = make_coordinator(None, "test-turns:")
    await coord.start()
    tasks = BackgroundTasks()
    turns = TurnService(
        settings=settings,
        defaults=settings.session_defaults(),
        store=store,
        runtime=runtime,
        coord=coord,
        identity=ProcessIdentity("turn-service-test"),
        limits=Limits(settings, coord, runtime.metrics, lambda: runtime.num_waiting, tasks),
        tasks=tasks,
    )
    key, _ = await store.create_key("alice")
    try:
        yield {"turns": turns, "store": store, "runtime": runtime, "key": key, "tasks": tasks}
    finally:
        await runtime.shutdown(2.0)
        await tasks.wait(5.0)
        await coord.close()
        runtime.close()
        await store.close()


async def run_turn(turns: Any, key: Any, conversation_id: str, text: str) -> Any:
    from kvchat.app.schemas.chat import SamplingFields
    from kvchat.inference import ChatMessage

    turn = await turns.start(
        key,
        conversation_id,
        SamplingFields(max_tokens=4, temperature=0.0),
        new_message=ChatMessage("user", text),
        parent_id=None,
        key_verified=True,
    )
    await turn.task
    return turn


async def test_a_turn_service_built_from_its_collaborators_runs_and_stores_turns(
    built: dict[str, Any],
) -> None:
    turns, store, runtime, key = built["turns"], built["store"], built["runtime"], built["key"]
    conv = await store.create_conversation(key.owner, max_context_tokens=512)
    first = await run_turn(turns, key, conv.id, "Hello there")
    assert first.final is not None and first.final.status == "complete"
    assert list(first.final.token_ids) == first.generation.result.token_ids
    info = await runtime.engine_client.session_info(conv.id)
    assert info is not None and info.holds_kv
    # The budget went with the request: the engine holds the conversation's own.
    assert info.budget.max_context_tokens == 512

    second = await run_turn(turns, key, conv.id, "And again")
    assert second.final is not None and second.final.status == "complete"
    assert second.generation.result.cached_tokens >= first.generation.result.prompt_tokens
    branch = await store.branch(conv.id, second.final.id)
    assert [m.role for m in branch] == ["user", "assistant", "user", "assistant"]
    assert list(branch[-1].token_ids or ()) == second.generation.result.token_ids

    # An operator's new default: the conversation's own budget still wins, a new one's
    # follows the default from its first turn.
    turns.planner.defaults = turns.planner.defaults.model_copy(update={"max_kv_tokens": 64})
    other = await store.create_conversation(key.owner)
    await run_turn(turns, key, other.id, "Hi")
    other_info = await runtime.engine_client.session_info(other.id)
    assert other_info is not None and other_info.budget.max_kv_tokens == 64
    assert other_info.budget.max_context_tokens == runtime.max_model_len
