"""How a fleet is deployed: docker-compose.yml (checked structurally: docker compose cannot run
on this machine, it has no container engine), deploy/haproxy.cfg as the template's rendering,
HAProxy's own check of every rendering, and `kvchat fleet` (what `make fleet` runs) started as
a process, chatted with through the openai client, and stopped with Ctrl-C."""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from openai import OpenAI

from kvchat.app.fleet import HAProxyConfig, ReplicaAddress, haproxy_binary
from kvchat_testing.fleet import REDIS
from kvchat_testing.service import drop_postgres_database, free_port, postgres_url

REPO = Path(__file__).resolve().parents[3]


def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def test_compose_runs_haproxy_two_replicas_sharing_a_kv_volume_postgres_and_redis() -> None:
    spec = compose()
    services = spec["services"]
    assert {"haproxy", "app1", "app2", "postgres", "redis", "migrate"} <= set(services)
    assert "kv-store" in spec["volumes"]
    config = HAProxyConfig.compose()
    for name in ("app1", "app2"):
        app = services[name]
        env = app["environment"]
        # One volume, both replicas, where their KV store is.
        assert f"kv-store:{env['KVCHAT_KV_STORE_DIR']}" in app["volumes"]
        assert int(env["KVCHAT_KV_STORE_BYTES"]) > 0
        assert env["KVCHAT_REPLICA_ID"] == name  # HAProxy's server name
        assert env["KVCHAT_REDIS_URL"].startswith("redis://redis:")
        assert (
            env["KVCHAT_DATABASE_URL"].startswith("postgresql://")
            and "@postgres:" in env["KVCHAT_DATABASE_URL"]
        )
        assert env["KVCHAT_KEYLESS_SESSIONS"] == "true"
        assert int(env["KVCHAT_DRAIN_PROBES"]) == config.drain_probes
        assert float(env["KVCHAT_DRAIN_GRACE"]) >= config.drain_grace
        assert "readyz" in " ".join(app["healthcheck"]["test"])
        assert app["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert app["command"] == ["kvchat", "serve"]
    assert services["migrate"]["command"] == ["kvchat", "db", "upgrade"]
    haproxy = services["haproxy"]
    assert haproxy["image"] == "haproxy:2.6"
    assert "./deploy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in haproxy["volumes"]
    assert {"8080:8080", "8404:8404"} <= set(haproxy["ports"])
    for name in ("haproxy", "postgres", "redis"):
        assert services[name]["healthcheck"]["test"], name
    assert [s.name for s in config.servers] == ["app1", "app2"]


def test_deploy_haproxy_cfg_is_the_template_rendered_and_haproxy_accepts_it() -> None:
    path = REPO / "deploy" / "haproxy.cfg"
    assert path.read_text() == HAProxyConfig.compose().render(), (
        "deploy/haproxy.cfg is stale: run `python -m kvchat.app.fleet`"
    )
    check = subprocess.run(
        [haproxy_binary(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60
    )
    # app1 and app2 resolve only inside compose's network: HAProxy starts without them.
    assert check.returncode == 0, check.stderr
    assert "could not resolve address 'app1'" in check.stderr


@pytest.mark.parametrize("num_replicas", [1, 3, 5])
@pytest.mark.parametrize("balance", ["affinity", "roundrobin"])
def test_every_rendering_is_a_configuration_haproxy_accepts(
    num_replicas: int, balance: str, tmp_path: Path
) -> None:
    config = HAProxyConfig(
        servers=tuple(
            ReplicaAddress(f"app{i + 1}", f"127.0.0.1:{9000 + i}") for i in range(num_replicas)
        ),
        balance=balance,  # type: ignore[arg-type]
    )
    text = config.render()
    assert text.count("track kvchat_affinity/") == num_replicas
    assert ("hash-type consistent" in text) == (balance == "affinity")
    path = tmp_path / "haproxy.cfg"
    path.write_text(text)
    check = subprocess.run(
        [haproxy_binary(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0 and "Configuration file is valid" in check.stdout, check.stderr


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"servers": ()}, "at least one replica"),
        ({"servers": (ReplicaAddress("a", "h:1"), ReplicaAddress("a", "h:2"))}, "unique"),
        ({"balance": "random"}, "balance must be one of"),
        ({"check_interval_ms": 5}, "check_interval_ms"),
        ({"fall": 0}, "fall and rise"),
        ({"bufsize": 1024}, "bufsize"),
    ],
)
def test_bad_configurations_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HAProxyConfig(**{"servers": (ReplicaAddress("a", "h:1"),), **fields})


@pytest.mark.parametrize(("name", "address"), [("a b", "h:1"), ("a", "h"), ("a", ":1")])
def test_bad_replica_addresses_are_refused(name: str, address: str) -> None:
    with pytest.raises(ValueError, match="replica"):
        ReplicaAddress(name, address)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "kvchat.app.cli", "fleet", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--replicas", "0", "--replicas must be >= 1"),
        ("--database-url", "sqlite+aiosqlite:///x.db", "Postgres"),
        ("--balance", "random", "--balance must be one of"),
        ("--model", "/nonexistent", "no model at"),
    ],
)
def test_kvchat_fleet_refuses_what_cannot_run(
    dev_model: Path, option: str, value: str, message: str
) -> None:
    """One `error:` line and exit code 2, before any process starts."""
    options = {
        "--model": str(dev_model),
        "--database-url": "postgresql://u@h/d",
        "--redis-url": REDIS,
        option: value,
    }
    result = cli(*[x for pair in options.items() for x in pair])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


# Runs the command after it with SIGINT ignored, as a shell without job control starts
# `kvchat fleet &` (an exec keeps an ignored signal ignored): SIGINT must stop it all the same.
WITH_SIGINT_IGNORED = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.argv[1], sys.argv[1:])",
]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_kvchat_fleet_starts_a_fleet_an_openai_client_chats_through(
    dev_model: Path, tmp_path: Path
) -> None:
    """What `make fleet` runs, on a database that does not exist yet (created and migrated):
    it prints the proxy's URL and an admin key, the openai client chats through it, and
    Ctrl-C (SIGINT) stops HAProxy and every replica."""
    name = f"kvchat_test_{secrets.token_hex(6)}"
    url = postgres_url(name).set(drivername="postgresql").render_as_string(hide_password=False)
    port, stats = free_port(), free_port()
    process = subprocess.Popen(
        [
            *WITH_SIGINT_IGNORED,
            sys.executable,
            "-P",
            "-m",
            "kvchat.app.cli",
            "fleet",
            "--model",
            str(dev_model),
            "--replicas",
            "2",
            "--database-url",
            url,
            "--redis-url",
            REDIS,
            "--redis-prefix",
            f"kvchat-test-{secrets.token_hex(5)}:",
            "--port",
            str(port),
            "--stats-port",
            str(stats),
            "--run-dir",
            str(tmp_path / "fleet"),
            "--create-database",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KVCHAT_KV_CACHE_BYTES": str(64 * 2**20), "OMP_NUM_THREADS": "1"},
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "Ctrl-C stops them all" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(600) or process.poll() is not None, "".join(lines)
        output = "".join(lines)
        assert process.poll() is None, output
        assert f"on http://127.0.0.1:{port} through HAProxy" in output
        key = re.search(r"created an admin API key \(shown once, keep it\): (\S+)", output)
        assert key is not None, output
        replica_ports = [int(p) for p in re.findall(r"app\d http://127\.0\.0\.1:(\d+)", output)]
        assert len(replica_ports) == 2

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key.group(1))
        messages: list[Any] = [{"role": "user", "content": "Hello, fleet"}]
        served = set()
        for _ in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model="dev", messages=messages, max_tokens=4, temperature=0
            )
            served.add(raw.headers["x-kvchat-replica"])
            messages += [
                {"role": "assistant", "content": raw.parse().choices[0].message.content},
                {"role": "user", "content": "More"},
            ]
        assert len(served) == 1 and served <= {"app1", "app2"}

        process.send_signal(signal.SIGINT)
        assert process.wait(180) == 0, "".join(lines)
        deadline = time.monotonic() + 30  # the reader thread drains the last lines
        while "kvchat fleet: stopped" not in "".join(lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "kvchat fleet: stopped" in "".join(lines)
        assert not any(listening(p) for p in [port, stats, *replica_ports])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        drop_postgres_database(name)
