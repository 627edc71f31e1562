"""Helpers for ingest tests: a hub config pointing at a test archive, and reading it back."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
from pyspark.sql import SparkSession

from hub_ingest.audit import read_archive
from hub_ingest.config import HubConfig
from hub_ingest.job import IngestSummary, ingest
from tests.support.cluster import Hub


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
    table = read_archive(config.ingest.archive, filter=ds.field("subject").isin(["tele.temp"]))
    assert table is not None, "nothing archived"
    return table.sort_by([("device_id", "ascending"), ("device_seq", "ascending")])


async def aggregate_has(hub: Hub, stream: str, count: int) -> bool:
    return (await hub.js.stream_info(stream)).state.messages >= count
