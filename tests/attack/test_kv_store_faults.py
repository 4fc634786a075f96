"""A broken KV store against started `kvchat serve` processes: the store's directory holds a
directory in place of each block file, corrupted blocks (the sign bit of every KV value
flipped), is a read-only volume, or a full one (a tmpfs with no room left). A replica that
restarts on it answers twenty turns of its conversation, each 200 with the reply a server
without a store gives (greedy, the same history), counts the faults in
kvchat:kv_store_errors_total, and its engine loop never stops (/healthz stays 200)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvchat_testing.attack_servers import started_server
from kvchat_testing.service import Server
from kvchat_testing.volumes import read_only, tmpfs

TURNS = 20
REPLY = {"max_tokens": 6, "temperature": 0.0}
QUESTIONS = [
    f"Question {i}: tell me about the number {i * 7 + 3}, please." for i in range(TURNS + 1)
]


def say(server: Server, conv: str, content: str) -> str:
    r = httpx.post(
        f"{server.url}/v1/conversations/{conv}/messages",
        json={"content": content, **REPLY},
        headers=server.headers(),
        timeout=300,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "complete", body
    return str(body["content"])


def new_conversation(server: Server) -> str:
    r = httpx.post(f"{server.url}/v1/conversations", json={}, headers=server.headers(), timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def store_errors(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers(), timeout=30).text
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^kvchat:kv_store_errors_total\{[^}]*\} (\S+)$", text, re.M)
    )


def break_store(kind: str, root: Path) -> None:
    files = sorted(root.rglob("*.safetensors"))
    assert files, "the first server wrote no blocks"
    for f in files:
        if kind == "directory":
            f.unlink()
            f.mkdir()
            (f / "x").write_text("")
        else:  # corrupt (and read_only: corrupt files it cannot remove)
            data = bytearray(f.read_bytes())
            header = 8 + int.from_bytes(data[:8], "little")
            for i in range(header + 3, len(data), 4):
                data[i] ^= 0x80
            f.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def reference(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server without a KV store: every reply it gives is a recompute's."""
    data = tmp_path_factory.mktemp("reference")
    with started_server(dev_model, data, "sqlite", env={"KVCHAT_KV_STORE_BYTES": "0"}) as s:
        yield s


@pytest.mark.parametrize("kind", ["directory", "corrupt", "read_only", "full"])
def test_a_broken_kv_store_costs_recomputes_never_answers(
    kind: str, dev_model: Path, tmp_path: Path, reference: Server
) -> None:
    assert os.geteuid() == 0, "this test mounts real volumes: run it as root (CI does)"
    store = tmp_path / "kv"
    with contextlib.ExitStack() as stack:
        if kind == "full":
            stack.enter_context(tmpfs(store, "4m"))
        env = {"KVCHAT_KV_STORE_DIR": str(store), "KVCHAT_KV_STORE_BYTES": str(1 << 30)}
        data = tmp_path / "data"
        ref_conv = new_conversation(reference)
        expected = [say(reference, ref_conv, QUESTIONS[0])]
        with started_server(dev_model, data, "sqlite", env=env) as first:
            conv = new_conversation(first)
            assert say(first, conv, QUESTIONS[0]) == expected[0]
            key = first.key
        # Stopped (SIGTERM): its turn's blocks are written. Now break what it wrote.
        if kind == "full":
            with (store / "filler").open("wb") as f, contextlib.suppress(OSError):
                f.write(b"\0" * (4 << 20))
        else:
            break_store(kind, store)
        if kind == "read_only":
            stack.enter_context(read_only(store))
        server = Server(dev_model, data, env=env, key=key).start()
        try:
            for question in QUESTIONS[1:]:
                want = say(reference, ref_conv, question)
                got = say(server, conv, question)
                assert got == want, question
            assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200
            assert store_errors(server) > 0, "the broken store was never consulted"
            ready = httpx.get(f"{server.url}/readyz", timeout=30).json()
            assert ready["checks"]["engine"] is True
            assert ready["checks"]["kv_store"]["errors"] > 0
        finally:
            server.stop()
