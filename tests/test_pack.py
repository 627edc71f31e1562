"""Packed telemetry (``hub.pack``): readings cross the link many to a message, and the archive
still gets one row per reading, at its own device sequence, exactly once."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import pyarrow as pa
import pytest
from nats.js.api import RawStreamMsg
from pyspark.sql import SparkSession

from edge_agent.island.streams import packs_budget, reconcile
from edge_agent.protocol.pack import (
    PACK_HEADER,
    PACK_SUBJECT,
    PackError,
    Reading,
    decode,
    encode,
)
from edge_agent.status.health import collect_status
from hub_ingest.archive import table
from hub_ingest.archive.audit import audit_archive
from hub_ingest.archive.columns import header_map, unpack
from hub_ingest.fleet.gaps import healed
from hub_ingest.ingest.source import ARROW_SCHEMA
from hub_ingest.local.link import Shape
from hub_ingest.report.heartbeats import readings_dropped
from tests.support.cluster import (
    PACKED,
    UNPACKED,
    Device,
    Hub,
    mirror_live,
    packed_readings,
    reset_uplink,
    stream_messages,
)
from tests.support.ingest import aggregate_has, ingest_config, run_once
from tests.support.waiting import RESUME_TIMEOUT, eventually


def packed_seqs(msgs: Sequence[RawStreamMsg]) -> list[int]:
    """The reading sequences the packs among `msgs` hold, in order."""
    return [r.seq for r in packed_readings(msgs)]


async def _publish(device: Device, first: int, count: int, noise: int = 0) -> None:
    """Readings ``{"i": …}``, with `noise` random bytes (hex) that no link compresses away."""
    for i in range(first, first + count):
        reading = {"i": i, "noise": secrets.token_hex(noise // 2)}
        await device.js.publish("tele.temp", json.dumps(reading).encode())


def test_a_pack_keeps_each_reading_and_a_broken_one_stays_a_row() -> None:
    readings = [
        Reading(7, 1_764_000_000_123_456_789, "tele.a", b'{"v":1}', {"Nats-Msg-Id": "x"}),
        Reading(9, 1_764_000_001_000_000_000, "tele.b.c", b""),
    ]
    body, headers = encode(readings)
    # Store times cross to the microsecond, as the archive keeps them.
    assert decode(body) == [replace(readings[0], time_ns=1_764_000_000_123_456_000), readings[1]]
    assert headers == {PACK_HEADER: "7 9 2"}
    v1 = b'{"v":1,"r":[[7,1764000000123456789,"tele.a",7,{"Nats-Msg-Id":"x"}],' + (
        b'[9,1764000001000000000,"tele.b.c",0]]}\n{"v":1}'
    )
    assert decode(v1) == readings, "packs of the first form are still read"
    index, _, payloads = body.partition(b"\n")
    for broken in (
        index.replace(b'"size":[7,0]', b'"size":[8,0]'),  # more bytes than the body holds
        index.replace(b'"size":[7,0]', b'"size":[9,-2]'),
        index.replace(b'"dseq":[0,2]', b'"dseq":[0]'),
        index.replace(b'"subject":[0,1]', b'"subject":[0,2]'),
        index.replace(b'"v":2', b'"v":3'),
    ):
        assert broken != index
        with pytest.raises(PackError):
            decode(broken + b"\n" + payloads)

    blocks = [
        f"NATS/1.0\r\n{PACK_HEADER}: 7 9 2\r\n\r\n".encode(),
        f"NATS/1.0\r\n{PACK_HEADER}: 1 1 1\r\n\r\n".encode(),  # a body that is no pack
    ]
    columns = {
        "subject": pa.array(["pack.tele", "pack.tele"]),
        "device_seq": pa.array([1, 2], pa.int64()),
        "hub_seq": pa.array([10, 11], pa.int64()),
        "device_time": pa.array([0, 0], pa.timestamp("us", tz="UTC")),
        "headers": header_map(pa.array(blocks, pa.binary())),
        "payload": pa.array([body, b"not a pack"], pa.binary()),
    }
    out = unpack(columns, ARROW_SCHEMA)
    assert out["device_seq"].to_pylist() == [7, 9, 2]
    assert out["subject"].to_pylist() == ["tele.a", "tele.b.c", "pack.tele"]
    assert out["hub_seq"].to_pylist() == [10, 10, 11]
    assert out["payload"].to_pylist() == [b'{"v":1}', b"", b"not a pack"]
    assert out["headers"].to_pylist()[0] == [("Nats-Msg-Id", "x")]
    first = out["device_time"].cast(pa.int64()).to_pylist()[0]
    assert first == 1_764_000_000_123_456


def test_a_batch_of_full_packs_unpacks() -> None:
    """17 packs of 1,024 readings of 128 bytes: unpacking once copied each pack's whole body
    per reading it held, 2.3 GB here, past what an Arrow binary column holds."""
    packs = [
        encode([Reading(p * 1024 + i, 0, "tele.a", bytes(128)) for i in range(1, 1025)])
        for p in range(17)
    ]
    blocks = [f"NATS/1.0\r\n{PACK_HEADER}: {h[PACK_HEADER]}\r\n\r\n".encode() for _, h in packs]
    columns = {
        "subject": pa.array(["pack.tele"] * 17),
        "device_seq": pa.array(range(1, 18), pa.int64()),
        "hub_seq": pa.array(range(1, 18), pa.int64()),
        "device_time": pa.array([0] * 17, pa.timestamp("us", tz="UTC")),
        "headers": header_map(pa.array(blocks, pa.binary())),
        "payload": pa.array([body for body, _ in packs], pa.binary()),
    }
    out = unpack(columns, ARROW_SCHEMA)
    assert out["device_seq"].to_pylist() == list(range(1, 17 * 1024 + 1))
    assert out["hub_seq"].to_pylist() == [p for p in range(1, 18) for _ in range(1024)]
    assert list(out) == list(columns)


@pytest.mark.timeout(300)
async def test_a_backlog_crosses_in_packs_and_is_archived_one_row_per_reading(
    hub: Hub, spark: SparkSession, tmp_path: Path
) -> None:
    device = await hub.device("p1", register_when_ready=True, sections=PACKED)
    mirror = await hub.mirror(device.id)
    await eventually(lambda: mirror_live(hub.js, mirror), timeout=RESUME_TIMEOUT)
    await _publish(device, 0, 5)  # link up: readings cross within a moment, a few per pack
    await eventually(
        lambda: aggregate_has(hub, "FLEET_TELEMETRY", 5), timeout=30, what="first readings"
    )

    device.proxy.cut()
    await device.wait_link(up=False)
    await _publish(device, 5, 1995)
    device.proxy.restore()
    await eventually(
        lambda: aggregate_has(hub, "FLEET_TELEMETRY", 2000), timeout=RESUME_TIMEOUT + 60
    )

    await eventually(partial(_beat_packed, device, 2000), timeout=30, what="heartbeat")
    status = await collect_status(device.config)
    telemetry, readings = status.streams["TELEMETRY"], status.streams["READINGS"]
    assert telemetry.packed and not readings.packed
    assert (readings.last_seq, readings.incarnation) == (2000, telemetry.incarnation)
    packs = await stream_messages(hub.js, mirror)
    assert packed_seqs(packs) == list(range(1, 2001)), "each reading once, in order"
    assert all(m.subject == PACK_SUBJECT for m in packs)
    assert len(packs) < 100, f"{len(packs)} packs for 2,000 readings"

    config = ingest_config(hub, max_messages_per_trigger=5, messages_per_partition=2)
    await run_once(spark, config)
    rows = table.read(config.ingest, row_filter="subject = 'tele.temp'")
    assert rows is not None
    rows = rows.sort_by("device_seq")
    assert rows["device_seq"].to_pylist() == list(range(1, 2001))
    assert [json.loads(p)["i"] for p in rows["payload"].to_pylist()] == list(range(2000))
    assert set(rows["device_id"].to_pylist()) == {"p1"}
    assert rows["device_time"].null_count == 0
    report = audit_archive(config.ingest)
    archived = [d for d in report.devices if d.hub_stream == "FLEET_TELEMETRY"]
    assert [(d.rows, d.duplicates, d.missing) for d in archived] == [(2000, 0, ())]


@pytest.mark.timeout(300)
async def test_the_packer_neither_repeats_nor_skips_across_agent_restarts(hub: Hub) -> None:
    """The packer's cursor is the last pack on the island: agents stopped while the link is
    down (the packer waiting for the hub) and while it drains (packing on) leave every
    reading in exactly one pack."""
    device = await hub.device("p2", register_when_ready=True, sections=PACKED)
    device.proxy.cut()
    await device.wait_link(up=False)
    await _publish(device, 0, 3000, noise=200)  # 3000 * 215 bytes: more than PACK_LEAD packs hold
    for _ in range(2):
        await device.stop()
        await device.start()
    await eventually(partial(_packed_on_island, device, 1), timeout=30)
    packed = packed_seqs(await stream_messages(device.js, "TELEMETRY"))
    assert packed == list(range(1, len(packed) + 1)) and len(packed) < 3000
    device.proxy.shape = Shape(rtt=0.05, rate=40_000)  # 645 kB: about 15 s
    device.proxy.restore()
    await eventually(partial(_packed_on_island, device, len(packed) + 1), timeout=RESUME_TIMEOUT)
    await device.stop()
    await device.start()
    await eventually(partial(_packed_on_island, device, 3000), timeout=RESUME_TIMEOUT + 60)
    assert packed_seqs(await stream_messages(device.js, "TELEMETRY")) == list(range(1, 3001))


async def test_readings_waiting_offline_get_most_of_the_telemetry_budget(hub: Hub) -> None:
    """Nothing is packed while the link is down, so READINGS is a packing device's offline
    buffer: it takes the budget but the packs' share, and an island made with the earlier
    half-and-half split (its store reserving both) is brought to it in place."""
    device = await hub.device("p3", sections=PACKED)
    budget = device.config.streams.telemetry.max_bytes
    packs = packs_budget(budget, device.config.island.max_payload)
    assert budget // 10 <= packs < budget // 2
    for stream in ("READINGS", "TELEMETRY"):  # as an island of the earlier release made them
        info = await device.js.stream_info(stream)
        await device.js.update_stream(replace(info.config, max_bytes=budget // 2))
    await reconcile(device.js, device.config)
    sizes = {
        s: (await device.js.stream_info(s)).config.max_bytes for s in ("TELEMETRY", "READINGS")
    }
    assert sizes == {"TELEMETRY": packs, "READINGS": budget - packs}


async def test_packs_stay_within_a_small_island_max_payload(hub: Hub) -> None:
    """An island whose max_payload (16 KiB) is below the packs the pace grows to: a pack over
    it crosses as two, where it was dropped whole (its readings counted skipped)."""
    small = {**PACKED, "island": {"max_payload": 16 * 1024}}
    device = await hub.device("p4", register_when_ready=True, sections=small)
    mirror = await hub.mirror(device.id)
    await eventually(lambda: mirror_live(hub.js, mirror), timeout=RESUME_TIMEOUT)
    device.proxy.cut()
    await device.wait_link(up=False)
    await _publish(device, 0, 4000, noise=200)  # 860 kB: packs grow past 16 KiB on loopback
    device.proxy.restore()
    await eventually(
        lambda: aggregate_has(hub, "FLEET_TELEMETRY", 4000), timeout=RESUME_TIMEOUT + 60
    )
    packs = await stream_messages(device.js, "TELEMETRY")
    assert packed_seqs(packs) == list(range(1, 4001))
    assert max(len(p.data or b"") for p in packs) <= 16 * 1024
    await eventually(partial(_beat_packed, device, 4000), timeout=30, what="heartbeat")


async def test_the_packer_reads_on_when_its_consumer_is_gone(hub: Hub) -> None:
    """The packer's ephemeral consumer on READINGS deleted (as an island restart loses it):
    its next batch request finds no responder, and the packer starts again instead of
    asking on and on for nothing."""
    device = await hub.device("p5", register_when_ready=True, sections=PACKED)
    mirror = await hub.mirror(device.id)
    await eventually(lambda: mirror_live(hub.js, mirror), timeout=RESUME_TIMEOUT)
    await _publish(device, 0, 5)
    await eventually(
        lambda: aggregate_has(hub, "FLEET_TELEMETRY", 5), timeout=30, what="first readings"
    )
    consumers = await device.js.consumers_info("READINGS")
    assert consumers
    for consumer in consumers:
        await device.js.delete_consumer("READINGS", consumer.name)
    await _publish(device, 5, 20)
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 25), timeout=30, what="the rest")


async def _beat_packed(device: Device, readings: int) -> bool:
    """The device's last heartbeat says the packer packed `readings` and skipped none."""
    msg = await device.js.get_last_msg("EVENTS", f"evt.{device.id}.heartbeat")
    packer = json.loads(msg.data or b"{}").get("packer") or {}
    return packer.get("readings") == readings and packer.get("skipped") == 0


async def _packed_on_island(device: Device, readings: int) -> bool:
    return len(packed_seqs(await stream_messages(device.js, "TELEMETRY"))) >= readings


@pytest.mark.timeout(300)
async def test_packs_a_mirror_skipped_are_refilled_and_archived_as_readings(
    hub: Hub, spark: SparkSession
) -> None:
    """The hub's mirror made to skip two packs (as nats-server does when it binds above its
    copy): the refill reads them from the island, and the archive and the audit count their
    readings, each once."""
    device = await hub.device("p3", register_when_ready=True, sections=PACKED)
    mirror = await hub.mirror(device.id)
    await _publish(device, 0, 5)
    await eventually(
        lambda: aggregate_has(hub, "FLEET_TELEMETRY", 5), timeout=RESUME_TIMEOUT, what="5"
    )
    before = (await hub.js.stream_info(mirror)).state.last_seq
    device.proxy.cut()
    await device.wait_link(up=False)
    for burst in range(3):  # three packs at least
        await _publish(device, 5 + burst * 10, 10)
        await eventually(partial(_island_packs, device, before + burst + 1), timeout=10)
    await reset_uplink(device, before + 3)
    skipped = packed_seqs(
        [
            m
            for m in await stream_messages(device.js, "TELEMETRY")
            if m.seq in (before + 1, before + 2)
        ]
    )
    device.proxy.restore()
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 35), timeout=RESUME_TIMEOUT + 30)

    config = ingest_config(hub)
    await run_once(spark, config)
    rows = table.read(config.ingest, row_filter="subject = 'tele.temp'")
    assert rows is not None
    assert sorted(rows["device_seq"].to_pylist()) == list(range(1, 36))
    report = audit_archive(config.ingest, await healed(hub.js))
    (tele,) = [d for d in report.devices if d.hub_stream == "FLEET_TELEMETRY"]
    assert (tele.refilled, tele.refilled_archived, tele.duplicates) == (len(skipped),) * 2 + (0,)
    assert skipped and report.ok


async def _island_packs(device: Device, packs: int) -> bool:
    return (await device.js.stream_info("TELEMETRY")).state.last_seq >= packs


def test_the_report_counts_a_packed_devices_dropped_readings_not_packs() -> None:
    def beat(streams: dict[str, dict[str, int]]) -> dict[str, object]:
        return {"streams": streams}

    packed = beat({"TELEMETRY": {"dropped": 3}, "READINGS": {"dropped": 0}})
    assert readings_dropped(packed) == 0
    assert readings_dropped(beat({"TELEMETRY": {"dropped": 3}})) == 3


@pytest.mark.timeout(120)
async def test_a_readings_stream_made_again_continues_after_the_last_packed_reading(
    hub: Hub,
) -> None:
    """``READINGS`` lost (a power cut's damaged stream is set aside and made again) while
    ``TELEMETRY`` keeps its packs: the new one starts after the last reading packed, so no
    reading takes a sequence the hub already has under the same incarnation."""
    device = await hub.device("p4", sections=PACKED)
    await _publish(device, 0, 10)
    await eventually(partial(_packed_on_island, device, 10), timeout=30)
    await device.js.delete_stream("READINGS")
    await device.stop()
    await device.start()
    assert (await device.js.stream_info("READINGS")).state.first_seq == 11
    await _publish(device, 10, 5)
    await eventually(partial(_packed_on_island, device, 15), timeout=30)
    assert packed_seqs(await stream_messages(device.js, "TELEMETRY")) == list(range(1, 16))


async def test_an_island_made_unpacked_crosses_unpacked_under_an_agent_that_packs(
    hub: Hub,
) -> None:
    """An island made before packing became the default, under an upgraded agent that packs
    (the new default): its telemetry keeps crossing reading by reading, none lost or twice,
    and no ``READINGS`` is made beside it."""
    device = await hub.device("u1", register_when_ready=True, sections=UNPACKED)
    await _publish(device, 0, 5)
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 5), timeout=RESUME_TIMEOUT)
    await device.stop()
    device.config = replace(device.config, hub=replace(device.config.hub, pack=True))
    await device.start()
    await _publish(device, 5, 5)
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 10), timeout=RESUME_TIMEOUT)
    msgs = await stream_messages(hub.js, "FLEET_TELEMETRY")
    assert not [m for m in msgs if PACK_HEADER in (m.headers or {})]
    assert [json.loads(m.data)["i"] for m in msgs] == list(range(10))
    assert "READINGS" not in [info.config.name for info in await device.js.streams_info()]


async def test_an_island_made_packed_keeps_packing_when_the_operator_turns_packing_off(
    hub: Hub,
) -> None:
    """`hub.pack = false` set on a device whose island already packs: the island keeps the
    form it was made with (the hub's mirror and the archive read its sequences as
    ``READINGS``'), so its telemetry keeps crossing in packs, none lost or twice, and the
    readings waiting in ``READINGS`` are not stranded there."""
    device = await hub.device("p1", register_when_ready=True, sections=PACKED)
    await _publish(device, 0, 5)
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 5), timeout=RESUME_TIMEOUT)
    device.proxy.cut()
    await device.wait_link(up=False)
    await _publish(device, 5, 5)  # waiting in READINGS across the change
    await device.stop()
    device.config = replace(device.config, hub=replace(device.config.hub, pack=False))
    await device.start()
    await _publish(device, 10, 5)
    device.proxy.restore()
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 15), timeout=RESUME_TIMEOUT)
    msgs = await stream_messages(hub.js, "FLEET_TELEMETRY")
    assert all(PACK_HEADER in (m.headers or {}) for m in msgs), "in packs only"
    assert [json.loads(r.data)["i"] for r in packed_readings(msgs)] == list(range(15))
