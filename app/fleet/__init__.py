"""A fleet on one machine: HAProxy (consistent hash of each conversation's routing key, health
checks of /readyz) in front of N `kvchat serve` replicas sharing Postgres and Redis. Used by
`kvchat fleet`, the fleet tests and bench/fleet.py; the HAProxy configuration is the one
template docker-compose's deploy/haproxy.cfg is rendered from."""

from kvchat.app.fleet.fleet import (
    Fleet,
    FleetConfig,
    create_postgres_database,
    drop_postgres_database,
    prepare_database,
)
from kvchat.app.fleet.haproxy_config import BALANCES, HAProxyConfig, ReplicaAddress
from kvchat.app.fleet.processes import FleetError, HAProxy, Replica, free_port, haproxy_binary

__all__ = [
    "BALANCES",
    "Fleet",
    "FleetConfig",
    "FleetError",
    "HAProxy",
    "HAProxyConfig",
    "Replica",
    "ReplicaAddress",
    "create_postgres_database",
    "drop_postgres_database",
    "free_port",
    "haproxy_binary",
    "prepare_database",
]
