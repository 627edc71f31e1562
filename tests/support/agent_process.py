"""``edge-agent run`` as a real subprocess, for tests that SIGTERM or SIGKILL it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.waiting import eventually


class AgentProcess:
    """The agent in its own session, so that SIGKILL can take it, its island and its handlers
    down at once, as a power cut would. Its JSON log lines go to `log_path`."""

    def __init__(self, config_path: Path, log_path: Path) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> AgentProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "edge_agent", "-c", str(self.config_path), "run"],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        return self

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("event") == name:
                    found.append(entry)
        return found

    async def wait_event(self, name: str, count: int = 1, timeout: float = 60) -> None:
        async def probe() -> bool:
            assert self.proc is not None and self.proc.poll() is None, "agent exited"
            return len(self.events(name)) >= count

        try:
            await eventually(probe, timeout=timeout, what=f"{count} x {name} in {self.log_path}")
        except AssertionError as exc:
            tail = self.log_path.read_text(errors="replace").splitlines()[-20:]
            raise AssertionError("\n".join([str(exc), "the log ends:", *tail])) from exc

    def kill(self) -> None:
        """SIGKILL the whole process group: agent, island and any running handler."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    async def terminate(self, timeout: float = 60) -> int:
        """SIGTERM the agent alone (as systemd does) and return its exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return await asyncio.to_thread(self.proc.wait, timeout)

    def close(self) -> None:
        """Kill whatever is left of the group (idempotent, for test clean-up)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
