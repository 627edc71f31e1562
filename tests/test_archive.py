"""The archive table read by every analyst tool: after a kill at each commit point, after
compaction, and from a copy."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from hub_ingest.archive import maintenance, table
from hub_ingest.archive.audit import audit_archive
from hub_ingest.core import failpoints
from hub_ingest.core.config import HubConfig, IngestConfig, load_hub_config, parse_hub_config
from hub_ingest.core.errors import ArchiveError
from hub_ingest.ingest.durability import log_entries
from hub_ingest.ingest.sink import BATCH
from hub_ingest.local.fleet import write_hub_toml
from tests.support import archives
from tests.support.cluster import Device, Hub, run_cli
from tests.support.ingest import aggregate_has, ingest_config, run_once
from tests.support.readers import Key, readers
from tests.support.waiting import RESUME_TIMEOUT, eventually


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


@pytest.mark.spark
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


def _keys(config: IngestConfig) -> list[tuple[str, int]]:
    archive = table.load(config)
    assert archive is not None
    rows = archive.scan(selected_fields=("device_id", "device_seq")).to_arrow()
    return list(zip(rows["device_id"].to_pylist(), rows["device_seq"].to_pylist(), strict=True))


def test_compaction_under_a_running_ingest_never_shows_a_day_doubled_or_missing(
    tmp_path: Path,
) -> None:
    """Twelve one-file batches of a day are compacted while more batches of that day keep
    being committed and a reader keeps counting: every count it sees is whole (no key twice,
    never fewer than before); afterwards the day is one file for the compacted part, the
    expiry deletes the replaced files, and every row is there once."""
    config = dataclasses.replace(_config(tmp_path), keep_snapshots=0.0)
    for i in range(12):
        archives.commit(config, archives.readings(f"d{i:02d}", 50, timedelta(minutes=1)))
    stop = threading.Event()
    seen: list[int] = []

    def read() -> None:
        while not stop.is_set():
            keys = _keys(config)
            assert len(keys) == len(set(keys)), "a reader saw rows twice"
            assert not seen or len(keys) >= seen[-1], "a reader saw rows vanish"
            seen.append(len(keys))

    def ingest() -> None:
        for i in range(12, 18):
            archives.commit(config, archives.readings(f"d{i:02d}", 50, timedelta(minutes=1)))

    with ThreadPoolExecutor(2) as pool:
        reader, writer = pool.submit(read), pool.submit(ingest)
        try:
            report = maintenance.compact(config)
            writer.result()
        finally:
            stop.set()
        reader.result()

    assert len(seen) > 1
    (day,) = report.days
    assert day.day == "2026-11-20" and day.files_before >= 12 and day.files_after == 1
    assert sorted(_keys(config)) == [(f"d{i:02d}", s) for i in range(18) for s in range(1, 51)]
    report = maintenance.expire(config, report)
    assert report.snapshots_expired > 0 and report.files_deleted >= 12
    archive = table.load(config)
    assert archive is not None
    on_disk = {f.uri for f in table.list_files(f"{table.location(config.archive)}/data")}
    assert on_disk == set(table.data_files(archive))
    assert sorted(_keys(config)) == [(f"d{i:02d}", s) for i in range(18) for s in range(1, 51)]


def test_a_copied_archive_is_refused_until_relocated_then_reads_its_own_files(
    tmp_path: Path,
) -> None:
    """Iceberg records absolute paths: a copy is refused by name until `hub-ingest relocate`
    points its catalog at its own files; then it reads every row with the original gone."""
    original = _config(tmp_path / "hub")
    archives.commit(original, archives.readings("a", 40, timedelta(minutes=5)))
    archives.commit(original, archives.readings("b", 10, timedelta(hours=1), first_hub_seq=41))
    want = sorted(_keys(original))
    copy_dir = tmp_path / "copy"
    shutil.copytree(tmp_path / "hub", copy_dir)
    hub_toml = copy_dir / "hub.toml"
    hub_toml.write_text(f'state_dir = "{copy_dir}"\n')
    copy = load_hub_config(hub_toml).ingest

    with pytest.raises(ArchiveError, match="hub-ingest relocate"):
        table.load(copy)
    moved = run_cli("hub_ingest", "relocate", "--config", str(hub_toml), "--json")
    assert moved.returncode == 0, moved.stderr
    assert json.loads(moved.stdout)["data_files"] == 2  # a batch of a, one of b
    shutil.rmtree(tmp_path / "hub")

    archive = table.load(copy)
    assert archive is not None
    assert all(f.startswith(f"file://{copy_dir}/") for f in table.data_files(archive))
    assert sorted(_keys(copy)) == want
    assert table.archived(archive) == {"FLEET_TELEMETRY": 50}
    again = run_cli("hub_ingest", "relocate", "--config", str(hub_toml))
    assert again.returncode == 0 and "2 data files" in again.stdout


def _config(state_dir: Path) -> IngestConfig:
    return parse_hub_config({"state_dir": str(state_dir)}).ingest
