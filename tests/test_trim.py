"""The hub's telemetry trimmed of what the archive holds. Nothing trimmed the hub's streams:
every hub's store filled in time, after which nats-server refused every device's data. The
trim must take only what is archived, and a restarted hub must not source it again."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError
from pyspark.sql import SparkSession

from edge_agent.protocol.names import command_stream
from hub_ingest.archive import maintenance
from hub_ingest.archive.audit import audit_archive
from hub_ingest.fleet.enrol import retire
from hub_ingest.fleet.gaps import read_gaps
from hub_ingest.ingest.job import ingest
from hub_ingest.local.fleet import write_hub_toml
from tests.support.cluster import Device, Hub
from tests.support.ingest import ingest_config, run_once
from tests.support.waiting import eventually

AGGREGATE = "FLEET_TELEMETRY"


async def _publish(hub: Hub, device: Device, first: int, count: int) -> None:
    for i in range(first, first + count):
        await device.js.publish("tele.temp", json.dumps({"t": i}).encode())
    last = first + count - 1
    await eventually(
        lambda: _last_is(hub, AGGREGATE, last), timeout=90, what=f"reading {last} at the hub"
    )


async def _last_is(hub: Hub, stream: str, seq: int) -> bool:
    return (await hub.js.stream_info(stream)).state.last_seq >= seq


@pytest.mark.spark
async def test_the_hub_keeps_only_what_is_not_archived(
    hub: Hub, spark: SparkSession, tmp_path: Path
) -> None:
    a = await hub.device("a", heartbeat_interval="1h")
    await _publish(hub, a, 1, 50)
    mirror = await hub.mirror("a")
    config = ingest_config(hub, keep_on_hub=0.0)

    nothing_archived = await maintenance.trim(config)
    assert nothing_archived.messages == 0, nothing_archived

    await run_once(spark, config)
    await _publish(hub, a, 51, 10)  # not archived yet
    toml = write_hub_toml(ingest_config(hub), tmp_path / "hub.toml")  # keep_on_hub: 1 day
    trim = [sys.executable, "-m", "hub_ingest", "trim", "--json", "--config", str(toml)]
    kept_a_day = await asyncio.to_thread(subprocess.run, trim, capture_output=True, text=True)
    assert kept_a_day.returncode == 0, kept_a_day.stderr
    assert json.loads(kept_a_day.stdout)["messages"] == 0, kept_a_day.stdout

    trimmed = await maintenance.trim(config)
    by_stream = {t.stream: t for t in trimmed.streams}
    assert by_stream[AGGREGATE].messages == 50 and by_stream[AGGREGATE].first == 51
    assert by_stream[mirror].messages == 50 and by_stream[mirror].first == 51
    for stream in (AGGREGATE, mirror):
        state = (await hub.js.stream_info(stream)).state
        assert (state.first_seq, state.messages) == (51, 10), stream

    # A restarted hub must not source the purged rows again: each aggregate finds where its
    # sources stand from its rows' headers, and none of this mirror's trimmed rows is left.
    await hub.restart()
    await _publish(hub, a, 61, 20)
    await eventually(
        lambda: _holds(hub, AGGREGATE, 30), timeout=90, what="30 rows after the restart"
    )
    await run_once(spark, config)
    (audit,) = [d for d in audit_archive(config.ingest).devices if d.hub_stream == AGGREGATE]
    assert (audit.rows, audit.duplicates, audit.missing) == (80, 0, ()), audit
    assert (audit.first_seq, audit.last_seq) == (1, 80)
    # The refill took the trimmed head for what it is: nothing skipped, refilled or lost.
    record = (await read_gaps(hub.js)).get(mirror)
    assert record is not None and record.head == 51, record
    assert (record.refilled, record.kept, record.lost, record.pending) == (0, [], {}, []), record
    # Nor does `report` take the trimmed heads for skips.
    report = [*trim[:3], "report", "--json", "--silent-after", "1d", "--config", str(toml)]
    run = await asyncio.to_thread(subprocess.run, report, capture_output=True, text=True)
    doc = json.loads(run.stdout)
    assert (doc["warnings"], [d["flags"] for d in doc["devices"]]) == ([], [[]]), doc


async def _holds(hub: Hub, stream: str, count: int) -> bool:
    state = (await hub.js.stream_info(stream)).state
    assert state.messages <= count, f"{stream} holds {state.messages} rows, sourced again?"
    return state.messages == count


@pytest.mark.spark
async def test_a_skip_the_refill_has_not_looked_at_holds_the_trim(
    hub: Hub, spark: SparkSession
) -> None:
    """The refill looks for a mirror's skipped row in the aggregate before it reads it from
    the island again: trimmed from the aggregate first, the row would be archived twice."""
    a = await hub.device("a", heartbeat_interval="1h")
    await _publish(hub, a, 1, 20)
    mirror = await hub.mirror("a")
    config = ingest_config(hub, keep_on_hub=0.0)
    await run_once(spark, config)
    await hub.look_away()  # the watcher down, and with it the refill
    assert await hub.js.delete_msg(mirror, 5)  # a row lost by the mirror, not the aggregate

    held = await maintenance.trim(config)
    assert held.held_for_refill == [mirror], held
    assert {AGGREGATE, mirror}.isdisjoint(t.stream for t in held.streams), held

    await hub.stop_watching()
    hub.start_watch()

    async def settled() -> bool:
        record = (await read_gaps(hub.js)).get(mirror)
        return record is not None and record.kept == [(5, 5)]

    await eventually(settled, timeout=30, what="the refill finding row 5 in the aggregate")
    trimmed = await maintenance.trim(config)
    purged = {t.stream: t.messages for t in trimmed.streams if t.stream in (AGGREGATE, mirror)}
    assert (purged, trimmed.held_for_refill) == ({AGGREGATE: 20, mirror: 19}, []), trimmed
    await _publish(hub, a, 21, 5)
    await run_once(spark, config)
    (audit,) = [d for d in audit_archive(config.ingest).devices if d.hub_stream == AGGREGATE]
    assert (audit.rows, audit.duplicates, audit.missing) == (25, 0, ()), audit


@pytest.mark.spark
async def test_a_silent_device_keeps_its_last_heartbeat_through_a_trim(
    hub: Hub, spark: SparkSession, tmp_path: Path
) -> None:
    """`report` reads a device's last heartbeat in its events shard, however old: trimmed
    with the rest, a device silent for longer than `keep_on_hub` would read as never seen."""
    a = await hub.device("a")  # a heartbeat every 2 s
    events = "FLEET_EVENTS"
    await eventually(lambda: _last_is(hub, events, 2), timeout=60, what="two heartbeats at the hub")
    await a.stop()  # silent from now on
    config = ingest_config(hub, keep_on_hub=0.0)
    await run_once(spark, config)
    trimmed = await maintenance.trim(config)
    last = (await hub.js.stream_info(events)).state.last_seq
    assert {t.stream: t.first for t in trimmed.streams}[events] == last + 1, trimmed
    assert (await hub.js.stream_info(events)).state.messages == 0

    toml = write_hub_toml(config, tmp_path / "hub.toml")
    report = [sys.executable, "-m", "hub_ingest", "report", "--json", "--config", str(toml)]
    run = await asyncio.to_thread(subprocess.run, report, capture_output=True, text=True)
    (device,) = json.loads(run.stdout)["devices"]
    assert device["last_heartbeat_at"] is not None, device
    assert "never_seen" not in device["flags"], device


@pytest.mark.spark
async def test_a_continuous_ingest_trims_as_it_goes(hub: Hub, spark: SparkSession) -> None:
    a = await hub.device("a", heartbeat_interval="1h")
    await _publish(hub, a, 1, 30)
    config = ingest_config(hub, keep_on_hub=0.0, trigger_interval=1.0)
    stop = threading.Event()
    run = asyncio.ensure_future(asyncio.to_thread(ingest, spark, config, once=False, stop=stop))

    async def trimmed() -> bool:
        assert not run.done(), run
        state = (await hub.js.stream_info(AGGREGATE)).state
        return (state.first_seq, state.messages) == (31, 0)

    try:
        await eventually(trimmed, timeout=120, what="the aggregate trimmed as it is archived")
    finally:
        stop.set()
        await run
    (audit,) = [d for d in audit_archive(config.ingest).devices if d.hub_stream == AGGREGATE]
    assert (audit.rows, audit.duplicates, audit.missing) == (30, 0, ()), audit


@pytest.mark.spark
async def test_a_removed_devices_streams_go_once_its_rows_are_archived(
    hub: Hub, spark: SparkSession
) -> None:
    """A removed device's hub mirrors stayed for ever: a fleet that replaces devices over the
    years would pay for every one it ever had. They go once the archive has their rows, and
    not before (the ingest reads each row's store time and incarnation there)."""
    a = await hub.device("a", heartbeat_interval="1h")
    b = await hub.device("b", heartbeat_interval="1h")
    await _publish(hub, a, 1, 10)
    await _publish(hub, b, 1, 10)  # the aggregate's sequences 11..20
    mirror = await hub.mirror("b")
    config = ingest_config(hub, keep_on_hub=0.0)

    change = await retire(hub.js, hub.config, "b")
    assert change.unsourced == {}, change
    # Nothing archived: b's mirrors are needed yet; its commands are not.
    before = await maintenance.trim(config)
    assert before.deleted == [command_stream("b")], before
    assert await _exists(hub, mirror)

    await run_once(spark, config)
    trimmed = await maintenance.trim(config)
    names = await hub.js.streams_info()
    left = {s.config.name for s in names if "_b" in (s.config.name or "")}
    assert mirror in trimmed.deleted, trimmed
    assert left == set(), left
    assert await _exists(hub, await hub.mirror("a"))
    assert mirror not in await read_gaps(hub.js)
    rows = {
        d.device_id: d.rows
        for d in audit_archive(config.ingest).devices
        if d.hub_stream == AGGREGATE
    }
    assert rows == {"a": 10, "b": 10}, rows


async def _exists(hub: Hub, stream: str) -> bool:
    try:
        await hub.js.stream_info(stream)
    except NotFoundError:
        return False
    return True
