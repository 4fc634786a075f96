"""The processes of a fleet on one machine: a replica (`kvchat serve` on its own port) and
HAProxy in front of them. Each writes its output to a log file of its own; starting one waits
until it answers (bounded), stopping one sends a signal and waits for the exit."""

from __future__ import annotations

import csv
import io
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a replica loads its model: seconds, more on a busy machine
STOP_TIMEOUT_S = 120.0


class FleetError(RuntimeError):
    """A process of the fleet could not start (its log's tail says why)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def haproxy_binary() -> str:
    """HAProxy from PATH, or where Debian's package puts it (/usr/sbin is often not on a
    user's PATH)."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise FleetError("haproxy is not installed (Debian: apt-get install haproxy)")
    return found


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


@dataclass
class Process:
    """A child process whose output goes to `log_path` (appended: a restarted replica keeps
    one log)."""

    name: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def spawn(self, command: list[str], env: dict[str, str]) -> None:
        """Start `command` in a process group of its own (a terminal's Ctrl-C reaches the
        fleet, which stops its processes in order) that, where util-linux's `setpriv` is
        there, gets SIGTERM when the thread that started it ends (no replica outlives a killed
        fleet; set before exec by setpriv, not by Python code in the forked child, which is
        unsafe in a process with threads)."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        setpriv = shutil.which("setpriv")
        if setpriv is not None and sys.platform.startswith("linux"):
            command = [setpriv, "--pdeathsig", "TERM", *command]
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            process_group=0,
        )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise FleetError(
                f"{self.name} exited with code {self.process.returncode}:\n"
                f"{log_tail(self.log_path)}"
            )

    def send_signal(self, sig: int) -> None:
        if self.is_running:
            assert self.process is not None
            self.process.send_signal(sig)

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Wait for the exit (SIGKILL past `timeout`); the exit code."""
        if self.process is None:
            return None
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            log.warning(
                "%s did not exit within %.0f s: SIGKILL. Its log ends:\n%s",
                self.name,
                timeout,
                log_tail(self.log_path, 250),
            )
            self.process.kill()
            self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int | None:
        self.send_signal(sig)
        return self.wait(timeout)

    def dump_stacks(self) -> None:
        """Before a process is killed for not exiting: nothing by default."""


@dataclass
class Replica(Process):
    """One `kvchat serve` of the fleet: its replica id is `name` (HAProxy's server name)."""

    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    model: Path = Path("models/smollm2-135m-instruct")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        """Spawn the process (same port each time); `wait_ready` waits for it."""
        env = {
            **os.environ,
            **self.env,
            "KVCHAT_REPLICA_ID": self.name,
            "KVCHAT_HOST": self.host,
            "KVCHAT_PORT": str(self.port),
            "PYTHONUNBUFFERED": "1",
        }
        self.spawn(
            [sys.executable, "-P", "-m", "kvchat.app.cli", "serve", "--model", str(self.model)], env
        )

    @property
    def shutdown_bound(self) -> float:
        """The longest a SIGTERM may take by the replica's own settings: its drain grace, then
        up to `drain_timeout` each for open connections, in-flight turns, background tasks
        and persisting sessions' KV (app/main.py, app/ops/drain.py), and a margin."""
        drain = float(self.env.get("KVCHAT_DRAIN_TIMEOUT", 10.0))
        grace = float(self.env.get("KVCHAT_DRAIN_GRACE", 0.0))
        return grace + 4 * drain + 30.0

    def stop(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> int | None:
        self.send_signal(sig)
        return self.wait(max(STOP_TIMEOUT_S, self.shutdown_bound) if timeout is None else timeout)

    def dump_stacks(self) -> None:
        """`kvchat serve` writes every thread's stack and its asyncio tasks' await chains to
        its log on SIGUSR1 (app/ops/stacks.py): what a replica that does not exit was waiting
        on stays in its log after the SIGKILL. The tasks come once its event loop wakes."""
        if self.is_running:
            self.send_signal(signal.SIGUSR1)
            time.sleep(3.0)

    def is_ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            self.check_alive()
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise FleetError(
                    f"{self.name} did not become ready in {timeout:.0f} s:\n"
                    f"{log_tail(self.log_path)}"
                )
            time.sleep(0.2)


@dataclass
class HAProxy(Process):
    """HAProxy in the foreground (`-db`) on a rendered configuration file."""

    config_path: Path = Path("haproxy.cfg")
    bind: str = "127.0.0.1:8080"
    stats_bind: str | None = "127.0.0.1:8404"
    binary: str = field(default_factory=haproxy_binary)

    def check_config(self) -> None:
        result = subprocess.run(
            [self.binary, "-c", "-q", "-f", str(self.config_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode != 0:
            raise FleetError(f"haproxy refused {self.config_path}:\n{result.stderr}")

    def start(self, timeout: float = 30.0) -> None:
        self.check_config()
        self.spawn([self.binary, "-db", "-f", str(self.config_path)], dict(os.environ))
        host, _, port = self.bind.rpartition(":")
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), 1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop(signal.SIGKILL)
                    raise FleetError(
                        f"haproxy did not listen on {self.bind}:\n{log_tail(self.log_path)}"
                    ) from None
                time.sleep(0.05)

    @property
    def stats_url(self) -> str | None:
        return f"http://{self.stats_bind}/" if self.stats_bind else None

    def server_status(self, backend: str = "kvchat_affinity") -> dict[str, str]:
        """Each server of `backend` as the stats page says it is: UP, DOWN, MAINT, or a
        transition ("UP 1/2", "DOWN 1/2")."""
        assert self.stats_url is not None, "the stats page is off"
        text = httpx.get(f"{self.stats_url};csv", timeout=5).text.lstrip("# ")
        return {
            row["svname"]: row["status"]
            for row in csv.DictReader(io.StringIO(text))
            if row["pxname"] == backend and row["svname"] not in ("FRONTEND", "BACKEND")
        }
