"""The ingest's checkpoint and archive log survive a power cut.

Spark writes its checkpoint (``offsets/``, ``commits/``, ``metadata``, ``sources/``) and the
file sink's log (``<archive>/_spark_metadata``) through Hadoop's local file system, which never
fsyncs. A power cut can then leave any of those files, or a Parquet file they list, empty or
torn behind its final name (ext4's delayed allocation does this), and Spark refuses to start
("No content to map due to end-of-input") or the archive lists a file no reader can open.

So the ingest does two things:

- after each batch Spark reports done, `SyncedBatches.mark` fsyncs what Spark wrote for it
  (its log entries, the Parquet files they list, their directories) and then records that
  batch, durably, in ``<checkpoint>/hub-ingest-synced.json``: everything up to it is on disk;
- before the query starts, `repair` checks every file written after that batch (the offset,
  commit and sink log entries and the Parquet files they list). From the first damaged batch
  on, the batches are rolled back (their log entries removed), and Spark runs them again from
  the hub's streams, which still hold them; damaged Parquet files are deleted. Hadoop's
  ``.crc`` files of that window are removed too (they are optional, and may be torn), and so
  are Spark's temporary files of writes that never finished.

Nothing is lost by a repair: a rolled-back batch is read again, and if retention removed
its messages meanwhile, ``failOnDataLoss`` reports it as for any other gap.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import structlog

from edge_agent.protocol.files import fsync, write_durably
from hub_ingest.audit import METADATA_DIR, entry_files, log_entries

log = structlog.get_logger(__name__)

MARKER = "hub-ingest-synced.json"


def is_local(path: Path) -> bool:
    """A plain path, not a Hadoop URI (``hdfs://``, ``s3a://``: stores that need no fsync)."""
    return ":/" not in str(path)


@dataclass
class SyncedBatches:
    """The last batch known to be on disk, kept in the checkpoint."""

    checkpoint: Path
    archive: Path
    batch: int = -1

    @classmethod
    def load(cls, checkpoint: Path, archive: Path) -> SyncedBatches:
        try:
            batch = int(json.loads((checkpoint / MARKER).read_text())["batch"])
        except (OSError, ValueError, KeyError, TypeError):
            batch = -1  # never synced, or the marker itself was torn: check everything
        return cls(checkpoint, archive, batch)

    def mark(self, batch: int) -> None:
        """fsync what Spark wrote for the batches up to `batch`, then record it."""
        if batch <= self.batch or not is_local(self.checkpoint):
            return
        written: set[Path] = set()
        for directory in (self.checkpoint / "offsets", self.checkpoint / "commits"):
            written |= {p for b, p in log_entries(directory) if self.batch < b <= batch}
        written |= {p for p in self.checkpoint.glob("sources/*/*") if p.is_file()}
        written.add(self.checkpoint / "metadata")
        if is_local(self.archive):
            sink = dict(log_entries(self.archive / METADATA_DIR))
            for b, entry in sink.items():
                if self.batch < b <= batch:
                    written |= {entry, *_batch_files(sink, b)}
        # Hadoop checks a file against its ".<name>.crc" when there is one: sync both.
        written |= {p.with_name(f".{p.name}.crc") for p in written}
        for path in sorted(written):
            if path.exists():
                fsync(path)
        for directory in sorted({p.parent for p in written if p.exists()}):
            fsync(directory)  # their names, too
        write_durably(self.checkpoint / MARKER, json.dumps({"batch": batch}))
        self.batch = batch


def _batch_files(sink: dict[int, Path], batch: int) -> list[Path]:
    """The data files batch `batch` wrote. A compaction entry lists the whole archive: of
    those, the files written after the entry before it."""
    files = sink_files(sink[batch])
    if sink[batch].suffix != ".compact":
        return files
    earlier = [p.stat().st_mtime for b, p in sink.items() if b < batch]
    since = max(earlier, default=0.0)
    return [f for f in files if f.stat().st_mtime >= since]


def sink_files(entry: Path) -> list[Path]:
    """The existing data files a sink log entry adds ([] for an entry a cut damaged)."""
    try:
        listed = entry_files(entry)
    except (OSError, ValueError, KeyError):
        return []
    return [p for action, p in listed if action != "delete" and p.exists()]


@dataclass
class Repair:
    rolled_back_from: int | None = None
    removed: list[str] = field(default_factory=list)


def repair(checkpoint: Path, archive: Path) -> Repair:
    """Make the checkpoint and sink log startable after a power cut (see the module doc)."""
    done = Repair()
    if not (is_local(checkpoint) and checkpoint.is_dir()):
        return done
    synced = SyncedBatches.load(checkpoint, archive).batch
    _repair_metadata(checkpoint, done)
    sink = archive / METADATA_DIR
    logs = [checkpoint / "offsets", checkpoint / "commits", sink]
    for directory in [*logs, checkpoint / "sources"]:
        _remove_leftovers(directory, synced, done)
    first_bad = _first_damaged_batch(checkpoint, sink, synced, done)
    if first_bad is not None:
        done.rolled_back_from = first_bad
        for directory in logs:
            for entry in log_entries(directory):
                if entry[0] >= first_bad:
                    _remove(entry[1], done)
    if done.removed or done.rolled_back_from is not None:
        log.warning(
            "ingest_checkpoint_repaired",
            rolled_back_from=done.rolled_back_from,
            removed=len(done.removed),
        )
    return done


def _repair_metadata(checkpoint: Path, done: Repair) -> None:
    """``metadata`` names the query: a torn one is written afresh (the id is not data)."""
    meta = checkpoint / "metadata"
    if meta.exists():
        try:
            json.loads(meta.read_text())["id"]
        except (ValueError, KeyError, TypeError):
            _remove(meta, done)
            _remove(meta.with_name(".metadata.crc"), done, quiet=True)  # the torn file's
            write_durably(meta, json.dumps({"id": str(uuid.uuid4())}) + "\n")
    for source in (checkpoint / "sources").glob("*/*"):
        if source.is_file() and not source.name.startswith(".") and not _log_ok(source, 1):
            _remove(source, done)  # the source's initial offset: Spark asks for it again


def _log_ok(path: Path, min_lines: int) -> bool:
    """A Spark metadata log file: a ``v<n>`` line, then whole JSON lines."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) < min_lines or not lines[0].startswith("v") or not lines[0][1:].isdigit():
            return False
        for line in lines[1:]:
            json.loads(line)
    except (OSError, ValueError):
        return False
    return True


def _parquet_ok(path: Path) -> bool:
    try:
        pq.read_table(path)  # footer and every page: a torn file fails somewhere
    except Exception:
        return False
    return True


def _first_damaged_batch(checkpoint: Path, sink: Path, synced: int, done: Repair) -> int | None:
    bad: list[int] = []
    for batch, path in log_entries(checkpoint / "offsets"):
        if batch > synced and not _log_ok(path, 3):
            bad.append(batch)
    for batch, path in log_entries(checkpoint / "commits"):
        if batch > synced and not _log_ok(path, 2):
            bad.append(batch)
    entries = dict(log_entries(sink))
    for batch, path in entries.items():
        if batch <= synced:
            continue
        if not _log_ok(path, 1):
            bad.append(batch)
            continue
        for data in _batch_files(entries, batch):
            _remove(data.with_name(f".{data.name}.crc"), done, quiet=True)
            if not _parquet_ok(data):
                _remove(data, done)
                bad.append(batch)
    return min(bad) if bad else None


def _remove_leftovers(directory: Path, synced: int, done: Repair) -> None:
    """Spark's unfinished writes (``.<n>.<uuid>.tmp``, left by any kill: Spark refuses to
    start batch 0 beside one) and the checksums written since the last sync."""
    if directory.is_dir():
        for tmp in directory.rglob(".*.tmp"):
            _remove(tmp, done, quiet=True)
        for crc in directory.rglob(".*.crc"):
            stem = crc.name[1:-4].partition(".")[0]
            if not stem.isdigit() or int(stem) > synced:
                _remove(crc, done, quiet=True)


def _remove(path: Path, done: Repair, *, quiet: bool = False) -> None:
    """Delete `path`; counted as a repair unless `quiet` (a checksum file, optional anyway)."""
    if path.exists():
        path.unlink()
        if not quiet:
            done.removed.append(str(path))
