"""HAProxyConfig: the HAProxy configuration of a fleet, rendered from the one template
(app/fleet/haproxy.cfg.j2) for `kvchat fleet`, the tests, the benchmark and docker-compose
(deploy/haproxy.cfg is its rendering for two replicas: `python -m kvchat.app.fleet` writes it
again)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import jinja2

TEMPLATE = Path(__file__).with_name("haproxy.cfg.j2")
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
Balance = Literal["affinity", "roundrobin", "leastconn"]
BALANCES: tuple[str, ...] = ("affinity", "roundrobin", "leastconn")


@dataclass(frozen=True)
class ReplicaAddress:
    """One replica as HAProxy names it (its server name is the replica's id, so the stats page,
    `X-Kvchat-Replica` and `/metrics` agree) and reaches it (`host:port`)."""

    name: str
    address: str

    def __post_init__(self) -> None:
        if not NAME.match(self.name):
            raise ValueError(
                f"a replica name is 1-64 letters, digits, '.', '_' or '-', got {self.name!r}"
            )
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a replica address is host:port, got {self.address!r}")


@dataclass(frozen=True)
class HAProxyConfig:
    """`balance`: "affinity" (consistent hash of the routing key; the fleet's) or a plain
    HAProxy algorithm for comparison (the benchmark's round-robin). Health checks of
    `/readyz` every `check_interval_ms`: `fall` failures take a replica out, `rise`
    successes put it back; a check unanswered after `check_timeout_ms` fails (a hung replica,
    SIGSTOPped or wedged, is out within about fall x (check_timeout + check_interval))."""

    servers: tuple[ReplicaAddress, ...]
    bind: str = "127.0.0.1:8080"
    stats_bind: str | None = "127.0.0.1:8404"
    balance: Balance = "affinity"
    check_interval_ms: int = 1000
    check_timeout_ms: int = 2000
    fall: int = 2
    rise: int = 2
    bufsize: int = 64 * 1024
    maxconn: int = 4096
    log_level: str = "notice"
    resolver: str | None = None  # a DNS server (host:port) for replicas named by host name
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("a fleet needs at least one replica")
        names = tuple(s.name for s in self.servers)
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique, got {', '.join(names)}")
        object.__setattr__(self, "names", names)
        if self.balance not in BALANCES:
            raise ValueError(f"balance must be one of {', '.join(BALANCES)}, got {self.balance!r}")
        if self.check_interval_ms < 10:
            raise ValueError(f"check_interval_ms must be >= 10, got {self.check_interval_ms}")
        if self.check_timeout_ms < 10:
            raise ValueError(f"check_timeout_ms must be >= 10, got {self.check_timeout_ms}")
        if self.fall < 1 or self.rise < 1:
            raise ValueError("fall and rise must be >= 1")
        if self.bufsize < 16 * 1024:
            raise ValueError(f"bufsize must be >= 16 KiB, got {self.bufsize}")

    @property
    def drain_probes(self) -> int:
        """Health checks a draining replica answers before it may stop listening: HAProxy
        takes it out on the `fall`-th failed one and sends the next only after that."""
        return self.fall + 1

    @property
    def drain_grace(self) -> float:
        """The most seconds a draining replica waits for them (a lost check, a slow HAProxy)."""
        return max(1.0, (self.fall + 3) * self.check_interval_ms / 1000)

    def render(self) -> str:
        env = jinja2.Environment(
            undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False
        )
        template = env.from_string(TEMPLATE.read_text())
        return template.render(
            servers=self.servers,
            bind=self.bind,
            stats_bind=self.stats_bind,
            balance=self.balance,
            check_interval_ms=self.check_interval_ms,
            check_timeout_ms=self.check_timeout_ms,
            fall=self.fall,
            rise=self.rise,
            bufsize=self.bufsize,
            maxconn=self.maxconn,
            log_level=self.log_level,
            resolver=self.resolver,
        )

    @classmethod
    def compose(cls, num_replicas: int = 2) -> HAProxyConfig:
        """docker-compose.yml's: replicas `app1`.. on port 8000 found through Docker's DNS,
        HAProxy on 8080 and its stats on 8404 (deploy/haproxy.cfg is this, rendered)."""
        return cls(
            servers=tuple(
                ReplicaAddress(f"app{i + 1}", f"app{i + 1}:8000") for i in range(num_replicas)
            ),
            bind="*:8080",
            stats_bind="*:8404",
            resolver="127.0.0.11:53",
        )
