"""The ingest on a real Spark standalone cluster (a master and two one-core workers on
loopback), as spark-submit and ``hub-ingest run --master`` start it: batches spread over the
workers, and a worker killed in the middle of a batch costs nothing but a retry."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import hub_ingest
from hub_ingest.archive import table
from hub_ingest.archive.audit import audit_archive, backlog
from hub_ingest.core import failpoints
from hub_ingest.core.config import HubConfig
from hub_ingest.fleet.streams import aggregate_stream_names
from hub_ingest.local.fleet import write_hub_toml
from tests.support.cluster import Device, Hub, start_hub
from tests.support.ingest import ingest_config
from tests.support.sparkcluster import SPARK_HOME, AppEvents, DriverRun, SparkCluster, spark_cluster
from tests.support.waiting import RESUME_TIMEOUT, eventually

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.alone]

READINGS = 300  # per device and run
PARTITION = 40  # messages per partition: about 16 tasks a run, two at a time
DRIVER_TIMEOUT = 150
Row = tuple[str, str, int]  # device_id, hub_stream, hub_seq


@pytest.fixture
async def sharded_hub(tmp_path: Path) -> AsyncIterator[Hub]:
    """A hub with one device per aggregate shard: every batch reads several streams."""
    hub = await start_hub(tmp_path, max_sources_per_stream=1)
    try:
        yield hub
    finally:
        await hub.close()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[SparkCluster]:
    async with spark_cluster(tmp_path / "spark") as started:
        yield started


async def _publish(hub: Hub, devices: list[Device], first: int) -> None:
    for device in devices:
        for i in range(first, first + READINGS):
            await device.js.publish("tele.temp", json.dumps({"t": i}).encode())
    want = first + READINGS - 1

    async def sourced() -> bool:
        streams = [s for s in await aggregate_stream_names(hub.js) if "TELEMETRY" in s]
        counts = [(await hub.js.stream_info(s)).state.messages for s in streams]
        return len(counts) == len(devices) and all(n == want for n in counts)

    await eventually(sourced, timeout=RESUME_TIMEOUT, what=f"{want} readings in every shard")


async def _hub_rows(hub: Hub) -> Counter[Row]:
    """Every message of every aggregate stream, as the archive must hold it."""
    rows: Counter[Row] = Counter()
    for stream in await aggregate_stream_names(hub.js):
        for msg in await hub.aggregate_messages(stream):
            assert msg.subject is not None and msg.seq is not None
            rows[(msg.subject.split(".")[1], stream, msg.seq)] += 1
    return rows


def _archived_rows(config: HubConfig) -> Counter[Row]:
    rows = table.read(config.ingest, ["device_id", "hub_stream", "hub_seq"])
    assert rows is not None, "nothing archived"
    cols = (rows[c].to_pylist() for c in ("device_id", "hub_stream", "hub_seq"))
    return Counter(zip(*cols, strict=True))


async def _assert_archived_exactly_once(hub: Hub, config: HubConfig) -> None:
    want, got = await _hub_rows(hub), _archived_rows(config)
    assert not [row for row, n in got.items() if n > 1], "rows archived twice"
    assert sorted(want - got) == [], "rows of the hub missing from the archive"
    assert sorted(got - want) == [], "archived rows the hub never had"
    report = audit_archive(config.ingest)
    assert report.ok, report.to_dict()
    assert len(report.devices) == 2 * 2  # a and b, in a telemetry and an events shard each
    streams = await backlog(hub.js, config.ingest, await aggregate_stream_names(hub.js))
    assert [s.unarchived for s in streams] == [0] * len(streams), streams


def _batches(cluster: SparkCluster, events: AppEvents) -> dict[int, set[str]]:
    """The workers that completed tasks, per streaming batch."""
    ran: dict[int, set[str]] = {}
    for task in events.tasks:
        if task.reason == "Success" and task.stage in events.stage_batch:
            worker = cluster.worker_of(events, task.executor)
            ran.setdefault(events.stage_batch[task.stage], set()).add(worker)
    return ran


def _driver_failed(run: DriverRun) -> str:
    return f"driver exit {run.returncode}\n{run.stderr[-4000:]}"


async def test_ingest_on_a_cluster_spreads_batches_and_survives_a_worker_killed_mid_batch(
    sharded_hub: Hub, cluster: SparkCluster, tmp_path: Path
) -> None:
    """spark-submit runs the ingest on two workers: the batch's tasks run on both. Then
    worker "a" is started again armed with the ``mid_write`` fail point, and ``hub-ingest run
    --master`` archives the next readings: the moment an executor of "a" starts reading, the
    whole worker dies (SIGKILL: its JVM, its executor's JVM, their Python workers); the
    tasks it had are retried on "b" and every message of the hub is archived exactly once.
    The driver runs in a directory of its own, with the credentials named relative to it:
    the executors (in their workers' work directories) read what the driver means."""
    hub = sharded_hub
    devices = [await hub.device(d, heartbeat_interval="1h") for d in ("a", "b")]
    driver = tmp_path / "driver"
    driver.mkdir()
    config = ingest_config(hub, max_messages_per_trigger=100_000, messages_per_partition=PARTITION)
    seed = Path(os.path.relpath(config.nats.credentials, driver))
    config = dataclasses.replace(config, nats=dataclasses.replace(config.nats, credentials=seed))
    toml = write_hub_toml(config, tmp_path / "hub.toml")
    absolute = dataclasses.replace(config, nats=hub.config.nats)  # what this process reads

    await _publish(hub, devices, 1)
    submitted = await cluster.run_driver(
        [
            str(SPARK_HOME / "bin" / "spark-submit"),
            *("--master", cluster.url, "--conf", f"spark.pyspark.python={sys.executable}"),
            str(Path(hub_ingest.__file__).parent / "__main__.py"),
            *("run", "--once", "--config", str(toml)),
        ],
        driver,
        env=cluster.driver_env(),
        timeout=DRIVER_TIMEOUT,
    )
    assert submitted.returncode == 0, _driver_failed(submitted)
    (first_log,) = cluster.event_logs()
    spread = _batches(cluster, AppEvents.read(first_log))
    assert spread and all(workers == {"a", "b"} for workers in spread.values()), spread
    await _assert_archived_exactly_once(hub, absolute)

    cluster.workers["a"].kill()
    doomed = cluster.start_worker("a", env={failpoints.VARIABLE: "mid_write"})
    await cluster.wait_workers()
    await _publish(hub, devices, READINGS + 1)
    run = await cluster.run_driver(
        [
            str(Path(sys.executable).parent / "hub-ingest"),
            *("run", "--once", "--master", cluster.url, "--config", str(toml)),
        ],
        driver,
        env=cluster.driver_env(),
        timeout=DRIVER_TIMEOUT,
    )
    assert run.returncode == 0, _driver_failed(run)
    assert doomed.process.wait(timeout=30) == -signal.SIGKILL, "worker a was not killed"

    (second_log,) = (p for p in cluster.event_logs() if p != first_log)
    events = AppEvents.read(second_log)
    lost = [t for t in events.tasks if t.reason == "ExecutorLostFailure"]
    assert lost, "no task was lost with worker a: the kill did not land mid-batch"
    assert {cluster.worker_of(events, t.executor) for t in lost} == {"a"}
    assert all(t.stage in events.stage_batch for t in lost), "lost outside a batch"
    retried = []
    for task in lost:
        again = [t for t in events.tasks if (t.stage, t.index) == (task.stage, task.index)]
        assert [t.reason for t in again][-1] == "Success", again
        assert cluster.worker_of(events, again[-1].executor) == "b", again
        retried.append(again[-1])
    lost_at = min(t.finished_ms for t in lost)
    print(
        f"worker a killed mid-batch: tasks lost: {len(lost)}, the loss seen "
        f"{(lost_at - min(t.launched_ms for t in lost)) / 1000:.1f} s after the task started, "
        "retried on b within "
        f"{(max(t.finished_ms for t in retried) - lost_at) / 1000:.1f} s, "
        f"the batch done {(max(events.job_end_ms) - lost_at) / 1000:.1f} s after the loss"
    )
    await _assert_archived_exactly_once(hub, absolute)
