"""Awaiting conditions with a deadline: the only way tests synchronise."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# A stock nats-server source or mirror starts or resumes 10-40 s after its link is there (its
# first consumer request may have raced the leaf connection): waits on one allow this much.
RESUME_TIMEOUT = 90


async def eventually(
    probe: Callable[[], Awaitable[T]],
    *,
    timeout: float,
    interval: float = 0.1,
    what: str = "condition",
) -> T:
    """Call `probe` until it returns a truthy value (returned) or `timeout` passes (fails).

    Exceptions from `probe` count as "not yet"; the last one is shown if time runs out.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = await probe()
            if value:
                return value
            last = value
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            failure = AssertionError(f"{what} not reached within {timeout}s (last: {last!r})")
            raise failure from last if isinstance(last, Exception) else None
        await asyncio.sleep(interval)


async def freeze(pid: int) -> None:
    """SIGSTOP process `pid` and wait until every one of its threads has stopped: the signal
    takes effect asynchronously, and a thread on another core can answer a request sent
    right after `kill` returns (CI: a stalled hub answered within its "stall")."""
    os.kill(pid, signal.SIGSTOP)

    async def stopped() -> bool:
        return frozen(pid)

    await eventually(stopped, timeout=10, interval=0.01, what=f"{pid} stopped")


def frozen(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (False once it is gone)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            # "<tid> (<name>) <state> …", and a name may hold ") ".
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in "tT" for state in states)
