"""Every benchmark runs as its docstring prints it (`python bench/<script>.py`), from the
repository root of a fresh checkout, not only as `python -m kvchat.bench.<script>`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p.name for p in (REPO / "bench").glob("*.py") if "__main__" in p.read_text(encoding="utf-8")
)


def test_every_script_documents_its_command() -> None:
    assert len(SCRIPTS) >= 5
    for name in SCRIPTS:
        doc = (REPO / "bench" / name).read_text(encoding="utf-8")
        assert re.search(rf"python bench/{re.escape(name)}", doc), f"{name} prints no command"


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help_runs_as_documented(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, f"bench/{name}", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ")
