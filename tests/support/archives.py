"""Small archive tables written without Spark, as the ingest commits them."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hub_ingest.archive import table
from hub_ingest.core.config import IngestConfig

START = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)


def readings(device_id: str, count: int, every: timedelta, first_hub_seq: int = 1) -> pa.Table:
    """`count` telemetry rows of `device_id`, one every `every` from `START`."""
    times = [START + i * every for i in range(count)]
    return pa.table(
        {
            "device_id": [device_id] * count,
            "incarnation": ["i1"] * count,
            "subject": ["tele.temp"] * count,
            "device_seq": pa.array(range(1, count + 1), pa.int64()),
            "hub_stream": ["FLEET_TELEMETRY"] * count,
            "hub_seq": pa.array(range(first_hub_seq, first_hub_seq + count), pa.int64()),
            "device_time": pa.array(times, pa.timestamp("us", tz="UTC")),
            "payload": pa.array([b"{}"] * count, pa.binary()),
            "date": pa.array([t.date() for t in times], pa.date32()),
        }
    )


def commit(config: IngestConfig, rows: pa.Table) -> list[str]:
    """`rows` as one committed batch: a file per day under ``data/batch-…/day=…/``."""
    archive = table.create_or_evolve(config, rows.schema)
    batch = config.archive / "data" / f"batch-{uuid.uuid4().hex[:8]}"
    files = []
    for day in pc.unique(rows["date"]).to_pylist():
        part = batch / f"day={day}" / "part-00000.parquet"
        part.parent.mkdir(parents=True)
        pq.write_table(rows.filter(pc.equal(rows["date"], day)), part)
        files.append(f"file://{part}")
    highest = rows.group_by("hub_stream").aggregate([("hub_seq", "max")]).to_pylist()
    table.commit(archive, files, {r["hub_stream"]: r["hub_seq_max"] for r in highest}, {}, {})
    return files
