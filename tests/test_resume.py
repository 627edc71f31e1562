"""Data flows again within seconds of a link's return, whatever the outage.

Stock nats-server resumes a mirror 10-40 s after a long cut (or a hub restart); the mirrors
here are bound to durable consumers (see `edge_agent.island.streams`,
`hub_ingest.fleet.provision`), so both directions must resume well inside that. Deadlines,
not timings: the bench (`bench/link_resume.py`) measures how fast. The devices pack their
telemetry, as by default (`hub.pack`).
"""

from __future__ import annotations

from tests.support.cluster import (
    PACKED,
    Device,
    Hub,
    hub_has_reading,
    mirror_live,
    mirror_silent_for,
    stream_has,
)
from tests.support.waiting import RESUME_TIMEOUT, eventually

STALLED_S = 30  # a cut this long leaves a stock mirror in its retry back-off
DEADLINE_S = 8  # ours resume in 0.2-5.3 s; stock takes 10-40 s


async def _live(hub: Hub, device: Device) -> None:
    mirror = await hub.mirror(device.id)
    await eventually(lambda: mirror_live(hub.js, mirror), timeout=RESUME_TIMEOUT, what="hub")
    await eventually(lambda: mirror_live(device.js, "COMMANDS"), timeout=RESUME_TIMEOUT)


async def _both_arrive(hub: Hub, device: Device, n: int) -> None:
    await eventually(
        lambda: hub_has_reading(hub.js, device.id, f"tele.r.{n}"),
        timeout=DEADLINE_S,
        what="the reading at the hub",
    )
    await eventually(
        lambda: stream_has(device.js, "COMMANDS", f"cmd.{device.id}.r{n}"),
        timeout=DEADLINE_S,
        what="the command in the island's mirror",
    )


async def test_both_directions_resume_within_seconds_of_a_30s_cut(hub: Hub) -> None:
    a = await hub.device("a", register_when_ready=True, sections=PACKED)
    await hub.provision()
    await _live(hub, a)
    mirror = await hub.mirror("a")

    a.proxy.cut()
    await a.wait_link(up=False)
    await a.js.publish("tele.r.1", b"during the cut")
    await hub.js.publish("cmd.a.r1", b"{}")
    await eventually(
        lambda: mirror_silent_for(hub.js, mirror, STALLED_S),
        timeout=STALLED_S + 30,
        what=f"the hub's mirror silent for {STALLED_S}s",
    )
    assert await mirror_silent_for(a.js, "COMMANDS", STALLED_S - 5)
    a.proxy.restore()
    await _both_arrive(hub, a, 1)


async def test_both_directions_resume_within_seconds_of_a_hub_restart(hub: Hub) -> None:
    a = await hub.device("a", register_when_ready=True, sections=PACKED)
    await hub.provision()
    await _live(hub, a)

    hub.server.kill()
    await a.wait_link(up=False)
    await a.js.publish("tele.r.2", b"while the hub was down")
    await hub.server.start()
    await hub.js.publish("cmd.a.r2", b"{}")
    await _both_arrive(hub, a, 2)
