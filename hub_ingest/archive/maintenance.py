"""Keeping the archive table small and fast: compaction, snapshot expiry, relocation.

A running ingest commits a few files every trigger. `compact` rewrites each day's small
files into few large ones and commits the swap as one snapshot: readers see the day whole
before and after, never doubled or missing. The commit is refused (and the day retried on a
fresh read) when the ingest added files to that day meanwhile.

`expire` drops snapshots older than ``ingest.keep_snapshots`` and then deletes the files that
no kept snapshot lists any more (and files of killed writes, once that old): a reader that
planned a scan on an older snapshot keeps its files for that long.

`trim` purges what the archive holds from the hub's streams (`hub_ingest.fleet.trim`).

`relocate` adopts a copied or moved archive: Iceberg records absolute file paths, so the
copy's catalog is pointed at a new table over the copy's own files (its history starts at
that snapshot).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pyarrow.parquet as pq
import structlog
from pyiceberg.exceptions import CommitFailedException, ValidationException
from pyiceberg.expressions.parser import parse
from pyiceberg.io.pyarrow import ArrowScan, parquet_file_to_data_file
from pyiceberg.table import FileScanTask, Table
from tenacity import retry, retry_if_exception_type, stop_after_attempt

from hub_ingest.archive import table
from hub_ingest.archive.table import DATA_DIR, PARTITION_COLUMN
from hub_ingest.commands.index import CommandIndex
from hub_ingest.commands.send import event_streams
from hub_ingest.core.config import HubConfig, IngestConfig
from hub_ingest.core.connect import hub_connection
from hub_ingest.core.errors import ArchiveError
from hub_ingest.fleet.registry import Registry
from hub_ingest.fleet.streams import made_now
from hub_ingest.fleet.trim import TrimReport, trim_hub

log = structlog.get_logger(__name__)

COMPACT_PREFIX = "compact-"
EPOCH = date(1970, 1, 1)
COMPACTED = "hub-ingest.compacted"  # in a compaction snapshot's summary: the day it rewrote
RELOCATED = "hub-ingest.relocated-from"  # in a relocated table's first snapshot


@dataclass(frozen=True, slots=True)
class DayCompaction:
    day: str
    files_before: int
    files_after: int
    rows: int
    seconds: float


@dataclass
class MaintenanceReport:
    days: list[DayCompaction] = field(default_factory=list)
    snapshots_expired: int = 0
    files_deleted: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compact(config: IngestConfig, day: date | None = None) -> MaintenanceReport:
    """Rewrite the small files of `day` (default: every day that has several)."""
    report = MaintenanceReport()
    current = _table(config)
    days = [day] if day is not None else _days_with_small_files(current, config)
    for which in days:
        try:
            done = _compact_day(config, which)
        except (CommitFailedException, ValidationException):
            raise ArchiveError(
                f"{which}: the ingest added files to this day during each of 5 attempts to "
                "compact it; run `hub-ingest compact` again later"
            ) from None
        if done is not None:
            report.days.append(done)
    return report


def _table(config: IngestConfig) -> Table:
    current = table.load(config)
    if current is None:
        raise ArchiveError(f"no archive table {config.table} yet: run `hub-ingest run` first")
    return current


def _on(day: date) -> str:
    return f"{PARTITION_COLUMN} = '{day.isoformat()}'"


def _small(task: FileScanTask, config: IngestConfig) -> bool:
    return task.file.file_size_in_bytes < config.compact_file_size // 2


def _days_with_small_files(current: Table, config: IngestConfig) -> list[date]:
    count: dict[date, int] = {}
    for task in current.scan().plan_files():
        if _small(task, config):
            day = EPOCH + timedelta(days=task.file.partition[0])  # Iceberg: days since 1970
            count[day] = count.get(day, 0) + 1
    return sorted(d for d, n in count.items() if n > 1)


@retry(
    retry=retry_if_exception_type((CommitFailedException, ValidationException)),
    stop=stop_after_attempt(5),
    reraise=True,
)
def _compact_day(config: IngestConfig, day: date) -> DayCompaction | None:
    started = time.monotonic()
    current = _table(config)
    tasks = [t for t in current.scan(row_filter=_on(day)).plan_files() if _small(t, config)]
    if len(tasks) < 2:
        return None
    size = sum(t.file.file_size_in_bytes for t in tasks)
    rows = sum(t.file.record_count for t in tasks)
    out = (
        f"{table.location(config.archive)}/{DATA_DIR}/{COMPACT_PREFIX}{day}-{uuid.uuid4().hex[:8]}"
    )
    try:
        files = _rewrite(current, tasks, out, day, parts=math.ceil(size / config.compact_file_size))
        table.sync_files(files)
        tx = current.transaction()
        with tx, tx.update_snapshot(snapshot_properties={COMPACTED: str(day)}).overwrite() as swap:
            for task in tasks:
                swap.delete_data_file(task.file)
            for uri in files:
                swap.append_data_file(parquet_file_to_data_file(current.io, tx.table_metadata, uri))
    except (CommitFailedException, ValidationException) as exc:
        table.remove_tree(out)  # the ingest added to this day meanwhile: read it again
        log.info("day_compaction_retried", day=str(day), reason=str(exc))
        raise
    done = DayCompaction(
        str(day), len(tasks), len(files), rows, round(time.monotonic() - started, 3)
    )
    log.info("day_compacted", **asdict(done))
    return done


def _rewrite(
    current: Table, tasks: list[FileScanTask], out: str, day: date, parts: int
) -> list[str]:
    """The rows of `tasks`, through the same reader as any scan, into `parts` files."""
    schema = current.schema()
    scan = ArrowScan(current.metadata, current.io, schema, parse(_on(day)))
    per_file = math.ceil(sum(t.file.record_count for t in tasks) / max(parts, 1))
    arrow_schema = schema.as_arrow()
    files: list[str] = []
    writer: pq.ParquetWriter | None = None
    in_file = 0
    for batch in scan.to_record_batches(tasks):
        if writer is None or in_file >= per_file:
            if writer is not None:
                writer.close()
            uri = f"{out}/day={day}/part-{len(files):05d}.parquet"
            fs, path = table.filesystem(uri)
            fs.create_dir(path.rsplit("/", 1)[0])
            writer = pq.ParquetWriter(path, arrow_schema, filesystem=fs, compression="zstd")
            files.append(uri)
            in_file = 0
        writer.write_batch(batch.cast(arrow_schema))
        in_file += batch.num_rows
    if writer is not None:
        writer.close()
    return files


def expire(config: IngestConfig, report: MaintenanceReport | None = None) -> MaintenanceReport:
    """Expire snapshots older than ``keep_snapshots``, then delete what only they listed."""
    report = report or MaintenanceReport()
    current = _table(config)
    cutoff = datetime.now(UTC) - timedelta(seconds=config.keep_snapshots)
    before = len(current.snapshots())
    current.maintenance.expire_snapshots().older_than(cutoff).commit()
    current = _table(config)
    report.snapshots_expired = before - len(current.snapshots())
    report.files_deleted = table.remove_unlisted(current, older_than=cutoff)
    log.info(
        "snapshots_expired", expired=report.snapshots_expired, files_deleted=report.files_deleted
    )
    return report


def relocate(config: IngestConfig) -> int:
    """Point the catalog at a table over the files under ``ingest.archive``; returns how many
    data files the new table lists."""
    cat = table.catalog(config)
    old = cat.load_table(config.table)
    source, target = old.location().rstrip("/"), table.location(config.archive).rstrip("/")
    if source == target:
        return len(table.data_files(old))
    files = [target + uri.removeprefix(source) for uri in table.data_files(old)]
    missing = [uri for uri in files if not table.exists(uri)]
    if missing:
        raise ArchiveError(
            f"{len(missing)} data files of {config.table} are not under {target} "
            f"(first: {missing[0]}): copy the whole archive directory"
        )
    staged = f"{config.table}_relocated"
    if cat.table_exists(staged):
        cat.drop_table(staged)  # an earlier relocation was killed half way
    new = table.create(config, staged, old.schema().as_arrow())
    table.commit(new, files, table.archived(old), {RELOCATED: source}, table.made_at(old))
    cat.drop_table(config.table)
    cat.rename_table(staged, config.table)
    log.info("archive_relocated", table=config.table, previous=source, location=target)
    return len(files)


async def trim(config: HubConfig) -> TrimReport:
    """Purge from the hub's streams what the archive holds and is older than
    ``ingest.keep_on_hub``; nothing before the first batch is archived."""
    archive = table.load(config.ingest)
    async with hub_connection(config, name="hub-ingest-trim") as nc:
        js = nc.jetstream(domain=config.nats.domain)
        # Of a stream made anew since, nothing is archived, whatever its sequences.
        archived = {}
        if archive is not None:
            made = await made_now(js, list(table.archived(archive)))
            archived = table.archived(archive, made)
        # Every command result counted before an events shard loses it.
        devices = await (await Registry.open(js)).list()
        index = await CommandIndex.open(js, config.replicas)
        await index.catch_up(event_streams(devices), commands=False)
        return await trim_hub(js, nc, config, archived, devices)
