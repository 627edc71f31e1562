"""The ingest's checkpoint survives a power cut.

Spark writes its checkpoint (``offsets/``, ``commits/``, ``metadata``, ``sources/``) through
Hadoop's local file system, which never fsyncs. A power cut can then leave any of those files
empty or torn behind its final name (ext4's delayed allocation does this), and Spark refuses
to start ("No content to map due to end-of-input").

So the ingest does two things:

- after each batch Spark reports done, `SyncedBatches.mark` fsyncs what Spark wrote for it
  and then records that batch, durably, in ``<checkpoint>/hub-ingest-synced.json``;
- before the query starts, `repair` checks every log entry written after that batch. From
  the first damaged batch on, the batches are rolled back (their entries removed), and Spark
  plans them again from the hub's streams, which still hold them. Hadoop's ``.crc`` files of
  that window are removed too (they are optional, and may be torn), and so are Spark's
  temporary files of writes that never finished.

A rolled-back batch cannot duplicate rows: the archive table records, in the commit that adds
them, the highest sequence it holds of each stream (`hub_ingest.ingest.sink`), and the table itself
is fsynced before its catalog points at it (`hub_ingest.archive.table.SyncedFileIO`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from edge_agent.protocol.files import fsync, write_durably
from hub_ingest.archive.table import is_local
from hub_ingest.core.errors import IngestError

log = structlog.get_logger(__name__)

MARKER = "hub-ingest-synced.json"


def log_entries(directory: Path) -> list[tuple[int, Path]]:
    """(batch, file) of a Spark metadata log directory (``offsets``, ``commits``), in batch
    order, compaction files (``<n>.compact``) included."""
    found = []
    if directory.is_dir():
        for entry in directory.iterdir():
            stem, _, suffix = entry.name.partition(".")
            if stem.isdigit() and suffix in ("", "compact"):  # not the hidden temporary files
                found.append((int(stem), entry))
    return sorted(found)


@dataclass
class SyncedBatches:
    """The last batch known to be on disk, kept in the checkpoint."""

    checkpoint: Path
    batch: int = -1

    @classmethod
    def load(cls, checkpoint: Path) -> SyncedBatches:
        try:
            batch = int(json.loads((checkpoint / MARKER).read_text())["batch"])
        except (OSError, ValueError, KeyError, TypeError):
            batch = -1  # never synced, or the marker itself was torn: check everything
        return cls(checkpoint, batch)

    def mark(self, batch: int) -> None:
        """fsync what Spark wrote for the batches up to `batch`, then record it."""
        if batch <= self.batch or not is_local(self.checkpoint):
            return
        written: set[Path] = set()
        for directory in (self.checkpoint / "offsets", self.checkpoint / "commits"):
            written |= {p for b, p in log_entries(directory) if self.batch < b <= batch}
        written |= {p for p in self.checkpoint.glob("sources/*/*") if p.is_file()}
        written.add(self.checkpoint / "metadata")
        # Hadoop checks a file against its ".<name>.crc" when there is one: sync both.
        written |= {p.with_name(f".{p.name}.crc") for p in written}
        for path in sorted(written):
            if path.exists():
                fsync(path)
        for directory in sorted({p.parent for p in written if p.exists()}):
            fsync(directory)  # their names, too
        write_durably(self.checkpoint / MARKER, json.dumps({"batch": batch}))
        self.batch = batch


@dataclass
class Repair:
    rolled_back_from: int | None = None
    removed: list[str] = field(default_factory=list)


def repair(checkpoint: Path) -> Repair:
    """Make the checkpoint startable after a power cut (see the module doc)."""
    done = Repair()
    if not (is_local(checkpoint) and checkpoint.is_dir()):
        return done
    synced = SyncedBatches.load(checkpoint).batch
    _repair_metadata(checkpoint, done)
    logs = [checkpoint / "offsets", checkpoint / "commits"]
    for directory in [*logs, checkpoint / "sources"]:
        _remove_leftovers(directory, synced, done)
    first_bad = _first_damaged_batch(checkpoint, synced)
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


def _first_damaged_batch(checkpoint: Path, synced: int) -> int | None:
    bad: list[int] = []
    for batch, path in log_entries(checkpoint / "offsets"):
        if batch > synced and not _log_ok(path, 3):
            bad.append(batch)
    for batch, path in log_entries(checkpoint / "commits"):
        if batch > synced and not _log_ok(path, 2):
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


@contextlib.contextmanager
def only_run(checkpoint: Path, what: str = "run") -> Iterator[None]:
    """Hold ``<checkpoint>.lock`` for as long as the ingest (`what`) runs: a second run on
    the same checkpoint (the timer's and one started by hand) is refused at once. Two would
    plan the same batches, and Spark fails one of them half way ("Concurrent update to the
    log"); a compaction's commits would race the batches' (`table.commit`)."""
    lock = checkpoint.with_name(f"{checkpoint.name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a+") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.seek(0)
            holder = held.read().strip() or "unknown"
            raise IngestError(
                f"another hub-ingest run, compact or relocate (pid {holder}) is working on "
                f"this archive (it holds {lock}); this {what} stops"
            ) from None
        held.truncate(0)
        held.write(str(os.getpid()))
        held.flush()
        yield
