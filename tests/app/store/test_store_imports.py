"""The store and its commands import without torch or the engine's packages."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_store_pulls_in_no_torch_and_no_engine() -> None:
    code = (
        "import sys, kvchat.app.store, kvchat.app.cli.db, kvchat.app.store.schema; "
        "heavy = sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'triton') "
        "or m.startswith(('kvchat.inference', 'kvchat.kernels', 'kvchat.memory'))); "
        "print(heavy)"
    )
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
