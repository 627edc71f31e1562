"""An aggregate made anew under its old name (deleted by hand and provisioned again, or on a
hub that lost its store) numbers its rows from 1 again. The ingest's offsets and the
archive's archived sequence were the old stream's: the ingest skipped the new one's rows up
to there, silently, and the trim purged them before they were archived."""

from __future__ import annotations

import json

import pytest
from pyspark.sql import SparkSession

from hub_ingest.archive import maintenance, table
from hub_ingest.archive.audit import audit_archive
from hub_ingest.fleet.streams import made_at
from tests.support.cluster import Device, Hub
from tests.support.ingest import ingest_config, run_once
from tests.support.waiting import eventually

AGGREGATE = "FLEET_TELEMETRY"


async def _publish(hub: Hub, device: Device, first: int, count: int, held: int) -> None:
    """Readings `first`.. on `device`, until the aggregate holds `held` messages."""
    for i in range(first, first + count):
        await device.js.publish("tele.temp", json.dumps({"t": i}).encode())

    async def holds() -> bool:
        return (await hub.js.stream_info(AGGREGATE)).state.messages == held

    await eventually(holds, timeout=90, what=f"{held} messages in {AGGREGATE}")


@pytest.mark.spark
async def test_an_aggregate_made_anew_is_archived_from_its_start(
    hub: Hub, spark: SparkSession
) -> None:
    a = await hub.device("a", heartbeat_interval="1h")
    await _publish(hub, a, 1, 30, held=30)
    config = ingest_config(hub, keep_on_hub=0.0)
    await run_once(spark, config)
    await maintenance.trim(config)  # the hub keeps nothing the archive has
    old = await hub.js.stream_info(AGGREGATE)

    await hub.js.delete_stream(AGGREGATE)
    await hub.provision()
    await _publish(hub, a, 31, 10, held=10)  # the new stream's 1..10
    new = await hub.js.stream_info(AGGREGATE)
    assert (old.state.last_seq, new.state.last_seq, new.created != old.created) == (30, 10, True)

    # Nothing of the new stream is archived: the trim leaves it whole.
    await maintenance.trim(config)
    assert (await hub.js.stream_info(AGGREGATE)).state.messages == 10
    await run_once(spark, config)
    await _publish(hub, a, 41, 25, held=35)
    await run_once(spark, config)

    (audit,) = [d for d in audit_archive(config.ingest).devices if d.hub_stream == AGGREGATE]
    assert (audit.rows, audit.duplicates, audit.missing) == (65, 0, ()), audit
    assert (audit.first_seq, audit.last_seq) == (1, 65)


@pytest.mark.spark
async def test_what_a_stream_made_anew_sources_again_is_archived_once(
    hub: Hub, spark: SparkSession
) -> None:
    """Made anew, an aggregate sources again everything the hub mirrors hold, archived rows
    among them (here all 30: nothing was trimmed): the archive keeps one of each."""
    a = await hub.device("a", heartbeat_interval="1h")
    await _publish(hub, a, 1, 30, held=30)
    config = ingest_config(hub)
    await run_once(spark, config)

    await hub.js.delete_stream(AGGREGATE)
    await hub.provision()
    await _publish(hub, a, 31, 10, held=40)  # 1..30 sourced again, then 31..40
    await run_once(spark, config)
    await _publish(hub, a, 41, 5, held=45)
    await run_once(spark, config)

    (audit,) = [d for d in audit_archive(config.ingest).devices if d.hub_stream == AGGREGATE]
    assert (audit.rows, audit.duplicates, audit.missing) == (45, 0, ()), audit
    archive = table.load(config.ingest)
    assert archive is not None
    made = made_at(await hub.js.stream_info(AGGREGATE))
    # Within the hour after its making, later batches look for rows sourced again too.
    assert archive.properties[f"{table.REMADE}{AGGREGATE}"] == made
