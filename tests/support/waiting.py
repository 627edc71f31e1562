"""Awaiting conditions with a deadline: the only way tests synchronise."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
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
