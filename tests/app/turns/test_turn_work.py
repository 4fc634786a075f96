"""A turn's CPU work does not grow with the conversation: the template renders and the text
tokenized per turn at turn 5 and at turn 30 of one conversation are the same, through the
service (REST turns), for a template whose messages render alone (ChatML, the dev model's)
and for one whose segments are extended turn by turn (Qwen2.5's, with its default system
prompt); and none of it runs on the event loop."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvchat_testing.app_service import service_settings
from kvchat_testing.chat_templates import TEMPLATES


@pytest.fixture(scope="module", params=["chatml", "qwen2.5"])
def app_and_key(
    request: pytest.FixtureRequest, dev_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TestClient, Any, str]]:
    from kvchat.app.main import create_app

    model = dev_model
    if request.param == "qwen2.5":
        model = tmp_path_factory.mktemp("qwen") / "dev"
        shutil.copytree(dev_model, model)
        shutil.copy(TEMPLATES / "qwen2.5-instruct.jinja", model / "chat_template.jinja")
    app = create_app(service_settings(model, tmp_path_factory.mktemp("data"), None))
    with TestClient(app) as client:
        state = app.state.kvchat
        _, key = client.portal.call(lambda: state.store.create_key("alice"))
        yield client, state, key


def test_per_turn_rendering_work_is_flat(app_and_key: tuple[TestClient, Any, str]) -> None:
    client, state, key = app_and_key
    headers = {"Authorization": f"Bearer {key}"}
    template = state.runtime.template
    renderer = state.runtime.builder.renderer
    # ChatML renders each message alone; Qwen2.5's default system prompt does not.
    assert renderer.is_local is ("qwen" not in str(state.settings.model.parent))
    conv = client.post("/v1/conversations", json={"system": "Be brief."}, headers=headers)
    conv_id = conv.json()["id"]
    threads: set[str] = set()
    original = template.render_segments

    def watched(*args: Any, **kwargs: Any) -> Any:
        threads.add(threading.current_thread().name)
        return original(*args, **kwargs)

    template.render_segments = watched  # type: ignore[method-assign]
    try:
        work = []
        for index in range(30):
            renders, chars = template.num_renders, template.num_tokenized_chars
            r = client.post(
                f"/v1/conversations/{conv_id}/messages",
                headers=headers,
                json={
                    "content": f"question {index:03d} about the cats",
                    "max_tokens": 3,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert r.status_code == 200, r.text
            work.append((template.num_renders - renders, template.num_tokenized_chars - chars))
    finally:
        template.render_segments = original  # type: ignore[method-assign]
    early, late = work[5], work[29]
    assert late[0] == early[0], work  # the same number of renders
    # the same text tokenized, give or take the reply's (3 generated tokens, spliced)
    assert abs(late[1] - early[1]) <= 16, work
    assert threads and all(name.startswith("kvchat-cpu") for name in threads), threads


def test_the_branch_is_read_from_the_store_only_when_the_tree_changed(
    app_and_key: tuple[TestClient, Any, str],
) -> None:
    """A conversation's next turn in this process reuses the branch its last turn left
    (no store read); any change to the tree since (a message added, the leaf moved, a
    message removed, a summary stored) makes it read the branch again, and the prompt has
    the change."""
    client, state, key = app_and_key
    headers = {"Authorization": f"Bearer {key}"}
    store, portal = state.store, client.portal
    conv = client.post("/v1/conversations", json={}, headers=headers).json()["id"]
    reads: list[str] = []
    real = store.turn_context

    async def counted(conversation_id: str, leaf: str | None) -> Any:
        reads.append(conversation_id)
        return await real(conversation_id, leaf)

    store.turn_context = counted

    def say(text: str) -> dict[str, Any]:
        r = client.post(
            f"/v1/conversations/{conv}/messages",
            headers=headers,
            json={"content": text, "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    try:
        first = say("one")
        assert len(reads) == 1  # nothing kept yet
        second = say("two")
        third = say("three")
        assert len(reads) == 1, reads  # both from the kept branch
        assert third["usage"]["prompt_tokens"] > second["usage"]["prompt_tokens"]
        # A message added by another route: the next turn reads the branch, and its prompt
        # holds the message (the prompt grows by more than the new turn).
        leaf = portal.call(lambda: store.get_conversation("alice", conv)).current_leaf_id
        portal.call(
            lambda: store.add_message(
                conv, parent_id=leaf, role="user", content="an added message " * 5
            )
        )
        fourth = say("four")
        assert len(reads) == 2
        assert fourth["usage"]["prompt_tokens"] > third["usage"]["prompt_tokens"] + 12
        say("five")
        assert len(reads) == 2
        # The leaf moved back (a branch switch): read again; the prompt is the old branch's.
        r = client.patch(
            f"/v1/conversations/{conv}", headers=headers, json={"current_leaf_id": first["id"]}
        )
        assert r.status_code == 200, r.text
        sixth = say("six")
        assert len(reads) == 3
        assert sixth["usage"]["prompt_tokens"] < fourth["usage"]["prompt_tokens"]
        # A regenerate of a kept reply: the path up to its parent, no read.
        r = client.post(
            f"/v1/conversations/{conv}/regenerate",
            headers=headers,
            json={"message_id": sixth["id"], "max_tokens": 3},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == sixth["usage"]["prompt_tokens"]
        assert len(reads) == 3
        # A summary stored: read again.
        portal.call(lambda: store.add_summary(conv, text="s", num_tokens=1, covers=[]))
        say("seven")
        assert len(reads) == 4
    finally:
        store.turn_context = real
    assert state.turns.branches.hits >= 4
