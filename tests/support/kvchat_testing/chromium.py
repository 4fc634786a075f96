"""Debian's chromium for Playwright: Playwright's own browser builds are never downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

from playwright.sync_api import Browser, Playwright

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]


def chromium_path() -> str:
    """The binary behind Debian's /usr/bin/chromium wrapper script."""
    for candidate in (
        "/usr/lib/chromium/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
    ):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise RuntimeError("chromium is not installed (apt-get install chromium; .ci/run does)")


def launch(playwright: Playwright) -> Browser:
    return playwright.chromium.launch(executable_path=chromium_path(), headless=True, args=ARGS)
