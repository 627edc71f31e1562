"""The pause between two rounds of a hub service's loop."""

from __future__ import annotations

import asyncio
import contextlib


async def next_round(stop: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, or less if `stop` is set; end the calling task if it was cancelled.

    On Python 3.11 `asyncio.wait_for` (which nats-py awaits every request with) returns its
    result and drops the cancel when both come in the same turn of the loop. A task cancelled
    then (a watcher killed, a task group closing) would go round its loop for ever, its
    cancel still pending: it is raised here, where every round passes.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()
