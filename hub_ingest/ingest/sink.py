"""Each micro-batch into the archive table: executors write the files, the driver commits.

Spark's ``foreachBatch`` calls `TableSink` on the driver with the batch's rows and id. Rows
the table already holds (at or below ``hub-ingest.archived.<stream>``, unless the stream was
made anew since: see `hub_ingest.archive.table`; of a stream made anew, the rows it sourced
again that the table has by key) are dropped, the rest
are written by the executors as Parquet under ``data/batch-<id>-<attempt>/``, fsynced, and
committed as one snapshot that also advances the archived sequences. A kill before the
commit leaves files no snapshot lists (`remove_unfinished` deletes them at the next start);
a kill after it makes Spark run the batch again, which then finds nothing left to write.
"""

from __future__ import annotations

import functools
import operator
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

import pyarrow as pa
import structlog
from pyiceberg.table import Table
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

from hub_ingest.archive import table
from hub_ingest.archive.table import DATA_DIR, PARTITION_COLUMN
from hub_ingest.core import failpoints
from hub_ingest.core.config import IngestConfig
from hub_ingest.core.errors import ArchiveError

log = structlog.get_logger(__name__)

BATCH_PREFIX = "batch-"
BATCH = "hub-ingest.batch"  # in each ingest snapshot's summary: the Spark batch it commits
# A stream made anew sources again what the hub mirrors hold within this long of its making.
RESOURCED_WITHIN = timedelta(hours=1)
_KEY = ["hub_stream", "device_id", "incarnation", "device_seq"]  # a row's, in the archive
# Spark's partitioned writer leaves its partition column out of the files, and Iceberg reads
# the date from inside them: the directories are named after a copy of it.
DIRECTORY_COLUMN = "day"


@dataclass(frozen=True, slots=True)
class BatchCommit:
    batch_id: int
    rows: int  # written by this attempt (0: an earlier attempt had committed them)
    files: int
    write_seconds: float  # Spark's job: read from the hub, write the files
    commit_seconds: float  # fsync of the files and the table commit


def ensure_table(config: IngestConfig, schema: StructType) -> None:
    """Create the archive table for rows of `schema`, or add the columns it lacks."""
    table.create_or_evolve(config, to_arrow_schema(schema, timezone="UTC"))


def remove_unfinished(config: IngestConfig) -> int:
    """Delete the files of batches that were written but never committed (a kill between
    the two); only the ingest writes batch directories, and it has not started yet."""
    current = table.load(config)
    listed = set(table.data_files(current, every_snapshot=True)) if current else set()
    kept = {uri.rsplit("/", 2)[0] for uri in listed}  # …/batch-…/day=…/part-….parquet
    root = f"{table.location(config.archive)}/{DATA_DIR}"
    removed = 0
    for directory in table.list_dirs(root):
        if directory.rsplit("/", 1)[-1].startswith(BATCH_PREFIX) and directory not in kept:
            table.remove_tree(directory)
            removed += 1
    if removed:
        log.warning("unfinished_batches_removed", directories=removed)
    return removed


class TableSink:
    """The ``foreachBatch`` function of the ingest query; `commits` lists what it did."""

    def __init__(self, config: IngestConfig, made: Callable[[], Mapping[str, str]]) -> None:
        self.config = config
        self.made = made  # each aggregate stream's `made_at` on the hub now
        self.commits: list[BatchCommit] = []

    def __call__(self, rows: DataFrame, batch_id: int) -> None:
        failpoints.reach("before_write")
        started = time.monotonic()
        archive = table.load(self.config)
        if archive is None:
            raise ArchiveError(f"the archive table {self.config.table} is gone")
        made = self.made()
        done = table.archived(archive, made)
        fresh = rows.where(_unarchived(done)) if done else rows
        again = table.remade(archive, made)
        if not again:
            self._write(archive, fresh, batch_id, made=made, marks={}, started=started)
            return
        cached = fresh.persist()  # read once from the hub, for the look and the write
        try:
            fresh, within = _without_archived(cached, self.config, again)
            # A stream made anew stays marked while its rows sourced again come (`within`).
            marks = {s: made[s] if s in within else "" for s in again}
            self._write(archive, fresh, batch_id, made=made, marks=marks, started=started)
        finally:
            cached.unpersist()

    def _write(
        self,
        archive: Table,
        fresh: DataFrame,
        batch_id: int,
        *,
        made: Mapping[str, str],
        marks: Mapping[str, str],
        started: float,
    ) -> None:
        out = f"{table.location(self.config.archive)}/{DATA_DIR}/{BATCH_PREFIX}{batch_id:08d}-"
        out += uuid.uuid4().hex[:8]  # an attempt's own directory: a killed one leaves no mix
        directory = fresh.withColumn(DIRECTORY_COLUMN, F.col(PARTITION_COLUMN))
        directory.write.partitionBy(DIRECTORY_COLUMN).parquet(out)
        written = time.monotonic()
        files = [f.uri for f in table.list_files(out)]
        keys = table.read_files(files, ["hub_stream", "hub_seq"])
        if not files or keys.num_rows == 0:
            table.remove_tree(out)
            self._record(BatchCommit(batch_id, 0, 0, round(written - started, 3), 0.0))
            return
        failpoints.reach("before_commit")
        table.sync_files(files)
        seqs = _highest(keys)
        if remade := sorted(s for s in seqs if self.made().get(s) != made.get(s)):
            table.remove_tree(out)
            raise ArchiveError(
                f"{remade[0]} was made anew on the hub while this batch ran: nothing of the "
                "batch was committed; run again"
            )
        marks = {s: mark for s, mark in marks.items() if s in seqs}
        table.commit(archive, files, seqs, {BATCH: str(batch_id)}, made, remade=marks)
        failpoints.reach("after_commit")
        self._record(
            BatchCommit(
                batch_id,
                keys.num_rows,
                len(files),
                round(written - started, 3),
                round(time.monotonic() - written, 3),
            )
        )

    def _record(self, commit: BatchCommit) -> None:
        self.commits.append(commit)
        log.info("batch_committed", **asdict(commit))


def _without_archived(
    fresh: DataFrame, config: IngestConfig, remade: Mapping[str, str]
) -> tuple[DataFrame, set[str]]:
    """`fresh` without the rows of streams made anew (`remade`: when) that the archive holds
    already, by key: a stream made anew sources again all the hub mirrors still hold, rows
    archived from the stream before it among them. Only rows stored within
    `RESOURCED_WITHIN` of its making are looked for; the streams that had such rows."""
    near = F.lit(False)
    for stream, when in remade.items():
        until = datetime.fromisoformat(when) + RESOURCED_WITHIN
        near = near | ((F.col("hub_stream") == stream) & (F.col("hub_time") < F.lit(until)))
    pairs = fresh.where(near).select("hub_stream", PARTITION_COLUMN).distinct().collect()
    if not pairs:
        return fresh, set()
    streams = ", ".join(sorted({f"'{p[0]}'" for p in pairs}))
    days = ", ".join(sorted({f"'{p[1].isoformat()}'" for p in pairs}))
    where = f"hub_stream IN ({streams}) AND {PARTITION_COLUMN} IN ({days})"
    held = table.read(config, _KEY, row_filter=where)
    within = {str(p[0]) for p in pairs}
    if held is None or held.num_rows == 0:
        return fresh, within
    archived = fresh.sparkSession.createDataFrame(held)
    same = functools.reduce(operator.and_, (fresh[c].eqNullSafe(archived[c]) for c in _KEY))
    dropped = fresh.join(archived, same, "left_semi").count()
    log.warning("rows_sourced_again_dropped", rows=dropped, streams=sorted(within))
    return fresh.join(archived, same, "left_anti"), within


def _unarchived(done: dict[str, int]) -> Column:
    archived = F.create_map(*(F.lit(x) for item in done.items() for x in item))
    return F.col("hub_seq") > F.coalesce(archived[F.col("hub_stream")], F.lit(0))


def _highest(keys: pa.Table) -> dict[str, int]:
    grouped = keys.group_by("hub_stream").aggregate([("hub_seq", "max")])
    streams, seqs = grouped["hub_stream"].to_pylist(), grouped["hub_seq_max"].to_pylist()
    return dict(zip(streams, seqs, strict=True))
