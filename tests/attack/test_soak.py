"""A short soak (`bench/soak.py`, 3 clients x 45 s) against a started server: REST turns, SSE
streams, WebSocket turns, stops, regenerations, budget changes and evictions mixed; no error of
any kind, and once idle the KV pool holds just what the live sessions hold."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvchat.bench.soak import soak
from kvchat_testing.attack_servers import started_server

CLIENTS = 3
DURATION_S = 45.0


def test_a_short_soak_has_no_errors_and_leaves_the_pool_at_what_sessions_hold(
    dev_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with started_server(dev_model, tmp_path_factory.mktemp("data"), "sqlite") as server:
        assert server.process is not None and server.key is not None
        result = asyncio.run(soak(server.url, server.key, server.process.pid, CLIENTS, DURATION_S))
    print(f"\nsoak: {dict(result.requests)}, RSS {result.rss_growth:+.1%} second half vs first")
    assert sum(result.requests.values()) > 0
    assert result.errors == []
    used, held = result.pool
    assert used == held, f"the pool uses {used} blocks once idle; live sessions hold {held}"
