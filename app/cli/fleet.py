"""`kvchat fleet`: HAProxy in front of N replicas of `kvchat serve` on this machine, against a
shared Postgres and Redis (what `make fleet` runs). Prints the proxy's URL and, when the
database has no key yet, an admin key; Ctrl-C or SIGTERM stops them all (each replica drains
first)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, NoReturn

import typer

from kvchat.app.cli.settings_flags import as_environment, settings_from_flags, with_setting_flags
from kvchat.app.settings import Settings

SUPERVISE_INTERVAL_S = 1.0

# Settings the fleet gives its replicas itself (the rest are flags passed on to every replica).
FLEET_SETTINGS = frozenset(
    {
        "model",
        "host",
        "port",
        "database_url",
        "redis_url",
        "redis_prefix",
        "data_dir",
        "kv_store_dir",
        "keyless_sessions",
        "drain_grace",
        "drain_probes",
        "replica_id",
    }
)


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _interrupt(sig: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@with_setting_flags(Settings, exclude=FLEET_SETTINGS)
def fleet_cmd(
    database_url: Annotated[
        str,
        typer.Option(
            envvar="KVCHAT_DATABASE_URL", help="The Postgres database every replica shares."
        ),
    ],
    redis_url: Annotated[
        str,
        typer.Option(
            envvar="KVCHAT_REDIS_URL", help="The Redis every replica coordinates through."
        ),
    ],
    replicas: Annotated[int, typer.Option(help="Replica processes to run.")] = 2,
    model: Annotated[Path, typer.Option(envvar="KVCHAT_MODEL", help="Model directory.")] = Path(
        "models/smollm2-135m-instruct"
    ),
    host: Annotated[str, typer.Option(help="Address HAProxy and the replicas bind.")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="HAProxy's port (the fleet's URL).")] = 8080,
    stats_port: Annotated[int, typer.Option(help="HAProxy's stats page.")] = 8404,
    redis_prefix: Annotated[
        str, typer.Option(envvar="KVCHAT_REDIS_PREFIX", help="Prefix of this fleet's Redis keys.")
    ] = "kvchat:",
    run_dir: Annotated[
        Path, typer.Option(help="HAProxy's configuration and every process's log.")
    ] = Path("data/fleet"),
    balance: Annotated[
        str,
        typer.Option(
            help="affinity (consistent hash of the routing key), or roundrobin / leastconn to "
            "compare."
        ),
    ] = "affinity",
    create_database: Annotated[
        bool,
        typer.Option("--create-database", help="Create the Postgres database when it is missing."),
    ] = False,
    *,
    flags: dict[str, Any],
) -> None:
    """Run a fleet: HAProxy (consistent hash of each conversation's routing key, health checks
    of /readyz, its stats page) in front of REPLICAS `kvchat serve` processes on free ports,
    the database migrated first. Every response names its replica in X-Kvchat-Replica. The
    other options are `kvchat serve`'s settings, passed on to every replica."""
    from kvchat.app.cli.model_check import check_model
    from kvchat.app.fleet import BALANCES, Fleet, FleetConfig, FleetError, haproxy_binary
    from kvchat.app.store import StoreError

    settings_from_flags(Settings, flags, fail)  # a bad value fails here, not in N replicas
    if replicas < 1:
        fail(f"--replicas must be >= 1, got {replicas}")
    if balance not in BALANCES:
        fail(f"--balance must be one of {', '.join(BALANCES)}, got {balance!r}")
    if not (model / "config.json").is_file():
        fail(
            f"no model at {model}; create it with `kvchat init-model {model} --preset "
            "smollm2-135m-instruct` (or --preset dev: random weights)"
        )
    try:
        check_model(model)
        haproxy_binary()
        config = FleetConfig(
            model=model,
            database_url=database_url,
            redis_url=redis_url,
            num_replicas=replicas,
            run_dir=run_dir,
            host=host,
            port=port,
            stats_port=stats_port,
            redis_prefix=redis_prefix,
            balance=balance,  # type: ignore[arg-type]
            create_database=create_database,
            replica_env=as_environment(Settings, flags),
        )
    except (ValueError, FleetError) as e:
        fail(str(e))
    fleet = Fleet(config)
    signal.signal(signal.SIGTERM, _interrupt)
    # Explicitly, as uvicorn does for each replica: a shell without job control starts a
    # background command with SIGINT ignored, and Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, _interrupt)
    typer.echo(f"kvchat fleet: starting {replicas} replicas of {model.name} (logs in {run_dir}/)")
    try:
        fleet.start()
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except (StoreError, FleetError, OSError) as e:
        fail(str(e))
    typer.echo(
        f"kvchat fleet: serving {model.name} on {fleet.url} through HAProxy "
        f"(stats at {fleet.stats_url})"
    )
    if fleet.admin_key is not None:
        typer.echo(
            f"kvchat fleet: created an admin API key (shown once, keep it): {fleet.admin_key}"
        )
    else:
        typer.echo(
            "kvchat fleet: the database has keys already (`kvchat keys create "
            "--admin` makes another)"
        )
    typer.echo("kvchat fleet: replicas " + ", ".join(f"{r.name} {r.url}" for r in fleet.replicas))
    typer.echo("kvchat fleet: Ctrl-C stops them all", nl=True)
    reported: set[str] = set()
    try:
        while True:
            time.sleep(SUPERVISE_INTERVAL_S)
            for replica in fleet.exited():
                if replica.name not in reported:
                    reported.add(replica.name)
                    typer.echo(
                        f"kvchat fleet: {replica.name} exited with code "
                        f"{replica.returncode}; HAProxy routes around it (see "
                        f"{replica.log_path})",
                        err=True,
                    )
    except KeyboardInterrupt:
        typer.echo("kvchat fleet: stopping (each replica drains first)")
    finally:
        fleet.stop()
    typer.echo("kvchat fleet: stopped")
