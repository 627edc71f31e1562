"""The archive table read by every analyst tool: after a kill at each commit point, after
compaction, and from a copy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from hub_ingest import failpoints, table
from hub_ingest.audit import audit_archive
from hub_ingest.config import HubConfig
from hub_ingest.durability import log_entries
from hub_ingest.localfleet import write_hub_toml
from hub_ingest.sink import BATCH
from tests.support.cluster import Device, Hub
from tests.support.ingest import aggregate_has, ingest_config, run_once
from tests.support.readers import Key, readers
from tests.support.waiting import RESUME_TIMEOUT, eventually

pytestmark = pytest.mark.spark


async def _publish(device: Device, hub: Hub, first: int, count: int) -> int:
    for i in range(first, first + count):
        await device.js.publish("tele.temp", str(i).encode())
    last = first + count - 1
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", last), timeout=RESUME_TIMEOUT)
    return last


def _killed_run(config: HubConfig, toml: Path, point: str) -> None:
    """`hub-ingest run --once` with a fail point: it must die of SIGKILL there."""
    done = subprocess.run(
        [sys.executable, "-m", "hub_ingest", "run", "--config", str(toml), "--once"],
        env={**os.environ, failpoints.VARIABLE: point},
        start_new_session=True,  # the fail point kills the ingest's whole session
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, f"{point}: exit {done.returncode}\n{done.stderr}"


def _uncommitted_dirs(config: HubConfig) -> set[str]:
    current = table.load(config.ingest)
    listed = set(table.data_files(current)) if current else set()
    dirs = table.list_dirs(f"{table.location(config.ingest.archive)}/data")
    return {d for d in dirs if not any(f.startswith(d + "/") for f in listed)}


def _telemetry(keys: list[Key]) -> list[int]:
    return sorted(seq for _, stream, seq in keys if stream == "FLEET_TELEMETRY")


async def test_a_kill_at_each_commit_point_leaves_every_reader_the_committed_rows(
    hub: Hub, spark: SparkSession, tmp_path: Path
) -> None:
    """SIGKILL before a batch's write, in the middle of it, between write and commit, and
    after the commit but before Spark's: each time pyarrow, pandas, Polars, DuckDB and Spark
    see exactly the committed rows; the next run archives every reading exactly once."""
    a = await hub.device("a", heartbeat_interval="1h")
    config = ingest_config(hub, max_messages_per_trigger=60, messages_per_partition=20)
    toml = write_hub_toml(config, tmp_path / "hub.toml")
    tools = readers(spark)
    published = 0
    for point in failpoints.POINTS:
        published = await _publish(a, hub, published + 1, 150)
        _killed_run(config, toml, point)
        archive = table.load(config.ingest)
        committed = archive.scan(selected_fields=("hub_seq",)).to_arrow().num_rows if archive else 0
        for name, read in tools.items():
            keys = read(archive) if archive else []
            assert len(keys) == committed, f"{point}: {name} read {len(keys)} of {committed}"
            assert not [k for k, n in Counter(keys).items() if n > 1], f"{point}: {name} dups"
        orphans = _uncommitted_dirs(config)
        if point in ("mid_write", "before_commit"):
            assert orphans, f"{point}: the killed batch left no files for readers to ignore"
        if point == "after_commit":
            assert archive is not None
            batch = int(archive.current_snapshot().summary[BATCH])
            commits = [b for b, _ in log_entries(config.ingest.checkpoint / "commits")]
            assert batch not in commits, "Spark recorded the batch: the kill came too late"
        summary = await run_once(spark, config)
        if point == "after_commit":
            assert summary.commits[0].rows == 0, "the committed batch was written again"
        assert not _uncommitted_dirs(config), f"{point}: the rerun left the killed files"

    archive = table.load(config.ingest)
    assert archive is not None
    for name, read in tools.items():
        assert _telemetry(read(archive)) == list(range(1, published + 1)), name
    assert audit_archive(config.ingest).ok
