"""The ingest job against real servers and local Spark: exactly once, across cuts and reruns."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from hub_ingest.archive.audit import audit_archive
from hub_ingest.ingest.durability import MARKER
from hub_ingest.ingest.job import _translate
from hub_ingest.local.fleet import write_hub_toml
from tests.support.cluster import Hub
from tests.support.ingest import aggregate_has, ingest_config, row_count, run_once, telemetry
from tests.support.waiting import RESUME_TIMEOUT, eventually

pytestmark = pytest.mark.spark


async def test_two_devices_and_a_cut_link_archived_once_with_device_time(
    hub: Hub, spark: SparkSession
) -> None:
    """Readings from two devices, some buffered while A's link was cut, land once each with
    the right device, device sequence and subject; buffered ones keep their device time."""
    a = await hub.device("a")
    b = await hub.device("b")
    for i in range(5):
        await a.js.publish("tele.temp", f'{{"t": {i}}}'.encode())
        await b.js.publish("tele.temp", f'{{"t": {i}}}'.encode())
    a.proxy.cut()
    await a.wait_link(up=False)
    for i in range(5, 25):
        await a.js.publish("tele.temp", f'{{"t": {i}}}'.encode())
    cut_over = datetime.now(UTC)
    a.proxy.restore()
    await eventually(
        lambda: aggregate_has(hub, "FLEET_TELEMETRY", 30), timeout=RESUME_TIMEOUT, what="30 rows"
    )
    config = ingest_config(hub, payload_schema="t INT")
    await run_once(spark, config)

    rows = telemetry(config).to_pylist()
    assert [(r["device_id"], r["device_seq"]) for r in rows] == [
        *(("a", seq) for seq in range(1, 26)),
        *(("b", seq) for seq in range(1, 6)),
    ]
    assert {r["subject"] for r in rows} == {"tele.temp"}
    assert {r["hub_stream"] for r in rows} == {"FLEET_TELEMETRY"}
    assert [r["payload"] for r in rows if r["device_id"] == "a"] == [
        f'{{"t": {i}}}'.encode() for i in range(25)
    ]
    assert [r["t"] for r in rows] == [*range(25), *range(5)]  # typed from the JSON payload
    buffered = [r for r in rows if r["device_id"] == "a" and r["device_seq"] > 5]
    assert all(r["device_time"] < cut_over < r["hub_time"] for r in buffered)
    assert all(r["device_time"] <= r["hub_time"] for r in rows)
    assert all(str(r["date"]) == r["device_time"].date().isoformat() for r in rows)
    sources = [dict(r["headers"])["Nats-Stream-Source"].split() for r in rows]
    assert [int(s[1]) for s in sources] == [r["device_seq"] for r in rows]
    assert audit_archive(config.ingest).ok


async def test_rerun_adds_nothing_then_exactly_the_new_rows(hub: Hub, spark: SparkSession) -> None:
    """A second run with nothing new writes nothing; after more readings, only those."""
    a = await hub.device("a", heartbeat_interval="1h")
    for i in range(10):
        await a.js.publish("tele.temp", str(i).encode())
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 10), timeout=RESUME_TIMEOUT)
    await eventually(lambda: aggregate_has(hub, "FLEET_EVENTS", 1), timeout=RESUME_TIMEOUT)
    config = ingest_config(hub)
    first = await run_once(spark, config)
    archived = row_count(config)
    assert first.rows == archived == 11  # ten readings and the agent's first heartbeat

    again = await run_once(spark, config)
    assert again.rows == 0
    assert row_count(config) == 11

    for i in range(10, 17):
        await a.js.publish("tele.temp", str(i).encode())
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 17), timeout=RESUME_TIMEOUT)
    third = await run_once(spark, config)
    assert third.rows == 7
    assert [r["device_seq"] for r in telemetry(config).to_pylist()] == list(range(1, 18))


async def test_sigkill_mid_batch_then_rerun_loses_and_duplicates_nothing(
    hub: Hub, spark: SparkSession, tmp_path: Path
) -> None:
    """`hub-ingest run --once` killed with SIGKILL while a batch is being written, then run
    again: every reading is archived exactly once."""
    a = await hub.device("a", heartbeat_interval="1h")
    total = 3000
    for i in range(total):
        await a.js.publish("tele.temp", str(i).encode())
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", total), timeout=RESUME_TIMEOUT)
    config = ingest_config(hub, max_messages_per_trigger=300, messages_per_partition=150)
    path = write_hub_toml(config, tmp_path / "hub.toml")
    job = subprocess.Popen(
        [sys.executable, "-m", "hub_ingest", "run", "--config", str(path), "--once"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    offsets, commits = config.ingest.checkpoint / "offsets", config.ingest.checkpoint / "commits"

    async def mid_batch() -> bool:
        # A batch's offsets are logged before it runs and its commit after: in between, it
        # is being read and written.
        started = {p.name for p in offsets.glob("[0-9]*")} if offsets.exists() else set()
        done = {p.name for p in commits.glob("[0-9]*")} if commits.exists() else set()
        return len(done) >= 2 and bool(started - done)

    try:
        await eventually(mid_batch, timeout=120, interval=0.05, what="a batch in flight")
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    partial = row_count(config)
    assert 0 < partial < total

    await run_once(spark, config)
    rows = telemetry(config)
    seqs = [r["device_seq"] for r in rows.select(["device_seq"]).to_pylist()]
    assert len(seqs) == len(set(seqs)) == total
    assert sorted(seqs) == list(range(1, total + 1))
    assert audit_archive(config.ingest).ok


def test_a_failed_query_is_one_line_with_its_cause() -> None:
    """Spark's wrapping of a source that lost the hub comes down to the cause itself."""
    trace = "\n".join(
        [
            "[STREAM_FAILED] Query [id = 1] terminated with exception: Failed when Python "
            "streaming data source perform latestOffset: Traceback (most recent call last):",
            '  File "/x/hub_ingest/ingest/source.py", line 260, in _connect',
            "    await nc.connect(",
            "nats.errors.NoServersError: nats: no servers available",
            "\tat org.apache.spark.sql.execution.python.PythonStreamingSourceRunner.fail(x)",
            "org.apache.spark.SparkException: Python worker failed",
            *(f"\tat frame{i}" for i in range(300)),
        ]
    )
    error = _translate(RuntimeError(trace))
    assert str(error) == "ingest query failed: NoServersError: nats: no servers available"


async def test_a_checkpoint_a_power_cut_emptied_is_repaired_and_nothing_is_lost(
    hub: Hub, spark: SparkSession
) -> None:
    """What a power cut leaves of the batches after the last sync (their log entries empty
    behind their names) while the table had committed them: the next run rolls them back,
    plans them again, and the archive has every reading once."""
    a = await hub.device("a", heartbeat_interval="1h")
    for i in range(60):
        await a.js.publish("tele.temp", str(i).encode())
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 60), timeout=RESUME_TIMEOUT)
    config = ingest_config(hub, max_messages_per_trigger=20, messages_per_partition=10)
    await run_once(spark, config)
    checkpoint = config.ingest.checkpoint
    last = json.loads((checkpoint / MARKER).read_text())["batch"]
    assert last >= 2
    # The last two batches never reached the disk; the marker still says they did not.
    (checkpoint / MARKER).write_text(json.dumps({"batch": last - 2}))
    emptied = [checkpoint / "offsets" / str(last - 1), checkpoint / "commits" / str(last)]
    for path in emptied:
        path.write_bytes(b"")

    await run_once(spark, config)

    assert [r["device_seq"] for r in telemetry(config).to_pylist()] == list(range(1, 61))
    assert audit_archive(config.ingest).ok


async def test_a_first_batch_a_cut_or_kill_interrupted_does_not_block_the_start(
    hub: Hub, spark: SparkSession
) -> None:
    """What a power cut left in a power-cut run before any batch finished: an empty
    ``metadata`` with an empty checksum beside it, and the temporary file of the first
    offsets write. Spark alone refuses to start beside that temporary file."""
    a = await hub.device("a", heartbeat_interval="1h")
    for i in range(30):
        await a.js.publish("tele.temp", str(i).encode())
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 30), timeout=RESUME_TIMEOUT)
    config = ingest_config(hub)
    checkpoint = config.ingest.checkpoint
    (checkpoint / "offsets").mkdir(parents=True)
    (checkpoint / "commits").mkdir()
    for left in ("metadata", ".metadata.crc", "offsets/.0.c500b990-69f6-4da3.tmp"):
        (checkpoint / left).write_bytes(b"")

    await run_once(spark, config)

    assert [r["device_seq"] for r in telemetry(config).to_pylist()] == list(range(1, 31))


async def test_run_on_a_terminal_shows_progress_and_keeps_json_lines_on_stdout(
    hub: Hub, tmp_path: Path
) -> None:
    """`hub-ingest run` with a terminal on stderr keeps one progress line there (rows so far,
    rate, lag, the running batch's tasks); stdout, the journal's, stays JSON lines."""
    a = await hub.device("a", heartbeat_interval="1h")
    for i in range(600):
        await a.js.publish("tele.temp", str(i).encode())
    await eventually(lambda: aggregate_has(hub, "FLEET_TELEMETRY", 600), timeout=RESUME_TIMEOUT)
    config = ingest_config(hub, max_messages_per_trigger=200, messages_per_partition=100)
    path = write_hub_toml(config, tmp_path / "hub.toml")
    terminal, tty = pty.openpty()
    try:
        job = subprocess.Popen(
            [sys.executable, "-m", "hub_ingest", "run", "--config", str(path), "--once"],
            stdout=subprocess.PIPE,
            stderr=tty,
        )
        os.close(tty)
        shown = await asyncio.to_thread(_read_all, terminal)
        out, _ = job.communicate(timeout=60)
    finally:
        os.close(terminal)
    assert job.returncode == 0, shown
    lines = [line for line in out.decode().splitlines() if line.strip()]
    events = [json.loads(line)["event"] for line in lines]
    assert events.count("batch_archived") >= 3
    final = [part for part in shown.split("\r") if part.strip()][-1]
    archived = int(final.split(" rows archived in")[0].replace(",", ""))
    assert archived >= 600 and "lag 0 messages" in final, shown[-500:]  # and a heartbeat
    assert "batch running:" in shown  # seen while a batch ran


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the other end closed: the job is done
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")
