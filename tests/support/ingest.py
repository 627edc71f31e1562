"""Helpers for ingest tests: a hub config pointing at a test archive, and reading it back."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pyarrow as pa
from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from edge_agent.protocol.pack import PACK_HEADER, PACK_SUBJECT
from hub_ingest.archive import table
from hub_ingest.core.config import HubConfig
from hub_ingest.ingest.job import IngestSummary, ingest
from hub_ingest.local.fleet import stream_messages
from tests.support.cluster import Hub, packed_readings


def ingest_config(hub: Hub, **ingest_overrides: Any) -> HubConfig:
    """The hub's config with small batches, so that tests cross batch and partition edges."""
    settings = {"max_messages_per_trigger": 40, "messages_per_partition": 16, **ingest_overrides}
    return dataclasses.replace(
        hub.config, ingest=dataclasses.replace(hub.config.ingest, **settings)
    )


async def run_once(spark: SparkSession, config: HubConfig) -> IngestSummary:
    """`hub-ingest run --once` in this process, off the event loop the devices run on."""
    return await asyncio.to_thread(ingest, spark, config, once=True)


def telemetry(config: HubConfig) -> pa.Table:
    """Archived telemetry rows, sorted by device and device sequence."""
    rows = table.read(config.ingest, row_filter="subject = 'tele.temp'")
    assert rows is not None, "nothing archived"
    return rows.sort_by([("device_id", "ascending"), ("device_seq", "ascending")])


async def aggregate_has(hub: Hub, stream: str, count: int) -> bool:
    """Whether `stream` holds at least `count` readings, packed (`hub.pack`) or not."""
    return await readings_held(hub.js, stream) >= count


async def readings_held(js: JetStreamContext, stream: str) -> int:
    """The readings `stream` holds: one a message, and a pack's (`hub.pack`) for each pack."""
    info = await js.stream_info(stream, subjects_filter=f"*.*.{PACK_SUBJECT}")
    if not info.state.subjects:
        return info.state.messages
    msgs = await stream_messages(js, stream)
    loose = sum(PACK_HEADER not in (m.headers or {}) for m in msgs)
    return loose + len(packed_readings(msgs))


def row_count(config: HubConfig) -> int:
    """Rows in the archive table's current snapshot."""
    rows = table.read(config.ingest, ["hub_seq"])
    return 0 if rows is None else rows.num_rows
