"""Leaf-link compression chosen per link by its measured round trip (`hub.compression =
"by_rtt"`, the default), with the hub offering `accept`."""

from __future__ import annotations

import pytest

from edge_agent.island.compression import OFF, ON, choose, link_mode
from edge_agent.island.streams import START_WINDOW, UNCOMPRESSED_START_WINDOW
from edge_agent.protocol.monitor import Monitor, go_duration
from edge_agent.protocol.names import OUTBOUND
from hub_ingest.local.link import Shape
from tests.support.cluster import Device, Hub
from tests.support.waiting import RESUME_TIMEOUT, eventually


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1.5ms", 0.0015), ("250µs", 0.00025), ("2s", 2.0), ("1m3.5s", 63.5), ("", None), ("x", None)],
)
def test_go_durations_are_read_as_the_monitor_prints_them(text: str, seconds: float | None) -> None:
    assert go_duration(text) == pytest.approx(seconds) if seconds else go_duration(text) is None


def test_the_choice_has_hysteresis() -> None:
    assert choose(0.019, OFF, 0.02) == OFF
    assert choose(0.020, OFF, 0.02) == ON
    assert choose(0.015, ON, 0.02) == ON  # between half and the threshold: stays on
    assert choose(0.009, ON, 0.02) == OFF


async def _leaf_compression(monitor: Monitor) -> str | None:
    leafz = await monitor.get("/leafz")
    spokes = [leaf for leaf in leafz.get("leafs") or [] if leaf.get("is_spoke")]
    return str(spokes[0].get("compression") or "off") if spokes else None


async def _compressed(device: Device) -> bool:
    mode = await _leaf_compression(device.monitor)
    return mode is not None and mode.startswith("s2")


async def _uplink_windows(device: Device) -> set[int | None]:
    """max_ack_pending of the consumers the hub's mirrors read the island's streams through."""
    return {c.config.max_ack_pending for s in OUTBOUND for c in await device.js.consumers_info(s)}


async def _has_windows(device: Device, windows: set[int | None]) -> bool:
    return await _uplink_windows(device) == windows


async def test_a_slow_link_is_compressed_and_a_fast_one_is_not(hub: Hub) -> None:
    slow = await hub.device("slow", start=False)
    slow.proxy.shape = Shape(rtt=0.05)
    await slow.start()
    fast = await hub.device("fast")
    await eventually(lambda: _compressed(slow), timeout=RESUME_TIMEOUT, what="slow link on s2")
    assert link_mode(slow.config) == ON
    await fast.wait_link(up=True)
    assert await _leaf_compression(fast.monitor) == OFF
    assert link_mode(fast.config) == OFF
    # The hub's mirrors get the window of the link's mode: the slow link's grew with the switch.
    assert await _uplink_windows(fast) == {UNCOMPRESSED_START_WINDOW}
    await eventually(
        lambda: _has_windows(slow, {START_WINDOW}), timeout=30, what="the compressed window"
    )

    # The choice outlives the agent: the island starts with it next time.
    await slow.stop()
    await slow.start()
    await slow.wait_link(up=True)
    await eventually(lambda: _compressed(slow), timeout=RESUME_TIMEOUT, what="s2 after restart")

    # Readings cross the compressed link.
    await slow.js.publish("tele.t", b"over-s2")
    mirror = await hub.mirror(slow.id)

    async def arrived() -> bool:
        return (await hub.js.stream_info(mirror)).state.messages >= 1

    await eventually(arrived, timeout=RESUME_TIMEOUT, what="the reading at the hub")
