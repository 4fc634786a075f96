"""Fleet: HAProxy in front of N replicas of `kvchat serve` on one machine, sharing a Postgres
database and a Redis — what `kvchat fleet` (and `make fleet`) runs, and what the fleet tests
and `bench/fleet.py` start. docker-compose.yml runs the same shape in containers.

The replicas are processes on free ports, named `app1`..`appN` (their replica ids, HAProxy's
server names, the `X-Kvchat-Replica` of their responses). Each drains on SIGTERM for as long
as HAProxy's checks need to take it out (HAProxyConfig.drain_probes / drain_grace), and runs
stateless keyless calls in sessions named by their opening, as HAProxy routes them."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvchat.app.fleet.haproxy_config import Balance, HAProxyConfig, ReplicaAddress
from kvchat.app.fleet.processes import FleetError, HAProxy, Replica, free_port

ROUTED_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class FleetConfig:
    """`database_url` must be a database every replica reaches (Postgres); `redis_url` the
    coordination they share; `redis_prefix` keeps this fleet's keys apart from others' on the
    same Redis. `port` / `stats_port`: HAProxy's (None: free ports). `replica_env`: more
    KVCHAT_* settings for every replica. `create_database`: create a missing Postgres
    database (the migrations run either way)."""

    model: Path
    database_url: str
    redis_url: str
    num_replicas: int = 2
    run_dir: Path = Path("data/fleet")
    host: str = "127.0.0.1"
    port: int | None = None
    stats_port: int | None = None
    redis_prefix: str = "kvchat:"
    balance: Balance = "affinity"
    check_interval_ms: int = 1000
    fall: int = 2
    rise: int = 2
    replica_env: Mapping[str, str] = field(default_factory=dict)
    create_database: bool = False

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got {self.num_replicas}")
        if self.database_url.startswith("sqlite"):
            raise ValueError(
                "a fleet's replicas share one database: give a Postgres URL "
                "(postgresql://user@host:5432/name)"
            )


class Fleet:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        run_dir = config.run_dir
        self.replicas = [
            Replica(
                name=f"app{i + 1}",
                log_path=run_dir / f"app{i + 1}.log",
                host=config.host,
                model=config.model,
            )
            for i in range(config.num_replicas)
        ]
        self.port = config.port or free_port(config.host)
        self.stats_port = config.stats_port or free_port(config.host)
        self.haproxy_config = HAProxyConfig(
            servers=tuple(ReplicaAddress(r.name, r.address) for r in self.replicas),
            bind=f"{config.host}:{self.port}",
            stats_bind=f"{config.host}:{self.stats_port}",
            balance=config.balance,
            check_interval_ms=config.check_interval_ms,
            fall=config.fall,
            rise=config.rise,
        )
        self.haproxy = HAProxy(
            name="haproxy",
            log_path=run_dir / "haproxy.log",
            config_path=run_dir / "haproxy.cfg",
            bind=self.haproxy_config.bind,
            stats_bind=self.haproxy_config.stats_bind,
        )
        self.admin_key: str | None = None
        for replica in self.replicas:
            replica.env = self._replica_env(replica)

    def _replica_env(self, replica: Replica) -> dict[str, str]:
        c, h = self.config, self.haproxy_config
        return {
            "KVCHAT_DATABASE_URL": c.database_url,
            "KVCHAT_REDIS_URL": c.redis_url,
            "KVCHAT_REDIS_PREFIX": c.redis_prefix,
            "KVCHAT_DATA_DIR": str(c.run_dir / replica.name),
            # One KV store for the fleet: a conversation that moves loads its blocks there.
            "KVCHAT_KV_STORE_DIR": str(c.run_dir / "kv"),
            "KVCHAT_KEYLESS_SESSIONS": "true",
            "KVCHAT_DRAIN_GRACE": str(h.drain_grace),
            "KVCHAT_DRAIN_PROBES": str(h.drain_probes),
            **c.replica_env,
        }

    # -- addresses ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def stats_url(self) -> str:
        return f"http://{self.config.host}:{self.stats_port}/"

    def replica(self, name: str) -> Replica:
        for replica in self.replicas:
            if replica.name == name:
                return replica
        raise KeyError(f"no replica {name!r} (the fleet has {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.replicas]

    # -- starting and stopping ---------------------------------------------------------------

    def start(self) -> Fleet:
        """Prepare the database (create it if asked, migrate, make an admin key when it has
        none), start the replicas (loading their models side by side), then HAProxy, and wait
        until HAProxy routes to every replica."""
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        self.admin_key = asyncio.run(
            prepare_database(self.config.database_url, create=self.config.create_database)
        )
        try:
            for replica in self.replicas:
                replica.start()
            for replica in self.replicas:
                replica.wait_ready()
            self.haproxy.config_path.write_text(self.haproxy_config.render())
            self.haproxy.start()
            for replica in self.replicas:
                self.wait_routed(replica.name)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every replica at once, then HAProxy. The whole fleet goes, so no replica waits
        to be taken out of rotation: SIGTERM then SIGINT (two signals, never coalesced: the
        second skips the drain's grace); in-flight turns still get their drain_timeout."""
        for replica in self.replicas:
            replica.send_signal(signal.SIGTERM)
            replica.send_signal(signal.SIGINT)
        with ThreadPoolExecutor(max(1, len(self.replicas))) as pool:
            list(pool.map(lambda r: r.wait(), self.replicas))
        self.haproxy.stop()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def kill(self, name: str) -> None:
        """SIGKILL a replica (a crash) and reap it."""
        self.replica(name).stop(signal.SIGKILL)

    def restart(self, name: str, sig: int = signal.SIGTERM) -> int | None:
        """Stop a replica with `sig` (SIGTERM: it drains), start it again on its port and wait
        until HAProxy routes to it again. The stopped process's exit code."""
        replica = self.replica(name)
        code = replica.stop(sig)
        self.start_replica(name)
        return code

    def start_replica(self, name: str) -> None:
        replica = self.replica(name)
        replica.start()
        replica.wait_ready()
        self.wait_routed(name)

    def wait_routed(self, name: str, up: bool = True, timeout: float = ROUTED_TIMEOUT_S) -> None:
        """Until HAProxy's checks have put the replica in rotation (`up`) or taken it out."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.haproxy.server_status().get(name, "")
            if (status == "UP") if up else status.startswith(("DOWN", "MAINT", "NOLB")):
                return
            self.haproxy.check_alive()
            if time.monotonic() > deadline:
                raise FleetError(f"HAProxy still says {name} is {status!r}")
            time.sleep(0.05)

    def exited(self) -> Iterator[Replica]:
        """Replicas whose process has ended (a supervisor's view)."""
        return (r for r in self.replicas if r.process is not None and not r.is_running)


async def prepare_database(url: str, *, create: bool = False) -> str | None:
    """Create the Postgres database when asked and missing, migrate it to head, and make an
    admin API key when it has none. Returns that key (shown once), else None."""
    from kvchat.app.store import Store, upgrade
    from kvchat.app.store.database import database_url

    parsed = database_url(url)
    if create:
        await create_postgres_database(url)
    await upgrade(parsed)
    store = await Store.open(parsed)
    try:
        if await store.count_keys() == 0:
            _, plaintext = await store.create_key("fleet", admin=True)
            return plaintext
        return None
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def _server_connection(url: str) -> AsyncIterator[tuple[Any, str]]:
    """An asyncpg connection to the server of the Postgres URL `url` (through its `postgres`
    database), and the name of the database `url` names."""
    import asyncpg

    from kvchat.app.store.database import database_url

    parsed = database_url(url)
    name = parsed.database
    if not name:
        raise ValueError(f"a Postgres URL names its database: {url!r}")
    admin = parsed.set(drivername="postgresql", database="postgres")
    connection = await asyncpg.connect(admin.render_as_string(hide_password=False), timeout=10)
    try:
        yield connection, name
    finally:
        await connection.close()


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def create_postgres_database(url: str) -> bool:
    """Create the database `url` names on its server if it does not exist (through the
    server's `postgres` database). Whether it was created."""
    import asyncpg

    async with _server_connection(url) as (connection, name):
        if await connection.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            return False
        with contextlib.suppress(asyncpg.DuplicateDatabaseError):  # another fleet won
            await connection.execute(f"CREATE DATABASE {_quoted(name)}")
        return True


async def drop_postgres_database(url: str) -> None:
    """Drop the database `url` names (its other connections are ended first), if it exists:
    what a benchmark's fleet of its own leaves behind."""
    async with _server_connection(url) as (connection, name):
        await connection.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        await connection.execute(f"DROP DATABASE IF EXISTS {_quoted(name)}")
