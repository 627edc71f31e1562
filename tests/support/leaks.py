"""Processes a test left running, found by the test's own directory on their command line.

A nats-server or agent that outlives its test keeps its ports and files and answers, or
writes, into the tests after it (seen on CI: thirty tests failed behind one)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def processes_mentioning(path: Path) -> dict[int, str]:
    """Running processes (not this one) whose command line names `path` or a file under it."""
    needle = str(path).encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if needle in cmdline:
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def kill(pids: dict[int, str]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
