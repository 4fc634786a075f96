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

from tests.app.conftest import service_settings

TEMPLATES = Path(__file__).parents[2] / "inference" / "chat_templates"


@pytest.fixture(scope="module", params=["chatml", "qwen2.5"])
def app_and_key(
    request: pytest.FixtureRequest, dev_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TestClient, Any, str]]:
    from app.main import create_app

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
    original = renderer.render_segments

    def watched(*args: Any, **kwargs: Any) -> Any:
        threads.add(threading.current_thread().name)
        return original(*args, **kwargs)

    renderer.render_segments = watched  # type: ignore[method-assign]
    try:
        work = []
        for index in range(30):
            renders, chars = template.num_renders, template.num_tokenized_chars
            r = client.post(f"/v1/conversations/{conv_id}/messages", headers=headers,
                            json={"content": f"question {index:03d} about the cats",
                                  "max_tokens": 3, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            work.append((template.num_renders - renders,
                         template.num_tokenized_chars - chars))
    finally:
        renderer.render_segments = original  # type: ignore[method-assign]
    early, late = work[5], work[29]
    assert late[0] == early[0], work  # the same number of renders
    # the same text tokenized, give or take the reply's (3 generated tokens, spliced)
    assert abs(late[1] - early[1]) <= 16, work
    assert threads and all(name.startswith("kvchat-cpu") for name in threads), threads
