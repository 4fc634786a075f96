"""The fleet tests' fleet: real HAProxy, Postgres, Redis and replica processes of the dev model,
started by the code `kvchat fleet` runs (app.fleet.Fleet), one fleet per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvchat.app.fleet import Fleet
from kvchat_testing.fleet import fleet_config
from kvchat_testing.service import postgres_database


@pytest.fixture(scope="module")
def fleet(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Three replicas behind HAProxy on a database of their own."""
    with (
        postgres_database() as url,
        Fleet(
            fleet_config(dev_model, url, tmp_path_factory.mktemp("fleet"), num_replicas=3)
        ) as running,
    ):
        assert running.admin_key is not None
        yield running
