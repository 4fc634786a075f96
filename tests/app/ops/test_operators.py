"""Operators: memory, per-session budgets live (and across restarts), evictions, defaults,
Prometheus metrics that move as a scripted workload predicts."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvchat_testing.app_service import Service, service_settings


def start(model: Path, data: Path) -> tuple[Any, TestClient]:
    from kvchat.app.main import create_app

    app = create_app(service_settings(model, data, None))
    return app, TestClient(app)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("operators")


@pytest.fixture(scope="module")
def ops(dev_model: Path, data_dir: Path) -> Iterator[Service]:
    app, client = start(dev_model, data_dir)
    with client:
        state = app.state.kvchat
        _, admin = client.portal.call(lambda: state.store.create_key("ops", admin=True))
        _, user = client.portal.call(lambda: state.store.create_key("user"))
        yield Service(client, state, admin, user, "sqlite")


def turn(service: Service, conv: str, text: str, **fields: Any) -> dict[str, Any]:
    r = service.post(
        f"/v1/conversations/{conv}/messages",
        {"content": text, "max_tokens": 8, "temperature": 0, **fields},
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def settled(service: Service, conv: str, key: str | None = None) -> dict[str, Any]:
    """The session once its last turn has pinned its KV (a step after the reply)."""
    for _ in range(200):
        info = service.get(f"/v1/admin/sessions/{conv}", key=key).json()
        if info["engine"] and info["engine"]["state"] != "active":
            return info  # type: ignore[no-any-return]
        time.sleep(0.02)
    raise AssertionError("the session stayed active")


def test_engine_view_names_the_cpu_and_the_measured_linear_paths(ops: Service) -> None:
    view = ops.get("/v1/admin/engine").json()
    assert view["object"] == "engine" and view["device"] == "cpu"
    assert view["cpu"]["model"] and isinstance(view["cpu"]["isa"], list)
    linear = view["linear"]
    assert linear["weights"] in ("plain", "onednn-prepacked")
    assert linear["reason"] == "measured"
    # every chosen path was measured, and the single-row one is the fastest the layout holds
    rows1 = linear["probe_ms"][linear["decode_paths"][0]["path"]]["1"]
    held = (
        ["onednn-prepacked"]
        if linear["weights"] == "onednn-prepacked"
        else [n for n in ("gemv", "gemv-prefetch", "torch", "onednn") if n in linear["probe_ms"]]
    )
    assert rows1 == min(linear["probe_ms"][n]["1"] for n in held)
    assert linear["prefill_path"] in ("torch", "onednn", "upcast", "widen", "onednn-prepacked")
    assert linear == ops.state.runtime.engine_client.engine.model.linear_plan.as_dict()


def test_admin_routes_need_an_admin_key(ops: Service) -> None:
    for method, path in (
        ("GET", "/v1/admin/memory"),
        ("GET", "/v1/admin/engine"),
        ("PUT", "/v1/admin/defaults"),
        ("GET", "/v1/admin/sessions/x"),
    ):
        r = ops.client.request(method, path, headers=ops.headers(ops.other_key), json={})
        assert r.status_code == 403, path
        assert r.json()["error"]["code"] == "admin_required"


def test_a_budget_set_by_put_applies_at_the_next_turn(
    ops: Service, dev_model: Path, data_dir: Path
) -> None:
    conv = ops.post("/v1/conversations", {"system": "Be brief."}).json()["id"]
    turn(ops, conv, "First turn, with enough words to fill a few blocks of the cache " * 3)
    before = settled(ops, conv)
    assert before["engine"]["tokens"] > 32
    r = ops.client.put(
        f"/v1/admin/sessions/{conv}",
        headers=ops.headers(),
        json={"max_kv_tokens": 32, "history_policy": "drop_oldest"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["settings"]["max_kv_tokens"] == 32
    assert r.json()["effective"]["history_policy"] == "drop_oldest"
    turn(ops, conv, "Second turn.")
    after = settled(ops, conv)
    assert after["engine"]["tokens"] == 32 and after["engine"]["max_kv_tokens"] == 32
    memory = ops.get("/v1/admin/memory").json()
    (session,) = [s for s in memory["sessions"] if s["conversation_id"] == conv]
    assert session["tokens"] == 32 and session["budget"]["max_kv_tokens"] == 32
    bad = ops.client.put(
        f"/v1/admin/sessions/{conv}", headers=ops.headers(), json={"history_policy": "forget"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "history_policy"
    assert (
        ops.client.put("/v1/admin/sessions/conv_nope", headers=ops.headers(), json={}).status_code
        == 404
    )
    # A restart on the same database: the setting is still the conversation's.
    app, client = start(dev_model, data_dir)
    with client:
        again = client.get(f"/v1/admin/sessions/{conv}", headers=ops.headers()).json()
        assert again["settings"]["max_kv_tokens"] == 32
        client.post(
            f"/v1/conversations/{conv}/messages",
            headers=ops.headers(),
            json={"content": "After the restart.", "max_tokens": 4},
        )
        info = settled(Service(client, app.state.kvchat, ops.key, ops.key, "sqlite"), conv)
        assert info["engine"]["tokens"] == 32


def test_evict_to_host_or_drop_shows_in_the_next_turn(ops: Service) -> None:
    results = {}
    for offload in (True, False):
        conv = ops.post("/v1/conversations", {}).json()["id"]
        first = turn(ops, conv, f"History number {int(offload)} that will be evicted " * 4)
        settled(ops, conv)
        evicted = ops.post(
            f"/v1/admin/sessions/{conv}/evict?offload={str(offload).lower()}", {}
        ).json()
        assert evicted["before"] == "resident"
        # Dropped from memory, the session's KV is left in the KV store on disk (the
        # retention policy keeps its token ids to load it back): "stored".
        assert evicted["state"] == ("offloaded" if offload else "stored")
        restores = ops.get("/v1/admin/memory").json()["evictions"]["restores"]
        second = turn(ops, conv, "Next.")
        history = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
        results[offload] = (second["usage"]["cached_tokens"], history)
        now = ops.get("/v1/admin/memory").json()["evictions"]["restores"]
        assert now == restores + (1 if offload else 0)
    cached, history = results[True]
    assert cached >= history  # everything came back from the host pool
    cached, history = results[False]
    # Dropped: only the full blocks the prefix cache still had, never the partial last one.
    assert cached < history and cached % 16 == 0


def test_defaults_of_new_sessions(ops: Service) -> None:
    r = ops.client.put(
        "/v1/admin/defaults",
        headers=ops.headers(),
        json={"max_context_tokens": 300, "history_policy": "summarize"},
    )
    assert r.status_code == 200 and r.json()["max_context_tokens"] == 300
    conv = ops.post("/v1/conversations", {}).json()["id"]
    effective = ops.get(f"/v1/admin/sessions/{conv}").json()["effective"]
    assert effective["max_context_tokens"] == 300
    assert effective["history_policy"] == "summarize"
    bad = ops.client.put(
        "/v1/admin/defaults",
        headers=ops.headers(),
        json={"low_watermark": 0.9, "high_watermark": 0.5},
    )
    assert bad.status_code == 400
    ops.client.put(
        "/v1/admin/defaults",
        headers=ops.headers(),
        json={"max_context_tokens": None, "history_policy": "drop"},
    )


def metrics(ops: Service) -> dict[str, float]:
    text = ops.client.get("/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def test_metrics_parse_and_move_as_the_workload_predicts(ops: Service) -> None:
    before = metrics(ops)
    assert "kvchat:kv_cache_usage_perc{}" in before
    prompt = [
        {"role": "system", "content": "A shared system prompt for every request. " * 8},
        {"role": "user", "content": "Hello"},
    ]
    n = 4
    completion = 0
    for _ in range(n):
        r = ops.post(
            "/v1/chat/completions",
            {
                "model": ops.model,
                "messages": prompt,
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        completion += r.json()["usage"]["completion_tokens"]
    after = metrics(ops)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvchat:time_to_first_token_seconds_count{}") == n
    assert delta("kvchat:e2e_request_latency_seconds_count{}") == n
    assert delta("kvchat:request_queue_time_seconds_count{}") == n
    assert delta("kvchat:generation_tokens_total{}") == completion == 5 * n
    assert delta("kvchat:request_success_total{finished_reason=length}") == n
    assert delta("kvchat:inter_token_latency_seconds_count{}") == n * 4
    # The first request computed the prompt; the next three hit its full blocks.
    prompt_tokens = ops.post("/v1/tokenize", {"messages": prompt}).json()["count"]
    assert delta("kvchat:prompt_tokens_total{}") == n * prompt_tokens
    assert delta("kvchat:prefix_cache_queries_total{}") == n * prompt_tokens
    assert delta("kvchat:prefix_cache_hits_total{}") == (n - 1) * (prompt_tokens // 16 * 16)
    assert delta("kvchat:cached_tokens_total{source=prefix_cache}") == delta(
        "kvchat:prefix_cache_hits_total{}"
    )
    assert "kvchat:pinned_sessions{tier=gpu}" in after
    assert after["kvchat:num_requests_running{}"] == 0


def admin_key(service: Service) -> str:
    _, key = service.client.portal.call(lambda: service.state.store.create_key("ops", admin=True))
    return key  # type: ignore[no-any-return]


def put(service: Service, path: str, body: dict[str, Any], key: str) -> Any:
    return service.client.put(path, headers=service.headers(key), json=body)


def readable(service: Service, conv: str) -> None:
    """The owner's conversation reads and lists."""
    assert service.get(f"/v1/conversations/{conv}").status_code == 200
    page = service.get("/v1/conversations", params={"limit": 100})
    assert page.status_code == 200 and conv in [c["id"] for c in page.json()["data"]]


WEEK_S = 7 * 86_400


def engine_of(service: Service, conv: str, admin: str) -> dict[str, Any]:
    """The session as the engine holds it, once its last turn has ended."""
    engine = settled(service, conv, admin)["engine"]
    assert engine is not None
    return engine  # type: ignore[no-any-return]


def retention(view: dict[str, Any]) -> tuple[Any, Any]:
    return view["retention_ttl_s"], view["retention_priority"]


def test_put_checks_settings_with_what_the_conversation_stores(service: Service) -> None:
    admin = admin_key(service)
    conv = service.post("/v1/conversations", {"low_watermark": 0.6}).json()["id"]
    path = f"/v1/admin/sessions/{conv}"
    r = put(service, path, {"high_watermark": 0.3}, admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "high_watermark", r.text
    view = service.get(path, key=admin)
    assert view.status_code == 200, view.text
    assert view.json()["settings"]["high_watermark"] is None and view.json()["error"] is None
    readable(service, conv)
    # A row that holds them anyway (from before this check, or by hand): every view reads it,
    # the admin one says why a turn is refused, the turn says so too, and PUT repairs it.
    service.client.portal.call(
        lambda: service.state.store.update_conversation("alice", conv, high_watermark=0.3)
    )
    view = service.get(path, key=admin)
    assert view.status_code == 200, view.text
    assert view.json()["settings"]["high_watermark"] == 0.3
    assert view.json()["error"]["param"] == "high_watermark"
    readable(service, conv)
    assert service.get("/v1/admin/memory", key=admin).status_code == 200
    refused = service.post(f"/v1/conversations/{conv}/messages", {"content": "Hi"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "high_watermark"
    repaired = put(service, path, {"high_watermark": 0.9}, admin)
    assert repaired.status_code == 200, repaired.text
    assert repaired.json()["error"] is None
    effective = repaired.json()["effective"]
    assert (effective["low_watermark"], effective["high_watermark"]) == (0.6, 0.9)
    assert turn(service, conv, "Hi")["status"] == "complete"


def test_defaults_a_conversation_no_longer_fits_refuse_its_next_turn(service: Service) -> None:
    admin = admin_key(service)
    conv = service.post("/v1/conversations", {"low_watermark": 0.7}).json()["id"]
    try:
        r = put(service, "/v1/admin/defaults", {"high_watermark": 0.6}, admin)
        assert r.status_code == 200, r.text
        readable(service, conv)
        refused = service.post(f"/v1/conversations/{conv}/messages", {"content": "Hi"})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "low_watermark"  # the conversation's own, to change
        assert "high_watermark 0.6: the server default" in error["message"], error["message"]
        view = service.get(f"/v1/admin/sessions/{conv}", key=admin).json()
        assert view["error"]["param"] == "low_watermark"
        messages = service.get(f"/v1/conversations/{conv}/messages").json()["data"]
        assert messages == []
        patched = service.client.patch(
            f"/v1/conversations/{conv}", headers=service.headers(), json={"high_watermark": 0.9}
        )
        assert patched.status_code == 200, patched.text
        assert turn(service, conv, "Hi")["status"] == "complete"
    finally:
        put(service, "/v1/admin/defaults", {"high_watermark": 0.8}, admin)


def stateless_id(owner: str, header: str) -> str:
    """The documented id of an X-Session-Id session (app.turns.prompting.session_key)."""
    return "sess_" + hashlib.sha256(f"{owner}\0{header}".encode()).hexdigest()[:32]


def test_stateless_sessions_are_listed_evicted_and_budgeted_by_their_id(service: Service) -> None:
    admin = admin_key(service)
    body = {
        "model": service.model,
        "max_tokens": 4,
        "temperature": 0,
        "messages": [
            {"role": "user", "content": "An agent's history, long enough for a few blocks. " * 3}
        ],
    }

    def call(key: str | None = None) -> None:
        r = service.post("/v1/chat/completions", body, key=key, headers={"X-Session-Id": "agent-7"})
        assert r.status_code == 200, r.text

    call()
    session_id = stateless_id("alice", "agent-7")
    path = f"/v1/admin/sessions/{session_id}"
    view = settled(service, session_id, admin)
    assert view["kind"] == "stateless" and view["session_id"] == session_id
    assert view["engine"]["state"] == "resident" and view["engine"]["tokens"] > 32
    memory = service.get("/v1/admin/memory", key=admin)
    assert "agent-7" not in memory.text  # the header a client sent is not shown
    (listed,) = [s for s in memory.json()["sessions"] if s["session_id"] == session_id]
    assert listed["kind"] == "stateless" and listed["conversation_id"] is None
    assert listed["tokens"] == view["engine"]["tokens"]
    assert all(
        s["kind"] == "conversation" and s["conversation_id"] == s["session_id"]
        for s in memory.json()["sessions"]
        if s["session_id"] != session_id and not s["session_id"].startswith("sess_")
    )
    # Evict: to the host pool, then dropped.
    moved = service.post(f"{path}/evict?offload=true", {}, key=admin).json()
    assert (moved["session_id"], moved["before"], moved["state"]) == (
        session_id,
        "resident",
        "offloaded",
    )
    dropped = service.post(f"{path}/evict?offload=false", {}, key=admin).json()
    assert (dropped["before"], dropped["state"]) == ("offloaded", "stored")
    # A budget applies to its engine session from its next call; history settings do not.
    r = put(service, path, {"max_kv_tokens": 16}, admin)
    assert r.status_code == 200 and r.json()["effective"]["max_kv_tokens"] == 16, r.text
    call()
    assert settled(service, session_id, admin)["engine"]["tokens"] == 16
    bad = put(service, path, {"history_policy": "drop"}, admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "history_policy"
    back = put(service, path, {"max_kv_tokens": None}, admin)
    assert back.json()["effective"]["max_kv_tokens"] == service.state.defaults.max_kv_tokens
    # ...and retention: the engine holds it to its TTL and rank from its next call.
    kept = put(service, path, {"retention_ttl_s": 60, "retention_priority": 90}, admin).json()
    assert retention(kept["effective"]) == retention(kept["engine"]) == (60, 90)
    call()
    assert settled(service, session_id, admin)["engine"]["held"] is True
    # Another owner's equal header is another session; an unknown id is not found.
    call(service.other_key)
    other = stateless_id("bob", "agent-7")
    assert other != session_id and settled(service, other, admin)["kind"] == "stateless"
    unknown = "sess_" + "0" * 32
    assert service.get(f"/v1/admin/sessions/{unknown}", key=admin).status_code == 404
    assert service.post(f"/v1/admin/sessions/{unknown}/evict", {}, key=admin).status_code == 404
    assert put(service, f"/v1/admin/sessions/{unknown}", {}, admin).status_code == 404


def test_retention_settings_are_checked_stored_and_reach_the_engine(service: Service) -> None:
    admin = admin_key(service)
    # Checked as every setting is, on each route that takes them: a 400 naming the field.
    conv = service.post("/v1/conversations", {}).json()["id"]
    for bad in (
        {"retention_ttl_s": -0.5},
        {"retention_ttl_s": WEEK_S + 1},
        {"retention_ttl_s": "soon"},
        {"retention_priority": -1},
        {"retention_priority": 101},
        {"retention_priority": 50.5},
    ):
        (name,) = bad
        for method, path, key in (
            ("POST", "/v1/conversations", None),
            ("PATCH", f"/v1/conversations/{conv}", None),
            ("PUT", f"/v1/admin/sessions/{conv}", admin),
            ("PUT", "/v1/admin/defaults", admin),
        ):
            r = service.client.request(method, path, headers=service.headers(key), json=bad)
            assert r.status_code == 400, (method, path, bad, r.text)
            assert r.json()["error"]["param"] == name, (method, path, r.text)
    settings = service.get(f"/v1/admin/sessions/{conv}", key=admin).json()["settings"]
    assert set(settings.values()) == {None}  # nothing was written
    assert retention(service.get("/v1/admin/defaults", key=admin).json()) == (None, None)

    # The bounds are settings (a week's hold, the top rank), stored and read back as given.
    both = {"retention_ttl_s": WEEK_S, "retention_priority": 100}
    conv = service.post("/v1/conversations", both).json()["id"]
    assert retention(service.get(f"/v1/conversations/{conv}").json()) == (WEEK_S, 100)
    view = service.get(f"/v1/admin/sessions/{conv}", key=admin).json()
    assert retention(view["settings"]) == retention(view["effective"]) == (WEEK_S, 100)
    # A turn carries them to the engine, whose retention policy holds the session (its TTL).
    turn(service, conv, "Hold my cache for a week, please.")
    engine = engine_of(service, conv, admin)
    assert retention(engine) == (WEEK_S, 100)
    assert (engine["tier"], engine["class"], engine["held"]) == ("device", "person", True)
    listed = service.get("/v1/admin/sessions", key=admin).json()
    (row,) = [s for s in listed["data"] if s["session_id"] == conv]
    assert retention(row["budget"]) == (WEEK_S, 100)
    assert (row["tier"], row["class"], row["held"]) == ("device", "person", True)
    assert row["next_turn_s"] is None or row["next_turn_s"] >= 0

    # PUT (null: back to the default; 0: a setting, the lowest rank) reaches the engine at
    # once, and the policy at the next turn: no TTL, no hold.
    changed = {"retention_ttl_s": None, "retention_priority": 0}
    r = put(service, f"/v1/admin/sessions/{conv}", changed, admin)
    assert r.status_code == 200, r.text
    assert retention(r.json()["settings"]) == retention(r.json()["engine"]) == (None, 0)
    turn(service, conv, "Never mind.")
    assert engine_of(service, conv, admin)["held"] is False

    # The server's defaults are what a conversation that sets none runs with.
    try:
        defaults = {"retention_ttl_s": 3600, "retention_priority": 70}
        r = put(service, "/v1/admin/defaults", defaults, admin)
        assert r.status_code == 200 and retention(r.json()) == (3600, 70), r.text
        plain = service.post("/v1/conversations", {}).json()["id"]
        view = service.get(f"/v1/admin/sessions/{plain}", key=admin).json()
        assert retention(view["settings"]) == (None, None)
        assert retention(view["effective"]) == (3600, 70)
        turn(service, plain, "Defaults, please.")
        engine = engine_of(service, plain, admin)
        assert retention(engine) == (3600, 70) and engine["held"] is True
    finally:
        unset = {"retention_ttl_s": None, "retention_priority": None}
        put(service, "/v1/admin/defaults", unset, admin)

    # A row out of range (written by hand) reads as unset in every view, and a turn on it is
    # refused naming the field until PUT repairs it.
    service.client.portal.call(
        lambda: service.state.store.update_conversation("alice", conv, retention_priority=500)
    )
    view = service.get(f"/v1/admin/sessions/{conv}", key=admin).json()
    assert view["settings"]["retention_priority"] == 500
    assert view["effective"]["retention_priority"] is None  # the default's
    assert view["error"]["param"] == "retention_priority"
    readable(service, conv)
    refused = service.post(f"/v1/conversations/{conv}/messages", {"content": "Hi"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "retention_priority"
    repaired = put(service, f"/v1/admin/sessions/{conv}", {"retention_priority": 20}, admin)
    assert repaired.status_code == 200 and repaired.json()["error"] is None, repaired.text
    assert turn(service, conv, "Hi")["status"] == "complete"
    assert engine_of(service, conv, admin)["retention_priority"] == 20
