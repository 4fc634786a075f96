"""The KV store's faults, as operators see them: a store that cannot be used costs recomputes,
never readiness or a request; `/readyz`'s detail, `/metrics` and `GET /v1/admin/memory` say
what failed and why."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from kvchat_testing.app_service import service_settings


def test_a_store_that_cannot_open_is_reported_while_serving_goes_on(
    dev_model: Path, tmp_path: Path
) -> None:
    from kvchat.app.main import create_app

    not_a_dir = tmp_path / "kv"
    not_a_dir.write_text("a file where the KV store's directory should be")
    settings = service_settings(dev_model, tmp_path / "data", None).model_copy(
        update={"kv_store_dir": not_a_dir, "kv_store_bytes": 1 << 30}
    )
    app = create_app(settings)
    with TestClient(app) as client:
        state = app.state.kvchat
        _, admin = client.portal.call(lambda: state.store.create_key("ops", admin=True))
        headers = {"Authorization": f"Bearer {admin}"}
        body = {
            "model": state.runtime.model_name,
            "messages": [{"role": "user", "content": "Hello there, store."}],
            "max_tokens": 4,
        }
        for _ in range(3):
            r = client.post("/v1/chat/completions", headers=headers, json=body)
            assert r.status_code == 200, r.text
        ready = client.get("/readyz")
        assert ready.status_code == 200
        store = ready.json()["checks"]["kv_store"]
        assert store["active"] is False and "ENOTDIR" in store["reason"]
        assert client.get("/healthz").json() == {"status": "ok"}
        metrics = client.get("/metrics").text
        found = re.search(
            r'^kvchat:kv_store_errors_total\{op="open",reason="ENOTDIR"\} (\S+)$', metrics, re.M
        )
        assert found and float(found.group(1)) == 1.0
        assert re.search(r"^kvchat:kv_store_enabled 0\.0$", metrics, re.M)
        view = client.get("/v1/admin/memory", headers=headers).json()["kv_store"]
        assert view["active"] is False and view["writes"] == 0
        assert view["errors"] == [{"op": "open", "reason": "ENOTDIR", "count": 1}]
