"""The service as a real process (`kvchat serve`, what `make serve` runs) driven by real
clients: the README's examples, the official openai client in an agent loop, a crash in the
middle of a reply, a client that leaves, Postgres."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from kvchat_testing.service import Server, postgres_database

REPO = Path(__file__).resolve().parents[2]
README_MODEL = "smollm2-135m-instruct"  # the model the README's examples name


@pytest.fixture(scope="module")
def server(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`kvchat serve` on the embedded defaults, from a fresh working directory."""
    server = Server(dev_model, tmp_path_factory.mktemp("data")).start()
    assert server.key is not None, "no key printed on first start:\n" + "".join(server.output)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def real_server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`kvchat serve` of SmolLM2-135M-Instruct, what `make serve` serves, under its name."""
    server = Server(
        smollm2_dir,
        tmp_path_factory.mktemp("data"),
        env={"KVCHAT_SERVED_MODEL_NAME": README_MODEL},
    ).start()
    try:
        yield server
    finally:
        server.stop()


def readme_examples() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```(bash|python) example\n(.*?)```", text, re.S)
    return [(lang, code) for lang, code in blocks]


def test_the_readme_examples_work_as_printed(real_server: Server) -> None:
    """Every example against the model `make serve` serves; the first one's answer is the
    sentence the README prints."""
    server = real_server
    examples = readme_examples()
    assert {lang for lang, _ in examples} == {"bash", "python"} and len(examples) >= 4
    assert all(README_MODEL in code for lang, code in examples if "model" in code)
    env = {**os.environ, "KVCHAT_URL": server.url, "KVCHAT_API_KEY": server.key or ""}
    outputs = []
    for lang, code in examples:
        command = (
            ["bash", "-euo", "pipefail", "-c", code]
            if lang == "bash"
            else [sys.executable, "-c", code]
        )
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{code}\n{proc.stdout}\n{proc.stderr}"
        assert proc.stdout.strip(), code
        assert "error" not in proc.stdout.lower() or lang == "python", proc.stdout
        outputs.append(proc.stdout)
    first = json.loads(outputs[0])
    assert first["model"] == README_MODEL
    assert first["choices"][0]["message"]["content"] == "The capital of France is Paris."


def test_the_first_start_printed_its_url_and_a_working_admin_key(server: Server) -> None:
    output = "".join(server.output)
    assert f"http://127.0.0.1:{server.port}" in output
    assert output.count("created an admin API key") == 1
    models = httpx.get(f"{server.url}/v1/models", headers=server.headers()).json()
    assert models["data"][0]["id"] == "dev"


def test_an_agent_loop_with_the_openai_client(server: Server) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key=server.key)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    messages: list[Any] = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    first = client.chat.completions.create(
        model="dev",
        messages=messages,
        tools=tools,
        max_tokens=16,
        temperature=0,
        extra_headers={"X-Session-Id": "loop"},
    )
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    # The model is random: the call the agent makes is written by the test, as an agent
    # would have parsed it; the server must accept it and the tool result.
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_add_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})},
                }
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": "call_add_1", "content": "5"})
    reply = client.chat.completions.create(
        model="dev",
        messages=messages,
        tools=tools,
        max_tokens=16,
        temperature=0,
        extra_headers={"X-Session-Id": "loop"},
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    # The first reply was spliced back by its ids: everything up to the new messages reused.
    assert reply.usage.prompt_tokens_details.cached_tokens >= (
        first.usage.prompt_tokens + first.usage.completion_tokens
    )  # type: ignore[union-attr]
    streamed = client.chat.completions.create(
        model="dev", messages=messages, tools=tools, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == (reply.choices[0].message.content or "")
    # The SDK's typed errors: a bad request is a BadRequestError with the param named.
    with pytest.raises(Exception) as err:
        client.chat.completions.create(model="dev", messages=messages, temperature=5)
    assert getattr(err.value, "status_code", None) == 400
    assert "temperature" in str(err.value)


def new_conversation(server: Server, **fields: Any) -> str:
    r = httpx.post(f"{server.url}/v1/conversations", headers=server.headers(), json=fields)
    return str(r.json()["id"])


def messages(server: Server, conv: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{server.url}/v1/conversations/{conv}/messages", headers=server.headers())
    return r.json()["data"]  # type: ignore[no-any-return]


def wait_for(predicate: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_a_client_that_leaves_mid_stream_stops_the_reply(server: Server) -> None:
    conv = new_conversation(server)
    with httpx.stream(
        "POST",
        f"{server.url}/v1/conversations/{conv}/messages",
        headers=server.headers(),
        timeout=60,
        json={"content": "Write at length", "max_tokens": 3000, "temperature": 1.0, "stream": True},
    ) as r:
        deltas = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "delta":
                deltas += 1
                if deltas == 3:
                    break  # and close the connection
    reply = wait_for(lambda: (m := messages(server, conv)[-1])["status"] != "generating" and m)
    assert reply["status"] == "cancelled"
    assert 3 <= reply["usage"]["completion_tokens"] < 3000
    # The same for a client of the non-streaming API.
    conv2 = new_conversation(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/conversations/{conv2}/messages",
            headers=server.headers(),
            json={"content": "Again", "max_tokens": 3000, "temperature": 1.0},
            timeout=1.5,
        )
    reply = wait_for(
        lambda: (m := messages(server, conv2)) and m[-1]["status"] != "generating" and m[-1]
    )
    assert reply["status"] == "cancelled" and reply["usage"]["completion_tokens"] < 3000


def test_sigkill_mid_reply_loses_nothing(dev_model: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = Server(dev_model, data, env={"KVCHAT_REPLY_CHECKPOINT_INTERVAL": "0.05"}).start()
    conv = new_conversation(server, title="crash")
    seen = ""
    with httpx.stream(
        "POST",
        f"{server.url}/v1/conversations/{conv}/messages",
        headers=server.headers(),
        timeout=60,
        json={
            "content": "Please answer slowly",
            "max_tokens": 3000,
            "temperature": 1.0,
            "stream": True,
        },
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "delta":
                seen += event["text"]
            # Kill once the text the client saw has been written (a checkpoint).
            if len(seen) >= 20 and (messages(server, conv)[-1]["content"] or ""):
                server.stop(signal.SIGKILL)
                break
    assert server.process is not None and server.process.returncode == -signal.SIGKILL
    restarted = Server(dev_model, data, key=server.key).start()
    try:
        # The existing key is kept: no new one is made or printed.
        assert "created an admin API key" not in "".join(restarted.output)
        stored = messages(restarted, conv)
        assert [(m["role"], m["content"]) for m in stored][:1] == [("user", "Please answer slowly")]
        assert stored[1]["role"] == "assistant" and stored[1]["status"] == "interrupted"
        # The interrupted reply keeps the text streamed up to its last checkpoint: the same
        # stream as the client's, cut at one point or the other.
        kept = stored[1]["content"] or ""
        assert kept and (seen.startswith(kept) or kept.startswith(seen)), (kept, seen)
        r = httpx.post(
            f"{restarted.url}/v1/conversations/{conv}/messages",
            headers=restarted.headers(),
            timeout=120,
            json={"content": "Are you back?", "max_tokens": 8},
        )
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "complete"
        assert [m["role"] for m in messages(restarted, conv)] == [
            "user",
            "assistant",
            "user",
            "assistant",
        ]
    finally:
        restarted.stop()


def test_postgres_must_be_migrated_first(dev_model: Path, tmp_path: Path) -> None:
    with postgres_database(migrated=False) as url:
        proc = subprocess.run(
            [
                sys.executable,
                "-P",
                "-m",
                "kvchat.app.cli",
                "serve",
                "--model",
                str(dev_model),
                "--database-url",
                url,
                "--port",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "kvchat db upgrade" in lines[0], proc.stderr
        upgrade = subprocess.run(
            [sys.executable, "-P", "-m", "kvchat.app.cli", "db", "upgrade", "--database-url", url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert upgrade.returncode == 0, upgrade.stderr
        keys = subprocess.run(
            [
                sys.executable,
                "-P",
                "-m",
                "kvchat.app.cli",
                "keys",
                "create",
                "--name",
                "ops",
                "--database-url",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert keys.returncode == 0, keys.stderr
        key = keys.stdout.strip()
        server = Server(dev_model, tmp_path, env={"KVCHAT_DATABASE_URL": url}, key=key).start()
        try:
            assert "created an admin API key" not in "".join(server.output)
            conv = new_conversation(server)
            r = httpx.post(
                f"{server.url}/v1/conversations/{conv}/messages",
                headers=server.headers(),
                timeout=120,
                json={"content": "Hello Postgres", "max_tokens": 6},
            )
            assert r.status_code == 200, r.text
        finally:
            server.stop()


def test_the_admin_commands_against_the_running_server(server: Server) -> None:
    conv = new_conversation(server)
    httpx.post(
        f"{server.url}/v1/conversations/{conv}/messages",
        headers=server.headers(),
        json={"content": "Something to pin", "max_tokens": 4},
        timeout=60,
    )
    env = {
        **os.environ,
        "KVCHAT_URL": server.url,
        "KVCHAT_API_KEY": server.key or "",
        "COLUMNS": "200",
    }

    def admin(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-P", "-m", "kvchat.app.cli", "admin", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    memory = admin("memory")
    assert memory.returncode == 0, memory.stderr
    assert "KV memory" in memory.stdout and conv in memory.stdout
    session = admin("session", conv, "--max-kv-tokens", "48", "--policy", "summarize")
    assert session.returncode == 0, session.stderr
    assert "max_kv_tokens" in session.stdout and "48" in session.stdout
    assert "summarize" in session.stdout
    wait_for(
        lambda: (
            httpx.get(f"{server.url}/v1/admin/sessions/{conv}", headers=server.headers()).json()[
                "engine"
            ]["state"]
            == "resident"
        )
    )
    evicted = admin("evict", conv)
    assert evicted.returncode == 0, evicted.stderr
    assert evicted.stdout.strip() == f"{conv}: resident -> offloaded"
    missing = admin("evict", "conv_missing")
    assert missing.returncode == 2 and missing.stderr.startswith("error: 404")


def test_sigterm_mid_reply_stores_it_before_exiting(dev_model: Path, tmp_path: Path) -> None:
    """A graceful stop: the engine drains for KVCHAT_DRAIN_TIMEOUT, then stops what is left;
    every reply is stored (interrupted, with what it had) before the process exits."""
    data = tmp_path / "data"
    server = Server(dev_model, data, env={"KVCHAT_DRAIN_TIMEOUT": "0.5"}).start()
    conv = new_conversation(server)
    deltas = 0
    with httpx.stream(
        "POST",
        f"{server.url}/v1/conversations/{conv}/messages",
        headers=server.headers(),
        timeout=60,
        json={
            "content": "Go on",
            "max_tokens": 3000,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "delta":
                deltas += 1
                if deltas == 3:
                    # uvicorn exits by re-raising the signal once it has shut down.
                    assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
                    break
    restarted = Server(dev_model, data, key=server.key).start()
    try:
        reply = messages(restarted, conv)[-1]
        assert reply["status"] == "interrupted" and reply["finish_reason"] == "cancelled"
        assert 3 <= reply["usage"]["completion_tokens"] < 3000
        assert reply["content"]
    finally:
        restarted.stop()


def test_sigkill_with_redis_frees_the_conversation_and_answers_the_retry(
    dev_model: Path, tmp_path: Path
) -> None:
    """A replica on Postgres + Redis is killed mid-reply. On restart the turn lock of the dead
    process is taken over at once (its TTL is set to ten minutes here, so expiry cannot be
    what frees it), the reply is stored interrupted with the text the buffered events hold, a
    stop finds nothing to stop, the conversation takes a new turn, and the killed request
    retried with its Idempotency-Key is run again as a new reply to the stored user message
    instead of hanging."""
    import uuid

    with postgres_database() as url:
        keys = subprocess.run(
            [
                sys.executable,
                "-P",
                "-m",
                "kvchat.app.cli",
                "keys",
                "create",
                "--name",
                "ops",
                "--admin",
                "--database-url",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert keys.returncode == 0, keys.stderr
        env = {
            "KVCHAT_DATABASE_URL": url,
            "KVCHAT_REDIS_URL": "redis://127.0.0.1:6379/0",
            "KVCHAT_REDIS_PREFIX": f"kvchat-test-{uuid.uuid4().hex[:10]}:",
            "KVCHAT_TURN_LOCK_TTL": "600",
            "KVCHAT_REPLY_CHECKPOINT_INTERVAL": "0",
        }
        key = keys.stdout.strip()
        server = Server(dev_model, tmp_path, env=env, key=key).start()
        conv = new_conversation(server)
        body = {
            "content": "Tell me everything",
            "max_tokens": 3000,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
        }
        idem = {**server.headers(), "Idempotency-Key": "crash-1"}
        seen = ""
        with httpx.stream(
            "POST",
            f"{server.url}/v1/conversations/{conv}/messages",
            headers=idem,
            timeout=60,
            json=body,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and (event := json.loads(line[6:]))["type"] == "delta":
                    seen += event["text"]
                    if len(seen) >= 30:
                        server.stop(signal.SIGKILL)
                        break
        restarted = Server(dev_model, tmp_path, env=env, key=key, port=server.port).start()
        try:
            stored = messages(restarted, conv)
            assert [m["role"] for m in stored] == ["user", "assistant"]
            reply = stored[1]
            assert reply["status"] == "interrupted"
            # Recovered from the buffered events (checkpoints are off here): the client's
            # stream, cut at one point or the other.
            kept = reply["content"] or ""
            assert kept and (seen.startswith(kept) or kept.startswith(seen)), (kept, seen)
            stop = httpx.post(
                f"{restarted.url}/v1/conversations/{conv}/stop",
                headers=restarted.headers(),
                timeout=30,
            )
            assert stop.json()["stopped"] is False
            again = httpx.post(
                f"{restarted.url}/v1/conversations/{conv}/messages",
                headers=restarted.headers(),
                timeout=60,
                json={"content": "Back?", "max_tokens": 4},
            )
            assert again.status_code == 200, again.text
            # The retry: a new reply to the stored user message, streaming at once.
            with httpx.stream(
                "POST",
                f"{restarted.url}/v1/conversations/{conv}/messages",
                headers=idem,
                timeout=60,
                json=body,
            ) as retry:
                assert retry.status_code == 200
                lines = retry.iter_lines()
                start = next(json.loads(x[6:]) for x in lines if x.startswith("data: "))
                assert start["type"] == "start" and start["parent_id"] == stored[0]["id"]
                assert start["message_id"] != reply["id"]
                httpx.post(
                    f"{restarted.url}/v1/conversations/{conv}/stop",
                    headers=restarted.headers(),
                    timeout=30,
                )
                events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
            assert events[-1]["type"] == "done" and events[-1]["status"] == "cancelled"
            # Retried once more: the re-run's reply is replayed, not run a third time.
            replay = httpx.post(
                f"{restarted.url}/v1/conversations/{conv}/messages",
                headers=idem,
                timeout=60,
                json=body,
            )
            replayed = [
                json.loads(x[6:]) for x in replay.text.splitlines() if x.startswith("data: ")
            ]
            assert replayed[0] == start and replayed[-1] == events[-1]
            tree = httpx.get(
                f"{restarted.url}/v1/conversations/{conv}/messages?all=true",
                headers=restarted.headers(),
            ).json()["data"]
            replies = [m["id"] for m in tree if m["parent_id"] == stored[0]["id"]]
            assert replies == [reply["id"], start["message_id"]]
        finally:
            restarted.stop()
