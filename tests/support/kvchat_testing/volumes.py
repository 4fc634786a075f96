"""Real volumes for fault tests (run as root, as CI does): a read-only bind mount of a
folder over itself, and a tmpfs of a given size."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """`path`, bind-mounted read-only over itself."""
    mount("--bind", str(path), str(path))
    try:
        mount("-o", "remount,ro,bind", str(path))
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: "64k", "4m") mounted at `path`."""
    path.mkdir(parents=True, exist_ok=True)
    mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
