"""Ingest throughput: the Spark job against a plain nats-py reader on the same sourced messages.

A device publishes `--rows` readings; the hub sources them into ``FLEET_TELEMETRY`` (and
mirrors them, for device times). Then, in one run:

- the ceiling: plain nats-py readers, one process per core, each reading a share of the
  aggregate with batch direct gets and touching every message's subject, headers and data;
- the job: ``hub-ingest run --once`` in this process (session start included in end to end;
  steady state is rows over the summed duration of every batch after the first), into the
  archive table: each batch's write and its commit (fsync and table commit) are printed.

Prints peak driver RSS (this Python process and Spark's JVM), the batches, then one line of
figures.
Run from the repository root: ``.venv/bin/python bench/ingest.py [--rows N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support is not installed

import nats
import structlog
from nats.js import JetStreamContext

from edge_agent.protocol.logs import configure_logging
from hub_ingest.ingest.job import ingest, spark_session
from tests.support.cluster import Hub, start_hub
from tests.support.waiting import eventually

STATE = Path("bench-state/ingest")
STREAM = "FLEET_TELEMETRY"
PAYLOAD = b'{"temp": 21.5, "unit": "C", "sensor": "probe-1", "ok": true}'
log = structlog.get_logger("bench.ingest")


async def fill(rows: int) -> Hub:
    """A hub whose aggregate (and the device's mirror) hold `rows` sourced readings."""
    shutil.rmtree(STATE, ignore_errors=True)
    hub = await start_hub(STATE / "cluster")
    device = await hub.device("a", heartbeat_interval="1h")
    started = time.monotonic()
    window = 1000  # publishes in flight; acks keep the island's ingest queue from overflowing
    for first in range(0, rows, window):
        n = min(window, rows - first)
        await asyncio.gather(*(device.js.publish("tele.x", PAYLOAD) for _ in range(n)))

    async def stored(stream: str, js: JetStreamContext) -> bool:
        return bool((await js.stream_info(stream)).state.messages >= rows)

    await eventually(lambda: stored("TELEMETRY", device.js), timeout=600, interval=1)
    await eventually(lambda: stored(STREAM, hub.js), timeout=1800, interval=1)
    mirror = await hub.mirror("a")
    await eventually(lambda: stored(mirror, hub.js), timeout=1800, interval=1)
    log.info("bench_filled", rows=rows, seconds=round(time.monotonic() - started, 1))
    return hub


async def _read_batch(nc: nats.aio.client.Client, seq: int, last: int) -> list[int]:
    """Sequences of one batch direct get from `seq`, clipped to `last`, via nats-py callbacks."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    got: list[int] = []

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        headers = msg.headers or {}
        if "Nats-Sequence" not in headers:  # the end-of-batch status
            if not done.done():
                done.set_result(None)
            return
        n = int(headers["Nats-Sequence"])
        if n <= last and msg.subject and msg.data is not None:
            got.append(n)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_msg)
    request = {"seq": seq, "batch": min(10_000, last - seq + 1)}
    await nc.publish(f"$JS.API.DIRECT.GET.{STREAM}", json.dumps(request).encode(), inbox)
    await asyncio.wait_for(done, 60)
    await sub.unsubscribe()
    return got


def _read_share(args: tuple[str, str, int, int]) -> int:
    """One core's share of the ceiling: sequences `first`..`last` with plain nats-py."""
    url, seed, first, last = args

    async def read() -> int:
        nc = await nats.connect(url, nkeys_seed=seed, max_reconnect_attempts=0)
        count, seq = 0, first
        while seq <= last and (got := await _read_batch(nc, seq, last)):
            count += len(got)
            seq = got[-1] + 1
        await nc.close()
        return count

    return asyncio.run(read())


def ceiling(hub: Hub, rows: int) -> float:
    cores = os.cpu_count() or 1
    step = -(-rows // cores)
    seed = str(hub.config.nats.credentials)
    shares = [(hub.url, seed, lo, min(lo + step - 1, rows)) for lo in range(1, rows + 1, step)]
    with multiprocessing.get_context("spawn").Pool(cores) as pool:
        started = time.monotonic()
        counts = pool.map(_read_share, shares)
        seconds = time.monotonic() - started
    assert sum(counts) == rows, f"ceiling read {sum(counts)} of {rows}"
    return rows / seconds


def _jvm_peak_rss_mb() -> float:
    """VmHWM of Spark's JVM, a child of this process."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if fields.get("Name", "").strip() == "java" and int(fields["PPid"]) == os.getpid():
            return int(fields["VmHWM"].split()[0]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    configure_logging("info")
    rows: int = args.rows

    loop = asyncio.new_event_loop()
    hub = loop.run_until_complete(fill(rows))
    try:
        ceiling_rate = ceiling(hub, rows)
        log.info("bench_ceiling", rows_per_s=round(ceiling_rate))
        config = replace(
            hub.config,
            ingest=replace(
                hub.config.ingest,
                archive=STATE / "archive",
                checkpoint=STATE / "checkpoint",
                max_messages_per_trigger=max(rows // 5, 1),
                # Two tasks per core in every batch, so that all cores read.
                messages_per_partition=max(rows // 5 // (2 * (os.cpu_count() or 1)), 1),
            ),
        )
        started = time.monotonic()
        spark = spark_session("local[*]")
        # The devices' event loop must keep running while Spark reads: drive it in a thread.
        summary = loop.run_until_complete(asyncio.to_thread(ingest, spark, config, once=True))
        e2e = rows / (time.monotonic() - started)
        jvm_mb = _jvm_peak_rss_mb()
        spark.stop()
    finally:
        loop.run_until_complete(hub.close())
        loop.close()
    assert summary.rows >= rows, f"job archived {summary.rows} of {rows}"
    steady_batches = summary.batches[1:] or summary.batches
    steady = sum(b.rows for b in steady_batches) / sum(b.seconds for b in steady_batches)
    py_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    commits = [c.commit_seconds for c in summary.commits if c.rows] or [0.0]
    print(f"driver_peak_rss_mb python={py_mb:.0f} jvm={jvm_mb:.0f}")
    for c in summary.commits:
        print(
            f"batch {c.batch_id}: {c.rows} rows in {c.files} files, "
            f"write {c.write_seconds:.2f} s, commit {c.commit_seconds:.3f} s"
        )
    print(
        f"rows={rows} e2e_rows_per_s={e2e:.0f} steady_rows_per_s={steady:.0f} "
        f"ceiling_rows_per_s={ceiling_rate:.0f} steady_ratio={steady / ceiling_rate:.2f} "
        f"commit_s_mean={sum(commits) / len(commits):.3f} commit_s_max={max(commits):.3f}"
    )


if __name__ == "__main__":
    main()
