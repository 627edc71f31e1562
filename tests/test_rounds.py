"""The pause between a hub service loop's rounds (`hub_ingest.core.rounds`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from hub_ingest.core.rounds import next_round
from tests.support.waiting import eventually


async def _loop(stop: asyncio.Event, rounds: list[int], swallow: bool, pause: float) -> None:
    while not stop.is_set():
        rounds.append(1)
        try:
            await asyncio.sleep(60 if swallow else 0)  # a cancel comes here, in the step
        except asyncio.CancelledError:
            if not swallow:
                raise
            # What Python 3.11's `wait_for` does when its answer comes with the cancel.
        await next_round(stop, pause)


def _at_least(rounds: list[int], count: int) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return len(rounds) >= count

    return probe


async def test_a_loop_whose_step_swallowed_its_cancel_still_ends() -> None:
    stop = asyncio.Event()
    rounds: list[int] = []
    task = asyncio.create_task(_loop(stop, rounds, swallow=True, pause=0.01))
    try:
        await eventually(_at_least(rounds, 1), timeout=5, what="a round")
        task.cancel()
        await asyncio.wait([task], timeout=5)
        assert task.cancelled()
    finally:
        stop.set()  # a loop that ran on ends at its next round, not with the test's loop


async def test_a_loop_ends_when_stopped_not_at_the_end_of_its_pause() -> None:
    stop = asyncio.Event()
    rounds: list[int] = []
    task = asyncio.create_task(_loop(stop, rounds, swallow=False, pause=60))
    await eventually(_at_least(rounds, 1), timeout=5, what="a round")
    stop.set()
    await asyncio.wait([task], timeout=5)
    assert task.done() and not task.cancelled()
