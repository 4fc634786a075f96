"""Building kvchat's CPU ops when several processes start at once, and after a builder was
killed mid-build: the next start must load, not wait for ever on a lock nobody holds."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvchat.kernels.cpu_ops import build_key, extensions_dir, load_cpu_ops

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="needs a C++ compiler")

# A bound on a subprocess that would otherwise hang for ever: a guard, not a timing.
HANG_GUARD_S = 300

LOAD = "import logging, sys; logging.basicConfig(level=logging.INFO); " + (
    "from kvchat.kernels.cpu_ops import load_cpu_ops; sys.exit(0 if load_cpu_ops() else 3)"
)


def built_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of this machine's built ops under tmp_path (up to date: loads without
    compiling) -> (extensions dir, build dir)."""
    name = f"cpu_ops-{build_key()}"
    root = tmp_path / "extensions"
    shutil.copytree(extensions_dir() / name, root / name, ignore=shutil.ignore_patterns("lock"))
    return root, root / name


def env_for(root: Path) -> dict[str, str]:
    return {**os.environ, "KVCHAT_EXTENSIONS_DIR": str(root)}


def test_a_lock_left_by_a_killed_build_does_not_stop_the_next_start(tmp_path: Path) -> None:
    root, build_dir = built_copy(tmp_path)
    (build_dir / "lock").write_text("")  # torch's builder lock, as a killed build leaves it
    done = subprocess.run(
        [sys.executable, "-P", "-c", LOAD],
        env=env_for(root),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr
    assert "did not finish" in done.stderr
    assert not (build_dir / "lock").exists()


def test_a_start_waits_for_a_live_builder_and_goes_on_when_it_is_killed(tmp_path: Path) -> None:
    root, build_dir = built_copy(tmp_path)
    holder_code = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from kvchat.kernels.cpu_ops import builder_lock
        with builder_lock(Path({str(build_dir)!r})):
            (Path({str(build_dir)!r}) / "lock").write_text("")  # mid-build, as torch leaves it
            print("held", flush=True)
            time.sleep(3600)
        """
    )
    holder = subprocess.Popen(
        [sys.executable, "-P", "-c", holder_code], stdout=subprocess.PIPE, text=True
    )
    waiter = None
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        waiter = subprocess.Popen(
            [sys.executable, "-P", "-c", LOAD],
            env=env_for(root),
            stderr=subprocess.PIPE,
            text=True,
        )
        assert waiter.stderr is not None
        # The waiter says it waits for the builder, and does not finish while it lives.
        for line in waiter.stderr:
            if "another process is building" in line:
                break
        else:
            pytest.fail(f"the second start did not wait (rc {waiter.wait(HANG_GUARD_S)})")
        assert waiter.poll() is None
        holder.send_signal(signal.SIGKILL)  # the builder dies mid-build
        holder.wait(HANG_GUARD_S)
        rest = waiter.stderr.read()
        assert waiter.wait(HANG_GUARD_S) == 0, rest
        assert "did not finish" in rest
        assert not (build_dir / "lock").exists()
    finally:
        for p in (holder, waiter):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
