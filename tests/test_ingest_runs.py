"""Two ingest runs at once on one hub: the timer's and one started by hand. Both planned the
same batches from one checkpoint and both committed them: 500 readings archived twice (and
Spark failed one run half way). A second run is now refused, and a commit that lost a race
to another writer fails instead of being applied again on top of it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hub_ingest.archive import table
from hub_ingest.archive.audit import audit_archive
from hub_ingest.core.errors import ArchiveError, IngestError
from hub_ingest.ingest.durability import only_run
from hub_ingest.local.fleet import loopback_hub_config, write_hub_toml
from tests.support.cluster import Hub
from tests.support.ingest import aggregate_has, ingest_config
from tests.support.waiting import eventually

READINGS = 2000


def _file(config_archive: Path, name: str, seqs: range) -> str:
    rows = pa.table(
        {
            "hub_stream": ["FLEET_TELEMETRY"] * len(seqs),
            "hub_seq": pa.array(seqs, pa.int64()),
            "date": pa.array([pa.scalar(0, pa.date32()).as_py()] * len(seqs), pa.date32()),
        }
    )
    path = config_archive / "data" / name / "part-0.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(rows, path)
    return f"file://{path}"


def test_a_commit_that_lost_a_race_archives_nothing_twice(tmp_path: Path) -> None:
    """pyiceberg applies a commit that lost a race again on top of the winner's (four times
    by default): the batch's files were added twice and the archived sequence went back."""
    config = loopback_hub_config(tmp_path).ingest
    mine, theirs = _file(config.archive, "a", range(1, 4)), _file(config.archive, "b", range(1, 4))
    schema = pq.read_schema(mine.removeprefix("file://"))
    archive = table.create_or_evolve(config, schema)
    with archive.transaction() as tx:  # as a table made before 2026-12-02
        tx.remove_properties(*table.NO_RETRIES)
    archive = table.create_or_evolve(config, schema)
    other = table.load(config)  # read before the first commit, as another run's batch did
    assert other is not None
    table.commit(archive, [mine], {"FLEET_TELEMETRY": 3}, {}, {})
    with pytest.raises(ArchiveError, match="another hub-ingest run"):
        table.commit(other, [theirs], {"FLEET_TELEMETRY": 2}, {}, {})
    assert table.archived(table.load(config) or other) == {"FLEET_TELEMETRY": 3}
    archived = table.read(config, ["hub_seq"])
    assert archived is not None and sorted(archived["hub_seq"].to_pylist()) == [1, 2, 3]


def test_one_run_a_checkpoint_at_a_time(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    refused = pytest.raises(IngestError, match=r"another hub-ingest run, .* \(pid \d+\)")
    with only_run(checkpoint), refused, only_run(checkpoint):
        pass
    with only_run(checkpoint):  # free again
        pass


@pytest.mark.spark
async def test_two_runs_at_once_archive_every_reading_once(hub: Hub, tmp_path: Path) -> None:
    a = await hub.device("a", heartbeat_interval="1h")
    for i in range(READINGS):
        await a.js.publish("tele.temp", json.dumps({"t": i}).encode())
    await eventually(
        lambda: aggregate_has(hub, "FLEET_TELEMETRY", READINGS), timeout=60, what="readings"
    )
    config = ingest_config(hub, max_messages_per_trigger=500, messages_per_partition=250)
    toml = write_hub_toml(config, tmp_path / "hub.toml")
    run = [sys.executable, "-m", "hub_ingest", "run", "--once", "--config", str(toml)]
    runs = [
        subprocess.Popen(run, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    ended = [await asyncio.to_thread(r.communicate, timeout=600) for r in runs]
    codes = sorted(r.returncode for r in runs)
    assert codes == [0, 1], ended
    refused = next(err for r, (_, err) in zip(runs, ended, strict=True) if r.returncode)
    assert "another hub-ingest run" in refused, refused
    (device,) = [
        d for d in audit_archive(config.ingest).devices if d.hub_stream == "FLEET_TELEMETRY"
    ]
    assert (device.rows, device.duplicates, device.missing) == (READINGS, 0, ())
