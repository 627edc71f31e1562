"""The ``jetstream`` streaming source: options, batch sizing, gaps and retention losses."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime

import pyarrow as pa
import pytest
from nats.js.api import StreamConfig, StreamSource, SubjectTransform
from pyspark.sql import SparkSession
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from hub_ingest.archive.audit import Gap, audit_archive
from hub_ingest.core.errors import ConfigError, DataLossError
from hub_ingest.fleet.gaps import REFILL_HEADER, REFILL_STREAM, refill_subject
from hub_ingest.ingest.source import JetStreamReader, SeqRange, SourceOptions
from tests.support.cluster import Hub
from tests.support.ingest import aggregate_has, ingest_config, run_once, telemetry
from tests.support.waiting import RESUME_TIMEOUT, eventually


def test_options_arrive_lower_cased_and_are_checked() -> None:
    """Spark lower-cases option keys; values are parsed once, with errors naming the option."""
    options = SourceOptions.parse(
        {
            "servers": "nats://h1:4222, nats://h2:4222",
            "streams": "FLEET_TELEMETRY,FLEET_EVENTS",
            "maxmessagespertrigger": "1000",
            "messagesperpartition": "10",
            "minpartitions": "8",
            "failondataloss": "FALSE",
            "domain": "hub",
        }
    )
    assert options.servers == ("nats://h1:4222", "nats://h2:4222")
    assert options.streams == ("FLEET_TELEMETRY", "FLEET_EVENTS")
    assert (options.max_messages_per_trigger, options.messages_per_partition) == (1000, 10)
    assert options.min_partitions == 8
    assert options.fail_on_data_loss is False
    assert options.api == "$JS.hub.API"
    with pytest.raises(ConfigError, match="messagesperpartition"):
        SourceOptions.parse({"stream": "S", "messagesperpartition": "0"})
    with pytest.raises(ConfigError, match="streams"):
        SourceOptions.parse({"servers": "nats://h:4222"})


def test_partitions_are_sequence_ranges_and_limits_are_shared() -> None:
    """Ranges of at most messagesPerPartition; a stream new to the query reads nothing yet."""
    reader = JetStreamReader(SourceOptions(("nats://x",), ("A", "B"), messages_per_partition=4))
    assert reader.getDefaultReadLimit() == ReadAllAvailable()
    assert reader.partitions({"A": 0}, {"A": 9, "B": 5}) == [
        SeqRange("A", 1, 4),
        SeqRange("A", 5, 8),
        SeqRange("A", 9, 9),
    ]
    limited = JetStreamReader(SourceOptions(("nats://x",), ("A",), max_messages_per_trigger=7))
    assert limited.getDefaultReadLimit() == ReadMaxRows(7)


def test_a_stream_made_anew_is_read_from_its_start() -> None:
    """The offsets carry when each stream was made: one made since numbers from 1 again, and
    the old stream's offset (30) would skip its rows up to there."""
    reader = JetStreamReader(SourceOptions(("nats://x",), ("A", "B"), messages_per_partition=50))
    start = {"A": 30, "B": 30, "made": {"A": "t0", "B": "t0"}}
    end = {"A": 12, "B": 35, "made": {"A": "t1", "B": "t0"}}
    assert reader.partitions(start, end) == [SeqRange("A", 1, 12), SeqRange("B", 31, 35)]
    # Offsets from before streams' times were kept: read on from them.
    assert reader.partitions({"A": 30}, {"A": 35, "made": {"A": "t1"}}) == [SeqRange("A", 31, 35)]


def test_partitions_take_turns_across_streams_and_small_batches_feed_every_core() -> None:
    """Spark starts tasks in partition order: one range of each stream in turn, so that the
    running tasks read every aggregate stream; a batch too small to give each of
    minPartitions cores a full messagesPerPartition range is cut into smaller ones."""
    options = SourceOptions(("nats://x",), ("A", "B"), messages_per_partition=4, min_partitions=2)
    assert JetStreamReader(options).partitions({"A": 0, "B": 0}, {"A": 9, "B": 5}) == [
        SeqRange("A", 1, 4),
        SeqRange("B", 1, 4),
        SeqRange("A", 5, 8),
        SeqRange("B", 5, 5),
        SeqRange("A", 9, 9),
    ]
    small = dataclasses.replace(options, messages_per_partition=100, min_partitions=4)
    assert JetStreamReader(small).partitions({"A": 10, "B": 0}, {"A": 16, "B": 2}) == [
        SeqRange("A", 11, 12),
        SeqRange("B", 1, 2),
        SeqRange("A", 13, 14),
        SeqRange("A", 15, 16),
    ]
    assert JetStreamReader(small).partitions({"A": 16}, {"A": 16}) == []


@pytest.mark.spark
async def test_deleted_sequences_cause_neither_duplicates_nor_stalls(
    hub: Hub, spark: SparkSession
) -> None:
    """Deletes at the head, inside a partition and across a whole partition are skipped.
    (Without the watcher: with it, the rows deleted by hand would be put back, see
    `test_refill`.)"""
    a = await hub.device("a", heartbeat_interval="1h")
    for i in range(60):
        await a.js.publish("tele.temp", str(i).encode())
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 60), timeout=RESUME_TIMEOUT)
    await hub.look_away()
    deleted = {1, 2, 20, 40, 60, *range(33, 49)}  # 33..48 is one whole partition of 16
    for seq in deleted:
        await hub.js.delete_msg("FLEET_TELEMETRY", seq)
    config = ingest_config(hub)  # partitions of 16 from seq 3, batches of 40

    await run_once(spark, config)

    seqs = [r["hub_seq"] for r in telemetry(config).to_pylist()]
    assert seqs == sorted(set(range(1, 61)) - deleted)
    assert [r["device_seq"] for r in telemetry(config).to_pylist()] == seqs
    again = await run_once(spark, config)
    assert again.rows == 0


@pytest.mark.spark
async def test_retention_loss_fails_with_a_count_unless_allowed_then_audit_shows_gap(
    hub: Hub, spark: SparkSession
) -> None:
    """Messages removed before they were archived stop the job, saying how many; with
    failOnDataLoss=false it goes on and the audit reports the unexplained gap."""
    a = await hub.device("a", heartbeat_interval="1h")
    for i in range(30):
        await a.js.publish("tele.temp", str(i).encode())
        if i == 19:
            await eventually(
                lambda: aggregate_has(hub, "FLEET_TELEMETRY", 20), timeout=RESUME_TIMEOUT
            )
            await run_once(spark, ingest_config(hub))
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 30), timeout=RESUME_TIMEOUT)
    await hub.js.purge_stream("FLEET_TELEMETRY", keep=4)  # as max_msgs or max_age would

    with pytest.raises(
        DataLossError, match=r"removed 6 messages of FLEET_TELEMETRY \(seq 21\.\.26\)"
    ):
        await run_once(spark, ingest_config(hub))

    config = ingest_config(hub, fail_on_data_loss=False)
    await run_once(spark, config)
    assert [r["device_seq"] for r in telemetry(config).to_pylist()] == [
        *range(1, 21),
        *range(27, 31),
    ]
    report = audit_archive(config.ingest)
    (device,) = [d for d in report.devices if d.hub_stream == "FLEET_TELEMETRY"]
    assert device.missing == (Gap(21, 26, explained=False),)
    assert not report.ok


async def _read(hub: Hub, part: SeqRange) -> pa.RecordBatch:
    """One partition, read as a Spark task would (in a thread: `read` runs its own loop)."""
    options = SourceOptions(
        (hub.url,),
        (part.stream,),
        credentials=str(hub.config.nats.credentials),
        domain=hub.config.nats.domain,
    )
    (batch,) = await asyncio.to_thread(lambda: list(JetStreamReader(options).read(part)))
    return batch


async def test_rows_are_attributed_from_subject_and_stored_headers(hub: Hub) -> None:
    """A read range becomes rows straight from the server's replies: the device and subject
    from ``fleet.<device>.<subject>``, the origin's sequence and store time through
    ``Nats-Stream-Source``, every stored header kept; rows that break these conventions keep
    what they have instead of failing the batch."""
    # The origin plays the hub's mirror of one device incarnation, which names it.
    origin = StreamConfig(
        name="ORIGIN", subjects=["origin.>"], allow_direct=True, metadata={"incarnation": "i7"}
    )
    await hub.js.add_stream(origin)
    for i in range(3):
        await hub.js.publish("origin.tele", str(i).encode(), headers={"X-Note": "  two words "})
    into_fleet = SubjectTransform(src="origin.>", dest="fleet.d1.origin.>")
    parsed = StreamConfig(
        name="PARSED",
        subjects=["fleet.d2.>", "other"],
        sources=[StreamSource(name="ORIGIN", subject_transforms=[into_fleet])],
        allow_direct=True,
    )
    await hub.js.add_stream(parsed)
    await eventually(lambda: aggregate_has(hub, "PARSED", 3), timeout=RESUME_TIMEOUT)
    await hub.js.publish("fleet.d2.evt.x", b"3")
    await hub.js.publish("other", b"4", headers={"X-Name": "café"})
    await hub.js.delete_msg("PARSED", 2)
    await hub.js.delete_msg("ORIGIN", 3)  # as retention would: its store time is gone

    batch = await _read(hub, SeqRange("PARSED", 1, 4))

    rows = [{**row, "headers": dict(row["headers"])} for row in batch.to_pylist()]

    origin_time = (await hub.js.get_msg("ORIGIN", 1)).time
    expected = [
        ("d1", "i7", "origin.tele", 1, 1, origin_time),
        ("d1", "i7", "origin.tele", 3, 3, None),
        ("d2", None, "evt.x", None, 4, None),
    ]
    columns = ("device_id", "incarnation", "subject", "device_seq", "hub_seq", "device_time")
    assert [tuple(r[c] for c in columns) for r in rows] == expected
    assert [r["payload"] for r in rows] == [b"0", b"2", b"3"]
    assert [r["headers"]["X-Note"] for r in rows[:2]] == ["two words"] * 2
    assert rows[0]["headers"]["Nats-Stream-Source"].split()[:2] == ["ORIGIN", "1"]
    assert rows[2]["headers"] == {}
    assert {r["hub_stream"] for r in rows} == {"PARSED"}
    assert all(r["hub_time"] > origin_time for r in rows)

    other = await _read(hub, SeqRange("PARSED", 5, 5))
    assert other.to_pylist()[0] | {"hub_time": None} == {
        "device_id": None,
        "incarnation": None,
        "subject": "other",
        "device_seq": None,
        "hub_stream": "PARSED",
        "hub_seq": 5,
        "device_time": None,
        "hub_time": None,
        "device_clock_offset_s": None,
        "device_time_suspect": False,
        "headers": [("X-Name", "café")],
        "payload": b"4",
    }


async def test_only_rows_refilled_by_the_hub_count_as_refilled(hub: Hub) -> None:
    """``Edge-Refill-Of`` names where a refilled row came from, but an app on a device can set
    it on its own messages too (the island and the hub's mirror keep it): a row counts as
    refilled only when its aggregate sourced it from ``FLEET_REFILL``. A mirror deleted since
    stops no batch."""
    forged = {REFILL_HEADER: "EDGE_TELEMETRY_d9_i1 999 tele.fake 2020-01-01T00:00:00Z"}
    await hub.js.add_stream(
        StreamConfig(
            name="ORIGIN", subjects=["origin.>"], allow_direct=True, metadata={"incarnation": "i7"}
        )
    )
    await hub.js.publish("origin.tele", b"forged", headers=forged)
    # Refilled from ORIGIN, which plays the hub's mirror of d1's incarnation i7.
    real = {REFILL_HEADER: "ORIGIN 5 tele.x 2026-01-01T00:00:00Z"}
    await hub.js.publish(
        refill_subject("PARSED", "ORIGIN", 5, "d1", "tele.x"), b"real", headers=real
    )
    from_origin = SubjectTransform(src="origin.>", dest="fleet.d1.origin.>")
    from_refill = SubjectTransform(src="refill.PARSED.*.*.>", dest="fleet.>")
    sources = [
        StreamSource(name="ORIGIN", subject_transforms=[from_origin]),
        StreamSource(name=REFILL_STREAM, subject_transforms=[from_refill]),
    ]
    await hub.js.add_stream(StreamConfig(name="PARSED", sources=sources, allow_direct=True))
    await eventually(lambda: aggregate_has(hub, "PARSED", 2), timeout=RESUME_TIMEOUT)

    rows = {r["payload"]: r for r in (await _read(hub, SeqRange("PARSED", 1, 2))).to_pylist()}

    origin_time = (await hub.js.get_msg("ORIGIN", 1)).time
    forged_row = rows[b"forged"]
    assert (forged_row["subject"], forged_row["device_seq"], forged_row["incarnation"]) == (
        "origin.tele",
        1,
        "i7",
    )
    assert forged_row["device_time"] == origin_time
    real_row = rows[b"real"]
    assert (real_row["subject"], real_row["device_seq"], real_row["incarnation"]) == (
        "tele.x",
        5,
        "i7",
    )
    assert real_row["device_time"] == datetime(2026, 1, 1, tzinfo=UTC)

    # The mirror deleted by hand since (the product keeps them): its rows are read still,
    # without the incarnation only it knew.
    await hub.js.delete_stream("ORIGIN")
    again = (await _read(hub, SeqRange("PARSED", 1, 2))).to_pylist()
    assert sorted((r["payload"], r["device_seq"], r["incarnation"]) for r in again) == [
        (b"forged", 1, None),
        (b"real", 5, None),
    ]


async def test_large_messages_are_read_in_pulls_bounded_in_bytes(hub: Hub) -> None:
    """A pull stops at 16 MiB, so 40 messages of 900 kB take three pulls; none is lost or
    doubled where one pull ends and the next begins, and the read leaves no consumer behind."""
    await hub.js.add_stream(StreamConfig(name="BIG", subjects=["fleet.d9.>"], allow_direct=True))
    payloads = [bytes([i]) * 900_000 for i in range(40)]
    for payload in payloads:
        await hub.js.publish("fleet.d9.blob", payload)

    batch = await _read(hub, SeqRange("BIG", 1, 40))

    assert batch.column("hub_seq").to_pylist() == list(range(1, 41))
    assert batch.column("payload").to_pylist() == payloads
    assert set(batch.column("device_id").to_pylist()) == {"d9"}
    assert (await hub.js.stream_info("BIG")).state.consumer_count == 0
