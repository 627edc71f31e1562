"""Beyond one cluster, on the engine: two regional hubs joined by a gateway (a NATS
supercluster), devices split between them, a command to a device in each, and one archive
that gets the readings of both, exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from hub_ingest.archive import table
from hub_ingest.commands.send import new_envelope, send
from tests.support.cluster import Device, Hub
from tests.support.ingest import ingest_config, run_once, telemetry
from tests.support.regions import start_regions
from tests.support.waiting import RESUME_TIMEOUT, eventually

pytestmark = pytest.mark.slow

READINGS = 10


async def _holds(hub: Hub, stream: str, subject: str, count: int) -> bool:
    info = await hub.js.stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values()) >= count


async def _region_of(hub: Hub, stream: str) -> str | None:
    cluster = (await hub.js.stream_info(stream)).cluster
    return cluster.name if cluster else None


async def _publish(device: Device) -> None:
    for i in range(READINGS):
        await device.js.publish("tele.temp", f'{{"t": {i}}}'.encode())


@pytest.mark.timeout(600)
async def test_two_regions_joined_by_a_gateway_feed_one_archive_exactly_once(
    tmp_path: Path, spark: SparkSession
) -> None:
    hubs = await start_regions(tmp_path)
    eu, us = hubs["eu"], hubs["us"]
    try:
        a = await eu.device("a", register_when_ready=True)
        b = await us.device("b", register_when_ready=True)

        # A device's own streams live in the region it links to; the fleet-wide ones in the
        # region that made them, sourcing the other region's mirrors through the gateway.
        for device, region in ((a, "eu"), (b, "us")):
            mirror = await eventually(lambda d=device: eu.mirror(d.id), timeout=30, what="mirror")
            assert await _region_of(eu, mirror) == region
            assert await _region_of(eu, f"CMD_{device.id}") == region
        assert await _region_of(us, "FLEET_TELEMETRY") == "eu"

        await _publish(a)
        await _publish(b)
        for device in (a, b):
            await send(eu.js, new_envelope(device.id, "ping", {}, 300))
        for device in (a, b):
            prefix = f"fleet.{device.id}"
            await eventually(
                lambda p=prefix: _holds(eu, "FLEET_TELEMETRY", f"{p}.tele.>", READINGS),
                timeout=RESUME_TIMEOUT,
                what=f"{device.id}'s readings in the aggregate",
            )
            await eventually(
                lambda p=prefix, d=device.id: _holds(eu, "FLEET_EVENTS", f"{p}.evt.{d}.result", 1),
                timeout=RESUME_TIMEOUT,
                what=f"{device.id}'s command result in the aggregate",
            )

        config = ingest_config(eu)
        await run_once(spark, config)
        rows = telemetry(config).to_pylist()
        expected = [(d, seq) for d in ("a", "b") for seq in range(1, READINGS + 1)]
        assert [(r["device_id"], r["device_seq"]) for r in rows] == expected
        await run_once(spark, config)  # again: heartbeats are new, nothing comes twice
        assert telemetry(config).to_pylist() == rows
        keys = table.read(config.ingest, ["device_id", "incarnation", "hub_stream", "device_seq"])
        assert keys is not None
        seen = list(zip(*(keys.column(c).to_pylist() for c in keys.column_names), strict=True))
        assert len(seen) == len(set(seen)), "a row archived twice"
    finally:
        for hub in (us, eu):
            await hub.close()
