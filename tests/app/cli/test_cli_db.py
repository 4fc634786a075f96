"""`kvchat db` and `kvchat keys` (kvchat.app.cli.db), in real processes and through typer's
runner."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import URL
from typer.testing import CliRunner

from kvchat.app.cli.db import db_app, keys_app
from kvchat.app.store import Store, default_database_url
from kvchat.app.store.schema import head_revision

runner = CliRunner()


def cli(*args: str, data_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m kvchat.app.cli.db ARGS` in a fresh process, on data_dir's default database."""
    env = {k: v for k, v in os.environ.items() if k != "KVCHAT_DATABASE_URL"}
    if data_dir is not None:
        env["KVCHAT_DATA_DIR"] = str(data_dir)
    return subprocess.run(
        [sys.executable, "-P", "-m", "kvchat.app.cli.db", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_keys_create_prints_the_key_once_then_list_and_revoke(tmp_path: Path) -> None:
    proc = cli(
        "keys", "create", "--name", "ci", "--owner", "acme", "--admin", data_dir=tmp_path / "data"
    )
    assert proc.returncode == 0, proc.stderr
    key = proc.stdout.strip()
    assert proc.stdout == key + "\n" and key.startswith("kvc-") and len(key) == 47
    assert "will not be shown again" in proc.stderr and key not in proc.stderr
    assert (tmp_path / "data" / "kvchat.db").exists()  # the embedded default, migrated

    url = default_database_url(tmp_path / "data")
    listed = runner.invoke(keys_app, ["list", "--database-url", url])
    assert listed.exit_code == 0, listed.output
    assert key[:10] in listed.stdout and key not in listed.stdout
    assert "acme" in listed.stdout and "never" in listed.stdout

    revoked = runner.invoke(keys_app, ["revoke", key[:10]], env={"KVCHAT_DATABASE_URL": url})
    assert revoked.exit_code == 0, revoked.output
    assert f"revoked key {key[:10]}" in revoked.stdout

    async def authenticate() -> object:
        async with await Store.open(url) as store:
            return await store.authenticate(key)

    assert asyncio.run(authenticate()) is None
    again = runner.invoke(keys_app, ["revoke", "ci", "--database-url", url])
    assert again.exit_code == 0 and "already revoked" in again.stdout
    missing = runner.invoke(keys_app, ["revoke", "nobody", "--database-url", url])
    assert missing.exit_code == 2 and missing.stderr.startswith("error: no key")


@pytest.mark.parametrize(
    "url",
    [
        "not-a-url://::",
        "mysql://root:hunter2@db/kvchat",
        "postgresql://u:hunter2@127.0.0.1:1/x",
    ],
)
def test_a_bad_or_unreachable_database_is_one_error_line_and_exit_2(url: str) -> None:
    result = runner.invoke(keys_app, ["list", "--database-url", url])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "hunter2" not in result.output


def test_a_bad_url_in_a_real_process_has_no_traceback() -> None:
    proc = cli("db", "upgrade", "--database-url", "nonsense")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: the database URL does not parse")
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""


def test_db_upgrade_and_current_on_postgres(empty_postgres: URL) -> None:
    url = empty_postgres.render_as_string(hide_password=False)
    before = runner.invoke(db_app, ["current", "--database-url", url])
    assert before.exit_code == 1
    assert "revision: none" in before.stdout and "kvchat db upgrade" in before.stderr

    refused = runner.invoke(keys_app, ["create", "--name", "x", "--database-url", url])
    assert refused.exit_code == 2
    assert refused.stderr.count("\n") == 1 and "`kvchat db upgrade`" in refused.stderr

    upgraded = runner.invoke(db_app, ["upgrade"], env={"KVCHAT_DATABASE_URL": url})
    assert upgraded.exit_code == 0, upgraded.output
    assert "upgraded" in upgraded.stdout and "from an empty database" in upgraded.stdout
    again = runner.invoke(db_app, ["upgrade", "--database-url", url])
    assert again.exit_code == 0 and "already at the newest schema" in again.stdout
    after = runner.invoke(db_app, ["current", "--database-url", url])
    assert after.exit_code == 0 and f"revision: {head_revision()} " in after.stdout

    created = runner.invoke(keys_app, ["create", "--name", "x", "--database-url", url])
    assert created.exit_code == 0, created.output
    assert created.stdout.strip().startswith("kvc-")
