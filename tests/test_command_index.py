"""The command index folds each result in once, even after a fold that was cut short."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import asdict

from nats.js.api import AckPolicy, ConsumerConfig

from hub_ingest.commands.index import (
    RESULT_FILTER,
    CommandIndex,
    Tally,
    _fetch,
    _Parsed,
    read_range,
)
from hub_ingest.fleet.registry import Registry
from hub_ingest.report.collect import collect_report
from tests.support.cluster import Hub
from tests.support.commands import send_command
from tests.support.waiting import eventually


async def _results(hub: Hub) -> int:
    info = await hub.js.stream_info("FLEET_EVENTS", subjects_filter="fleet.a.evt.a.result")
    return sum((info.state.subjects or {}).values())


async def test_a_fold_cut_short_counts_nothing_twice(hub: Hub) -> None:
    """Answers written by a fold that died before it updated the device's tally (and before
    it moved the cursor) are not counted again when the next fold reads the same results."""
    await hub.device("a")
    sent = [await send_command(hub, "a", "ping") for _ in range(5)]
    await eventually(lambda: _answered(hub, 5), timeout=60, what="5 results")
    index = await CommandIndex.open(hub.js)
    info = await hub.js.stream_info("FLEET_EVENTS")
    reader = read_range(hub.js, "FLEET_EVENTS", RESULT_FILTER, 1, info.state.last_seq)
    async with aclosing(reader) as batches:
        first = await anext(batches)
    for msg in first[:3]:
        await index._answer(_Parsed.of(msg))  # what the fold that died had written
    devices = await (await Registry.open(hub.js)).list()

    for _ in range(2):
        report = await collect_report(hub.nc, hub.config, devices, silent_after=60)
        (a,) = report.devices
        assert asdict(a.commands) == {"pending": 0, "expired": 0, "done": 5, "failed": 0}
    tally = await index.tally("a")
    assert (tally.high, tally.gaps) == (5, ())
    assert sorted(await index.answers(sent[0].id)) == ["a"]


async def _answered(hub: Hub, count: int) -> bool:
    return await _results(hub) >= count


def test_tally_keeps_unanswered_commands_as_ranges() -> None:
    """Answers out of order leave gaps; the gaps and the tail are what is still unanswered."""
    tally = Tally().answered(1).answered(4).answered(9)
    assert (tally.high, tally.gaps) == (9, ((2, 3), (5, 8)))
    tally = tally.answered(6).answered(2)
    assert tally.gaps == ((3, 3), (5, 5), (7, 8))
    assert tally.unanswered(1, 12) == [(3, 3), (5, 5), (7, 8), (10, 12)]
    # Retention removed 1..6 from CMD_<id>: only what it still holds is unanswered.
    assert tally.unanswered(7, 9) == [(7, 8)]
    assert Tally.from_json(tally.to_json()) == tally


async def test_a_fetch_answered_no_responders_is_asked_again(hub: Hub) -> None:
    """A consumer whose leader is not up yet answers a fetch with 503 (no responders), as a
    consumer just made on a busy cluster does: the index asks again rather than failing the
    report. Here the consumer is gone for half a second, then made again."""
    await hub.js.publish("cmd.a", b"one")  # COMMANDS listens on cmd.>
    config = ConsumerConfig(durable_name="probe", ack_policy=AckPolicy.NONE)
    sub = await hub.js.pull_subscribe("cmd.a", durable="probe", stream="COMMANDS", config=config)
    await hub.js.delete_consumer("COMMANDS", "probe")

    async def make_again() -> None:
        await asyncio.sleep(0.5)
        await hub.js.add_consumer("COMMANDS", config)

    again = asyncio.create_task(make_again())
    (msg,) = await _fetch(sub, 1)
    await again
    assert msg.data == b"one"
    assert _fetch.statistics["attempt_number"] > 1  # it was answered 503 first
