"""A hub mirror's consumer on the island that nats-server has deadlocked is found and reset.

The deadlock, as the power-cut test met it under load: the consumer is reset below what the
mirror holds while the mirror stays bound (the island resets its consumers at each start; a
mirror that missed the restart keeps its delivery count). The first window it sends again is
old to the mirror, whose flow-control reply then carries the mirror's own, higher delivery
count; the consumer takes that as its acknowledgement floor, above anything it delivers next,
and ignores every later reply as old. Here the reset is made on purpose, while the consumer
is paused so that new packs wait behind the window it sends again.
"""

from __future__ import annotations

import functools
import json
import os
import signal
from datetime import UTC, datetime, timedelta

from nats.js.api import ConsumerInfo

from edge_agent.island.server import pid_file
from edge_agent.island.streams import (
    UNCOMPRESSED_PACK_WINDOW,
    consumer_request,
    hub_consumer_config,
    incarnations,
)
from edge_agent.protocol.names import TELEMETRY, hub_consumer
from edge_agent.status.health import collect_status
from tests.support.cluster import PACKED, Device, Hub, mirror_silent_for, reset_uplink
from tests.support.ingest import aggregate_has, readings_held
from tests.support.waiting import RESUME_TIMEOUT, eventually

WINDOW = UNCOMPRESSED_PACK_WINDOW  # packs in flight over a loopback link, uncompressed
# Packs that cross one by one first: the mirror's delivery count well above two windows (the
# deadlock needs its reply to stay above all the consumer delivers in them).
FIRST = 4 * WINDOW
# Packs the mirror holds when its consumer is made again from the first: many windows.
BEHIND = 40


async def _consumer_api(device: Device, verb: str, body: dict[str, object]) -> None:
    incarnation = (await incarnations(device.js))[TELEMETRY]
    assert incarnation is not None and device.nc is not None
    name = hub_consumer(incarnation)
    error = await consumer_request(device.nc, verb, TELEMETRY, name, json.dumps(body).encode())
    assert error is None, error


async def _consumer(device: Device) -> ConsumerInfo:
    incarnation = (await incarnations(device.js))[TELEMETRY]
    assert incarnation is not None
    return await device.js.consumer_info(TELEMETRY, hub_consumer(incarnation))


async def _packs_at_hub(hub: Hub, device: Device, count: int) -> bool:
    info = await hub.js.stream_info(await hub.mirror(device.id))
    return info.state.last_seq >= count and info.state.messages == info.state.last_seq


async def _pack_one(device: Device, n: int) -> int:
    """Reading `n` alone in a pack of its own; the island's last pack sequence."""
    before = (await device.js.stream_info(TELEMETRY)).state.last_seq
    await device.js.publish("tele.temp", str(n).encode())

    async def packed() -> int | None:
        last = (await device.js.stream_info(TELEMETRY)).state.last_seq
        return last if last > before else None

    return await eventually(packed, timeout=30, what=f"reading {n} packed")


async def test_a_deadlocked_uplink_consumer_is_bound_afresh_and_the_hub_gets_everything(
    hub: Hub,
) -> None:
    """The deadlock made (the consumer's floor above what it delivered, a full window out),
    the agent finds it by that mark well within `uplink_stall_after` (60 s by default), the
    mirror binds afresh, every pack reaches the hub and is acknowledged, and `status` counts
    it once."""
    a = await hub.device("a", sections=PACKED, register_when_ready=True)
    crossed = 0
    for n in range(FIRST):
        crossed = await _pack_one(a, n)
        at_hub = functools.partial(_packs_at_hub, hub, a, crossed)
        await eventually(at_hub, timeout=RESUME_TIMEOUT, what=f"pack {crossed} at the hub")
    # The hub moves a consumer that sends again what its mirror holds on past it, which would
    # mend this too: it looks away, and the agent's own watch is what is tested.
    await hub.look_away()
    pause = (datetime.now(UTC) + timedelta(minutes=5)).isoformat().replace("+00:00", "Z")
    await _consumer_api(a, "PAUSE", {"pause_until": pause})
    waiting = [await _pack_one(a, n) for n in range(FIRST, FIRST + 3)]
    # Back a window below what the mirror holds, and let it go: the old window, then the
    # three new packs, which the mirror takes; its replies are then ignored.
    await reset_uplink(a, crossed - WINDOW + 1)
    await _consumer_api(a, "PAUSE", {})

    async def deadlocked() -> ConsumerInfo | None:
        info = await _consumer(a)
        stuck = info.ack_floor.consumer_seq > info.delivered.consumer_seq
        return info if stuck and info.num_ack_pending else None

    info = await eventually(deadlocked, timeout=30, what="the floor above what was delivered")
    assert info.ack_floor.stream_seq < waiting[-1]
    more = [await _pack_one(a, n) for n in range(FIRST + 3, FIRST + 3 + 2 * WINDOW)]

    every = functools.partial(_packs_at_hub, hub, a, more[-1])
    # Found by its mark (10 s), the consumer deleted for 25 s, the mirror's next try: within
    # 80 s; found only by standing still, the rebinding would start 60 s on and end past 85 s.
    await eventually(every, timeout=80, what="every pack at the hub")
    status = await collect_status(a.config)
    assert status.uplink_unstalled >= 1
    assert not status.problems, status.problems

    async def settled() -> bool:
        info = await _consumer(a)
        return info.ack_floor.stream_seq == more[-1] and not info.num_ack_pending

    await eventually(settled, timeout=30, what="every pack acknowledged")
    assert (await collect_status(a.config)).uplink_unstalled == status.uplink_unstalled


async def test_an_island_restarted_while_a_hub_consumer_is_deleted_links_again(
    hub: Hub,
) -> None:
    """The island dies while a hub consumer is deleted (as the agent leaves it for 25 s to
    have it bound afresh): at its start the island resets the hub consumers before opening
    its link, and finds that one missing instead of waiting for an answer that cannot come;
    the link opens, the consumer is made again and the readings cross."""
    a = await hub.device("a", sections=PACKED, register_when_ready=True)
    first = await _pack_one(a, 0)
    await eventually(
        functools.partial(_packs_at_hub, hub, a, first), timeout=RESUME_TIMEOUT, what="pack 1"
    )
    incarnation = (await incarnations(a.js))[TELEMETRY]
    assert incarnation is not None
    await a.js.delete_consumer(TELEMETRY, hub_consumer(incarnation))
    os.kill(int(pid_file(a.config).read_text()), signal.SIGKILL)
    await a.wait_link(up=False)
    await a.wait_link(up=True, timeout=60)
    await eventually(lambda: _consumer(a), timeout=30, what="the hub consumer made again")
    last = await _pack_one(a, 1)
    await eventually(
        functools.partial(_packs_at_hub, hub, a, last), timeout=RESUME_TIMEOUT, what="pack 2"
    )


async def test_an_uplink_consumer_made_again_from_its_first_message_moves_past_the_hub(
    hub: Hub,
) -> None:
    """The consumer made again from its first message while the mirror holds far more (as the
    agent's reconcile makes it when the agent was killed while the consumer was deleted to be
    bound afresh): the mirror ignores what it holds, its replies leave a window of the
    consumer unacknowledged for good, and rebinding it at its floor sticks the same way. The
    hub's watch finds the consumer behind its mirror and moves it past what the mirror holds;
    the readings after cross, each once."""
    a = await hub.device("a", sections=PACKED, register_when_ready=True)
    crossed = 0
    for n in range(BEHIND):
        crossed = await _pack_one(a, n)
    await eventually(
        functools.partial(_packs_at_hub, hub, a, crossed), timeout=RESUME_TIMEOUT, what="packs"
    )
    incarnation = (await incarnations(a.js))[TELEMETRY]
    assert incarnation is not None
    await a.js.delete_consumer(TELEMETRY, hub_consumer(incarnation))
    mirror = await hub.mirror(a.id)
    # The mirror gives up the consumer it heard nothing from; then it is made again.
    await eventually(lambda: mirror_silent_for(hub.js, mirror, 15), timeout=60, what="given up")
    await hub.look_away()  # the hub looks away while the consumer falls behind
    config = hub_consumer_config(a.config, TELEMETRY, incarnation, packed=True)
    await a.js.add_consumer(TELEMETRY, config)

    async def behind() -> bool:
        info = await _consumer(a)
        return info.delivered.stream_seq < crossed and info.num_ack_pending > 0

    # Sending again what the mirror holds, from the first message: what the hub must mend.
    await eventually(behind, timeout=30, what="the consumer behind the mirror")
    hub.start_watch()
    for n in range(BEHIND, BEHIND + 3 * WINDOW):
        await a.js.publish("tele.temp", str(n).encode())
    # The hub looks at a linked island's consumer as it starts and every 30 s after.
    everything = functools.partial(aggregate_has, hub, "FLEET_TELEMETRY", BEHIND + 3 * WINDOW)
    await eventually(everything, timeout=RESUME_TIMEOUT + 40, what="every reading at the hub")
    assert await readings_held(hub.js, "FLEET_TELEMETRY") == BEHIND + 3 * WINDOW
