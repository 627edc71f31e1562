"""Many requests to the hub at once, but not all at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")

REQUESTS_AT_ONCE = 16  # a provisioning round's requests in flight together


async def gather_bounded(steps: Iterable[Awaitable[T]], limit: int) -> list[T]:
    """Await `steps` together, at most `limit` at a time; their results in order. A pass
    over a fleet is hundreds of requests: one after the other they cost a round trip each,
    all at once they queue past the client's timeout on a busy hub."""
    gate = asyncio.Semaphore(limit)

    async def step(awaitable: Awaitable[T]) -> T:
        async with gate:
            return await awaitable

    return list(await asyncio.gather(*map(step, steps)))
