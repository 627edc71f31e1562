"""The Spark ingest (``hub-ingest run``): every aggregate stream into the archive table.

Exactly once, across kills and reruns: Spark's checkpoint logs the sequence ranges of a
batch (see `hub_ingest.ingest.source`) before it runs, and a re-run batch reads the same ranges
again; the archive table (`hub_ingest.archive.table`) commits each batch atomically, together with
the highest sequence of each stream it now holds, and `hub_ingest.ingest.sink` writes only the rows
above it. Spark never fsyncs its checkpoint: `hub_ingest.ingest.durability` syncs it after each
batch and repairs what a power cut left of the batches after the last sync.

The order of a micro-batch, each step once, each in one module:

1. **start** (`ingest`, once per run): repair the checkpoint a power cut damaged
   (`durability.repair`), delete files of batches never committed (`sink.remove_unfinished`);
2. **read**: Spark plans the batch's sequence ranges and logs them in its checkpoint; the
   executors read them from the hub (`source`, `wire`);
3. **write** and **commit** (`sink.TableSink`, Spark's ``foreachBatch``): the rows the table
   lacks are written as Parquet and fsynced, then committed as one snapshot with the highest
   sequence of each stream;
4. **acknowledge**: Spark writes the batch's commit entry; `ingest` then fsyncs the batch's
   checkpoint entries (`durability.SyncedBatches.mark`). Nothing is acknowledged to the hub:
   the aggregates keep their messages until step 5 trims them (or their own limits), and
   the next batch starts from the checkpoint;
5. **maintain** (`run`, after a ``--once`` run with ``ingest.compact_after_run``; else
   ``hub-ingest compact``): compact small files and expire old snapshots
   (`archive.maintenance`); with ``ingest.trim_hub`` (the default; else ``hub-ingest
   trim``), purge from the hub's streams what is archived and older than
   ``ingest.keep_on_hub`` (`fleet.trim`), after a ``--once`` run and every `trim_every`
   of a continuous one.

``--once`` runs ``trigger(availableNow=True)``: everything in the streams when it starts, in
batches of at most ``ingest.max_messages_per_trigger``, then exit (for a systemd timer).
Without it the query runs until SIGTERM, one batch every ``ingest.trigger_interval``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import nats.errors
import structlog
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import StructType

from hub_ingest.archive import maintenance
from hub_ingest.archive.table import PARTITION_COLUMN, is_local
from hub_ingest.core.config import HubConfig, IngestConfig
from hub_ingest.core.connect import hub_connection
from hub_ingest.core.errors import ConfigError, DataLossError, IngestError
from hub_ingest.fleet.streams import aggregate_stream_names, made_now
from hub_ingest.ingest.durability import SyncedBatches, only_run, repair
from hub_ingest.ingest.sink import BatchCommit, TableSink, ensure_table, remove_unfinished
from hub_ingest.ingest.source import FORMAT, SCHEMA, JetStreamDataSource

log = structlog.get_logger(__name__)

QUERY_NAME = "hub_ingest"
TRIM_EVERY = 600.0  # seconds between the trims of a continuous run, at most
_BASE_COLUMNS = {*(f.split(" ")[0] for f in SCHEMA.split(", ")), "ingested_at", PARTITION_COLUMN}
# "nats.errors.NoServersError: nats: no servers available": a Python exception line in the
# trace Spark carries over from the data source.
_PY_ERROR = re.compile(r"^([a-z_][\w.]*)\.([A-Z]\w*(?:Error|Exception)): (.+)$")
_DATA_LOSS = re.compile(r"retention removed \d+ messages of (\S+) \(seq (\d+)\.\.(\d+)\)")


@dataclass(frozen=True, slots=True)
class BatchProgress:
    batch_id: int
    rows: int
    seconds: float


@dataclass(frozen=True, slots=True)
class IngestSummary:
    batches: tuple[BatchProgress, ...]
    commits: tuple[BatchCommit, ...]
    seconds: float

    @property
    def rows(self) -> int:
        return sum(b.rows for b in self.batches)


def spark_session(master: str | None) -> SparkSession:
    """A session with the ``jetstream`` format registered; the caller stops it.

    `master` None: the one spark-submit was given (the session joins the JVM it started).
    """
    # Executors run the interpreter at this path (on a cluster: the same venv path on every
    # worker); without nats-py and this package the only error is "Python worker failed to
    # connect back". Under spark-submit, spark.pyspark.python has set it already.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder
    if master is not None:
        builder = builder.master(master)
    if master is not None and master.startswith("local"):
        # Everything runs in this process: keep the driver on loopback, not on whatever
        # address the host name resolves to.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.driver.host", "127.0.0.1").config(
            "spark.driver.bindAddress", "127.0.0.1"
        )
    spark = (
        builder.appName("hub-ingest")
        # Dates of the archive's partitions are UTC dates, wherever the job runs.
        .config("spark.sql.session.timeZone", "UTC")
        # Plain int64 microseconds, not Spark's legacy INT96: what current readers expect, and
        # INT96's dictionary encoding of unique times was the writer's largest cost.
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")  # progress is logged per batch
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")  # the JVM's own warnings, no chatter
    spark.dataSource.register(JetStreamDataSource)
    return spark


async def aggregate_streams(config: HubConfig) -> list[str]:
    async with hub_connection(config, name="hub-ingest-job") as nc:
        streams = await aggregate_stream_names(nc.jetstream(domain=config.nats.domain))
    if not streams:
        raise IngestError("no aggregate streams on the hub: run `hub-ingest provision` first")
    return streams


def archive_rows(spark: SparkSession, config: HubConfig, streams: list[str]) -> DataFrame:
    """The streaming DataFrame of archive rows, as they are written."""
    ingest = config.ingest
    reader = (
        spark.readStream.format(FORMAT)
        .option("servers", ",".join(config.nats.servers))
        .option("streams", ",".join(streams))
        .option("domain", config.nats.domain)
        .option("maxMessagesPerTrigger", str(ingest.max_messages_per_trigger))
        .option("messagesPerPartition", str(ingest.messages_per_partition))
        # Executor cores (spark.default.parallelism when set): a small batch is cut so that
        # every core reads a share of it.
        .option("minPartitions", str(spark.sparkContext.defaultParallelism))
        .option("failOnDataLoss", str(ingest.fail_on_data_loss).lower())
        .option("clockTolerance", str(ingest.clock_tolerance))
    )
    if config.nats.credentials is not None:
        # Opened on every executor, whose working directory is its worker's, not ours.
        reader = reader.option("credentials", str(config.nats.credentials.absolute()))
    rows = reader.load().withColumn("ingested_at", F.current_timestamp())
    if ingest.payload_schema:
        typed = _payload_schema(ingest.payload_schema)
        parsed = F.from_json(F.col("payload").cast("string"), typed)
        rows = rows.select("*", *(parsed[f.name].alias(f.name) for f in typed.fields))
    # A reading buffered offline for days belongs to the day the device stored it, unless the
    # device's clock is not to be trusted.
    stored = F.when(F.col("device_time_suspect"), F.lit(None)).otherwise(F.col("device_time"))
    day = F.to_date(F.coalesce(stored, F.col("hub_time")))
    return rows.withColumn(PARTITION_COLUMN, day)


async def _made(config: HubConfig, streams: list[str]) -> dict[str, str]:
    async with hub_connection(config, name="hub-ingest-job") as nc:
        return await made_now(nc.jetstream(domain=config.nats.domain), streams)


def _payload_schema(ddl: str) -> StructType:
    try:
        schema = StructType.fromDDL(ddl)
    except Exception as exc:
        raise ConfigError(f"ingest.payload_schema: not a Spark schema: {ddl!r} ({exc})") from None
    if not isinstance(schema, StructType):
        raise ConfigError(f"ingest.payload_schema: expected named fields, got {ddl!r}")
    clash = sorted(_BASE_COLUMNS.intersection(f.name for f in schema.fields))
    if clash:
        raise ConfigError(f"ingest.payload_schema: {clash[0]!r} is already an archive column")
    return schema


def start_query(
    spark: SparkSession, config: HubConfig, streams: list[str], sink: TableSink, *, once: bool
) -> StreamingQuery:
    rows = archive_rows(spark, config, streams)
    ensure_table(config.ingest, rows.schema)
    writer = (
        rows.writeStream.foreachBatch(sink)
        .queryName(QUERY_NAME)
        .option("checkpointLocation", str(config.ingest.checkpoint))
        .outputMode("append")
    )
    if once:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{config.ingest.trigger_interval} seconds")
    return writer.start()


def ingest(
    spark: SparkSession,
    config: HubConfig,
    *,
    once: bool,
    stop: threading.Event | None = None,
    progress: TextIO | None = None,
) -> IngestSummary:
    """Run the ingest query until it is done (`once`) or `stop` is set; log every batch, and
    keep a progress line on `progress` (a terminal) while batches run."""
    streams = asyncio.run(aggregate_streams(config))
    started = time.monotonic()
    ing = config.ingest
    _refuse_parquet_archive(ing.archive)
    repair(ing.checkpoint)  # what a power cut may have left of the last batches
    remove_unfinished(ing)
    synced = SyncedBatches.load(ing.checkpoint)
    sink = TableSink(ing, lambda: asyncio.run(_made(config, streams)))
    query = start_query(spark, config, streams, sink, once=once)
    log.info("ingest_started", streams=streams, once=once, archive=str(config.ingest.archive))
    batches: list[BatchProgress] = []
    last_trigger = ""
    lag = 0
    trimmed = time.monotonic()

    def collect() -> None:
        nonlocal last_trigger, lag
        # An idle trigger reports the next batch's id with no rows; its start time is unique.
        for made in query.recentProgress:
            if made.timestamp > last_trigger:
                last_trigger = made.timestamp
                lag = _lag(made)
                if made.numInputRows:
                    batches.append(_log_progress(made))
                    synced.mark(made.batchId)

    try:
        while query.isActive and not (stop is not None and stop.is_set()):
            query.awaitTermination(1)
            collect()
            if not once and ing.trim_hub and time.monotonic() - trimmed >= trim_every(ing):
                trim(config)
                trimmed = time.monotonic()
            if progress is not None:
                progress.write("\r" + _progress_line(spark, batches, started, lag) + "\033[K")
                progress.flush()
        query.stop()  # a no-op once an availableNow query has finished
        collect()
        if progress is not None:
            progress.write("\r" + _progress_line(spark, batches, started, lag) + "\033[K\n")
    except StreamingQueryException as exc:
        raise _translate(exc) from None
    failure = query.exception()
    if failure is not None:
        raise _translate(failure)
    summary = IngestSummary(
        tuple(batches), tuple(sink.commits), round(time.monotonic() - started, 3)
    )
    log.info("ingest_finished", batches=len(batches), rows=summary.rows, seconds=summary.seconds)
    return summary


def trim_every(ing: IngestConfig) -> float:
    """Seconds between the trims of a continuous run: ten minutes, or a tenth of what the hub
    keeps when that is shorter."""
    return min(TRIM_EVERY, ing.keep_on_hub / 10)


def trim(config: HubConfig) -> None:
    """The hub's streams trimmed of what the archive holds (`maintenance.trim`); a failure is
    logged, and the next trim tries again: the archive is whole either way."""
    try:
        asyncio.run(maintenance.trim(config))
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning("hub_trim_failed", error=repr(exc))


def _refuse_parquet_archive(archive: Path) -> None:
    if is_local(archive) and (archive / "_spark_metadata").is_dir():
        raise IngestError(
            f"ingest.archive ({archive}) holds the plain Parquet archive of an earlier hub-ingest; "
            "point ingest.archive at a new directory (the old one stays readable with "
            "spark.read.parquet), see the README's upgrade note"
        )


def run(config: HubConfig, *, once: bool, master: str | None, stop: threading.Event) -> int:
    """`master`: ``run --master``; without it spark-submit's, or else ``ingest.master``.
    One run a checkpoint at a time (`only_run`), from before Spark starts to after the
    compaction."""
    with only_run(config.ingest.checkpoint):
        spark = spark_session(master or (None if under_spark_submit() else config.ingest.master))
        try:
            # A progress line on a terminal; the journal gets the JSON lines alone.
            progress = sys.stderr if sys.stderr.isatty() else None
            ingest(spark, config, once=once, stop=stop, progress=progress)
        finally:
            spark.stop()
        if once and config.ingest.compact_after_run:
            maintenance.expire(config.ingest, maintenance.compact(config.ingest))
        if once and config.ingest.trim_hub:
            trim(config)
    return 0


def under_spark_submit() -> bool:
    """Whether spark-submit started this Python, for its JVM (which then holds its --master
    and --conf): it hands the JVM's gateway over in the environment."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def _lag(progress: Any) -> int:
    """Messages the streams held beyond what the batch read."""
    lag = 0
    for source in progress.sources:
        end, latest = _offset(source.endOffset), _offset(source.latestOffset)
        lag += sum(
            max(seq - end.get(name, 0), 0) for name, seq in latest.items() if isinstance(seq, int)
        )
    return lag


def _progress_line(
    spark: SparkSession, batches: list[BatchProgress], started: float, lag: int
) -> str:
    """Rows so far, their rate and the lag, and how far the running batch's tasks are."""
    tracker = spark.sparkContext.statusTracker()
    done = total = 0
    for stage_id in tracker.getActiveStageIds():
        if (stage := tracker.getStageInfo(stage_id)) is not None:
            done, total = done + stage.numCompletedTasks, total + stage.numTasks
    rows = sum(b.rows for b in batches)
    rate = rows / max(time.monotonic() - started, 1e-3)
    running = f"batch running: {done}/{total} tasks" if total else "waiting for the next batch"
    return (
        f"{rows:,} rows archived in {len(batches)} batches ({rate:,.0f} rows/s), "
        f"lag {lag:,} messages; {running}"
    )


def _log_progress(progress: Any) -> BatchProgress:
    lag = _lag(progress)
    batch = BatchProgress(
        progress.batchId, progress.numInputRows, progress.durationMs["triggerExecution"] / 1000
    )
    log.info(
        "batch_archived",
        batch_id=batch.batch_id,
        rows=batch.rows,
        rows_per_s=round(progress.processedRowsPerSecond or 0.0, 1),
        lag_messages=lag,
        seconds=batch.seconds,
    )
    return batch


def _offset(raw: str | None) -> dict[str, Any]:
    value = json.loads(raw) if raw else None
    return value if isinstance(value, dict) else {}


def _translate(exc: Exception) -> IngestError:
    """The query's failure, as our own error, in one line: Spark wraps the cause (say, the hub
    gone: `nats: no servers available`) in hundreds of lines of Python and JVM trace."""
    text = str(exc)
    found = _DATA_LOSS.search(text)
    if found:
        return DataLossError(found[1], int(found[2]), int(found[3]))
    causes = [m for m in map(_PY_ERROR.match, text.splitlines()) if m and not _wrapper(m[1])]
    if causes:
        return IngestError(f"ingest query failed: {causes[-1][2]}: {causes[-1][3]}")
    first = next((line for line in text.splitlines() if line.strip()), type(exc).__name__)
    return IngestError(f"ingest query failed: {first}")


def _wrapper(module: str) -> bool:
    return module.startswith(("org.", "java.", "scala.", "py4j", "pyspark"))
