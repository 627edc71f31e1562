"""Processes a test left running, found by the test's own directory on their command line.

A nats-server or agent that outlives its test keeps its ports and files and answers, or
writes, into the tests after it (seen on CI: thirty tests failed behind one)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

# A process the test stopped may still be on its way out (a SIGTERM not waited for).
EXIT_GRACE_S = 5.0


def processes_mentioning(path: Path) -> dict[int, str]:
    """Running processes (not this one) whose command line names `path` or a file under it."""
    # The directory itself or a path under it, not a sibling that starts alike (test_x10).
    needle = re.compile(re.escape(str(path).encode()) + rb"(/|\x00|$)")
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if needle.search(cmdline):
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def kill(pids: dict[int, str]) -> None:
    """SIGKILL each, with its process group when it leads one (its children go too)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def still_running_after(path: Path, grace: float) -> dict[int, str]:
    """`processes_mentioning(path)` that have not exited within `grace` seconds."""
    deadline = time.monotonic() + grace
    while (found := processes_mentioning(path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found
