"""Every setting a flag of `kvchat serve` (and of `kvchat fleet` for its replicas): generated
from the Settings class, over the environment and .env, a bad value one line naming its flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from pydantic import Field
from rich.markup import escape
from typer.testing import CliRunner

from kvchat.app.cli.fleet import FLEET_SETTINGS
from kvchat.app.cli.main import app
from kvchat.app.cli.settings_flags import (
    as_environment,
    flag_name,
    settings_from_flags,
    with_setting_flags,
)
from kvchat.app.settings import Settings

runner = CliRunner()


def fail(message: str) -> Any:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def settings_app(settings_cls: type[Settings] = Settings) -> typer.Typer:
    """A command taking the flags as `serve` does and printing the Settings they make."""
    probe = typer.Typer(add_completion=False)

    @probe.command()
    @with_setting_flags(settings_cls)
    def show(flags: dict[str, Any]) -> None:
        typer.echo(settings_from_flags(settings_cls, flags, fail).model_dump_json())

    @probe.command()
    def other() -> None:  # two commands: `show` is a subcommand, as `serve` is
        pass

    return probe


def show(*args: str, settings_cls: type[Settings] = Settings) -> dict[str, Any]:
    result = runner.invoke(settings_app(settings_cls), ["show", *args])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def command_params(name: str) -> dict[str, Any]:
    """The command's click parameters (typer's own copy of click) by name."""
    command: Any = typer.main.get_command(app)
    return {p.name: p for p in command.commands[name].params}


@pytest.fixture(autouse=True)
def no_kvchat_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Settings read only what a test sets: no KVCHAT_* variable of the caller, no .env."""
    for name in list(os.environ):
        if name.startswith("KVCHAT_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def test_serve_has_one_flag_per_setting_and_nothing_else() -> None:
    params = command_params("serve")
    assert set(params) - {"help"} == set(Settings.model_fields)
    for name, param in params.items():
        if name != "help":
            assert param.opts == [flag_name(name)]


def test_fleet_passes_every_setting_it_does_not_set_itself() -> None:
    params = command_params("fleet")
    settings = set(Settings.model_fields)
    assert FLEET_SETTINGS.issubset(settings)
    assert settings - FLEET_SETTINGS <= set(params)
    own = {"replicas", "stats_port", "run_dir", "balance", "create_database"}
    assert set(params) - settings == own


def test_serve_help_lists_every_setting_with_its_help_and_default() -> None:
    params = command_params("serve")
    for name, field in Settings.model_fields.items():
        param = params[name]
        assert field.description and param.help
        assert param.help.startswith(escape(field.description))  # typer renders rich markup
        default = field.get_default(call_default_factory=True)
        if default is None or default == []:
            assert not param.show_default, name
        else:
            text = str(default).lower() if isinstance(default, bool) else str(default)
            assert param.show_default and param.default in (text, [text]), name
    assert params["kv_cache_dtype"].metavar == "[auto|int8|fp8|int4]"
    assert params["ws_compression"].metavar == "[true|false]"
    assert params["port"].metavar == "INTEGER"
    assert params["cors_origins"].multiple


def test_serve_help_in_a_real_process_shows_flags_and_defaults_but_no_secret() -> None:
    secret = "hunter2-db-password"
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "kvchat.app.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "COLUMNS": "200",
            "KVCHAT_DATABASE_URL": f"postgresql://kvchat:{secret}@db:5432/kvchat",
            "KVCHAT_REDIS_URL": f"redis://:{secret}@redis:6379/0",
        },
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for name in Settings.model_fields:
        assert flag_name(name) in proc.stdout, name
    assert "Tokens per KV-cache block." in proc.stdout
    assert "[default: 16]" in proc.stdout
    assert "[auto|int8|fp8|int4]" in proc.stdout
    assert secret not in proc.stdout


def test_a_setting_added_to_the_class_becomes_a_flag() -> None:
    class MoreSettings(Settings):
        speculative_tokens: int = Field(0, ge=0, description="Draft tokens per step.")

    result = runner.invoke(settings_app(MoreSettings), ["show", "--help"], env={"COLUMNS": "200"})
    assert "--speculative-tokens" in result.stdout
    assert "Draft tokens per step." in result.stdout
    assert show("--speculative-tokens", "3", settings_cls=MoreSettings)["speculative_tokens"] == 3
    result = runner.invoke(settings_app(MoreSettings), ["show", "--speculative-tokens", "-1"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: --speculative-tokens: Input should be greater than or equal to 0 (got '-1')"
    )


def test_a_flag_wins_over_the_environment_and_dotenv(monkeypatch: pytest.MonkeyPatch) -> None:
    Path(".env").write_text("KVCHAT_MAX_NUM_SEQS=7\nKVCHAT_BLOCK_SIZE=32\n")
    monkeypatch.setenv("KVCHAT_KV_CACHE_DTYPE", "int8")
    monkeypatch.setenv("KVCHAT_PORT", "9001")
    monkeypatch.setenv("KVCHAT_WS_COMPRESSION", "true")
    settings = show("--kv-cache-dtype", "fp8", "--max-num-seqs", "9", "--ws-compression", "false")
    assert settings["kv_cache_dtype"] == "fp8"  # flag over variable
    assert settings["max_num_seqs"] == 9  # flag over .env
    assert settings["ws_compression"] is False  # a boolean flag over a variable
    assert settings["port"] == 9001  # no flag: the variable
    assert settings["block_size"] == 32  # no flag: .env
    assert settings["high_watermark"] == 0.8  # neither: the class default


def test_serve_takes_its_model_from_the_flag_over_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVCHAT_MODEL", str(tmp_path / "from-variable"))
    result = runner.invoke(app, ["serve", "--model", str(tmp_path / "from-flag")])
    assert result.exit_code == 2
    assert f"no model at {tmp_path / 'from-flag'}" in result.stderr


def test_list_and_optional_flags() -> None:
    settings = show("--cors-origins", "https://a.example", "--cors-origins", "https://b.example")
    assert settings["cors_origins"] == ["https://a.example", "https://b.example"]
    assert show()["cors_origins"] == []
    assert show("--max-kv-tokens", "4096")["max_kv_tokens"] == 4096
    assert show()["max_kv_tokens"] is None
    retention = show("--retention-ttl-s", "604800", "--retention-priority", "0")
    assert (retention["retention_ttl_s"], retention["retention_priority"]) == (604800.0, 0)
    assert (show()["retention_ttl_s"], show()["retention_priority"]) == (None, None)


def test_retention_defaults_are_variables_and_reach_the_engines_default_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVCHAT_RETENTION_TTL_S", "90.5")
    monkeypatch.setenv("KVCHAT_RETENTION_PRIORITY", "100")
    settings = Settings()
    budget = settings.engine_config().cache.default_budget
    assert (budget.retention_ttl_s, budget.retention_priority) == (90.5, 100)
    assert settings.session_defaults().budget(512) == budget.__class__(
        max_context_tokens=512, retention_ttl_s=90.5, retention_priority=100
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--port", "eighty"],
            "error: --port: Input should be a valid integer, unable to parse string as an "
            "integer (got 'eighty')",
        ),
        (
            ["--kv-cache-dtype", "int2"],
            "error: --kv-cache-dtype: Input should be 'auto', 'int8', 'fp8' or 'int4' (got 'int2')",
        ),
        (
            ["--dtype", "float64"],
            "error: --dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16' "
            "(got 'float64')",
        ),
        (
            ["--kv-store-bytes", "-1"],
            "error: --kv-store-bytes: Input should be greater than or equal to 0 (got '-1')",
        ),
        (
            ["--keyless-sessions", "maybe"],
            "error: --keyless-sessions: Input should be a valid boolean, unable to interpret "
            "input (got 'maybe')",
        ),
        (
            ["--retention-priority", "101"],
            "error: --retention-priority: Input should be less than or equal to 100 (got '101')",
        ),
        (
            ["--retention-ttl-s", "604801"],
            "error: --retention-ttl-s: Input should be less than or equal to 604800 (got '604801')",
        ),
        (
            ["--history-policy", "forget"],
            "error: --history-policy: must be one of summarize, drop, drop_oldest, none "
            "(got 'forget')",
        ),
    ],
)
def test_a_bad_flag_value_is_one_line_naming_the_flag(args: list[str], line: str) -> None:
    result = runner.invoke(app, ["serve", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [line]
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_bad_variable_is_named_as_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCHAT_MAX_NUM_SEQS", "many")
    result = runner.invoke(app, ["serve"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: KVCHAT_MAX_NUM_SEQS: Input should be a valid integer")


def test_a_bad_flag_value_in_a_real_process_prints_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "kvchat.app.cli", "serve", "--linear-path", "fastest"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --linear-path: Input should be 'auto', 'gemv', 'gemv-prefetch', 'torch', "
        "'onednn' or 'onednn-prepacked' (got 'fastest')"
    ]


def test_fleet_refuses_a_bad_replica_setting_before_starting_anything(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "fleet",
            "--database-url",
            "postgresql://nobody@127.0.0.1:1/none",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--model",
            str(tmp_path / "no-model"),
            "--max-num-seqs",
            "lots",
        ],
    )
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: --max-num-seqs: Input should be a valid integer, unable to parse string as an "
        "integer (got 'lots')"
    ]


def test_the_fleet_hands_its_flags_to_replicas_as_the_same_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flags = {
        "cors_origins": ["https://a.example", "https://b.example"],
        "ws_compression": "true",
        "kv_cache_dtype": "int8",
        "max_num_seqs": "12",
    }
    environment = as_environment(Settings, flags)
    assert environment["KVCHAT_KV_CACHE_DTYPE"] == "int8"
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    from_flags, in_replica = Settings(**flags), Settings()
    assert in_replica == from_flags
    assert in_replica.cors_origins == ["https://a.example", "https://b.example"]
    assert in_replica.ws_compression is True and in_replica.max_num_seqs == 12
