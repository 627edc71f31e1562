"""Telemetry and commands across a leaf link that the test cuts and restores."""

from __future__ import annotations

import json

from tests.support.cluster import Device, Hub, stream_messages
from tests.support.waiting import RESUME_TIMEOUT, eventually


async def test_telemetry_published_while_cut_reaches_hub_once_in_order(hub: Hub) -> None:
    """Readings buffered on the island during an outage arrive once, in order, with the id."""
    a = await hub.device("a")
    await a.js.publish("tele.temp", b"before-0")
    await eventually(
        lambda: _count(hub, "FLEET_TELEMETRY", "fleet.a.tele.>", 1), timeout=RESUME_TIMEOUT
    )

    a.proxy.cut()
    await a.wait_link(up=False)
    for i in range(20):
        ack = await a.js.publish("tele.temp", f"offline-{i}".encode())
        assert ack.stream == "TELEMETRY"
    a.proxy.restore()
    await a.wait_link(up=True)

    await eventually(
        lambda: _count(hub, "FLEET_TELEMETRY", "fleet.a.tele.>", 21),
        timeout=RESUME_TIMEOUT,
        what="21 readings at the hub",
    )
    msgs = await hub.aggregate_messages("FLEET_TELEMETRY")
    assert [m.subject for m in msgs] == ["fleet.a.tele.temp"] * 21
    assert [m.data for m in msgs] == [b"before-0"] + [f"offline-{i}".encode() for i in range(20)]
    device_seqs = [int(m.headers["Nats-Stream-Source"].split()[1]) for m in msgs]
    assert device_seqs == list(range(1, 22))


async def test_commands_reach_only_their_devices_also_after_a_cut(hub: Hub) -> None:
    """A's mirror gets cmd.a.* and broadcasts, B's only broadcasts; a cut delays, never loses."""
    a = await hub.device("a")
    b = await hub.device("b")
    await hub.js.publish("cmd.a.ping", json.dumps({"id": "c1"}).encode())
    await hub.js.publish("cmd.all.ping", json.dumps({"id": "c2"}).encode())
    await hub.js.publish("cmd.b.ping", json.dumps({"id": "c3"}).encode())
    await eventually(
        lambda: _subjects_are(a, ["cmd.a.ping", "cmd.all.ping"]), timeout=RESUME_TIMEOUT
    )
    await eventually(
        lambda: _subjects_are(b, ["cmd.all.ping", "cmd.b.ping"]), timeout=RESUME_TIMEOUT
    )

    a.proxy.cut()
    await a.wait_link(up=False)
    await hub.js.publish("cmd.a.reboot", json.dumps({"id": "c4"}).encode())
    a.proxy.restore()
    await eventually(
        lambda: _subjects_are(a, ["cmd.a.ping", "cmd.all.ping", "cmd.a.reboot"]),
        timeout=RESUME_TIMEOUT,
        what="command issued during the cut in A's mirror",
    )
    assert await _subjects_are(b, ["cmd.all.ping", "cmd.b.ping"])


async def test_devices_never_receive_each_others_telemetry(hub: Hub) -> None:
    """Islands share subjects but not data: tele.> stays on the device that published it."""
    a = await hub.device("a")
    b = await hub.device("b")
    await a.js.publish("tele.x", b"from-a")
    await b.js.publish("tele.x", b"from-b")
    await eventually(lambda: _count(hub, "FLEET_TELEMETRY", "fleet.*.tele.>", 2), timeout=30)
    for device, payload in ((a, b"from-a"), (b, b"from-b")):
        info = await device.js.stream_info("TELEMETRY")
        assert info.state.messages == 1
        assert (await device.js.get_msg("TELEMETRY", 1)).data == payload
    aggregate = await hub.js.stream_info("FLEET_TELEMETRY")
    assert aggregate.state.messages == 2


async def test_one_message_id_on_two_devices_loses_neither(hub: Hub) -> None:
    """Apps set their own ``Nats-Msg-Id`` (the island drops an app's retries by it), and two
    devices' apps may well pick the same: the hub's aggregates, which source every device,
    keep both (a de-duplication window there would drop one device's message silently)."""
    devices = [await hub.device("a"), await hub.device("b")]
    same = {"Nats-Msg-Id": "reading-1"}
    for device in devices:
        await device.js.publish("tele.x", device.id.encode(), headers=same)
        await device.js.publish(f"evt.{device.id}.alarm", b"hot", headers=same)
        # Sources keep each device's order: once these are at the hub, so is the rest.
        await device.js.publish("tele.last", b"")
        await device.js.publish(f"evt.{device.id}.last", b"")
    await eventually(lambda: _count(hub, "FLEET_TELEMETRY", "fleet.*.tele.last", 2), timeout=30)
    await eventually(lambda: _count(hub, "FLEET_EVENTS", "fleet.*.evt.*.last", 2), timeout=30)
    assert await _count(hub, "FLEET_TELEMETRY", "fleet.*.tele.x", 2)
    assert await _count(hub, "FLEET_EVENTS", "fleet.*.evt.*.alarm", 2)


async def _count(hub: Hub, stream: str, subject: str, expected: int) -> bool:
    info = await hub.js.stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values()) == expected


async def _subjects_are(device: Device, expected: list[str]) -> bool:
    return [m.subject for m in await stream_messages(device.js, "COMMANDS")] == expected
