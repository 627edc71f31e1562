"""The archive: one Apache Iceberg table, committed a micro-batch at a time.

Every reader sees a table through its catalog: the current snapshot lists exactly the data
files of committed batches, so files a killed batch left behind are never read, by any tool
(pandas, pyarrow, Polars, DuckDB through pyiceberg; Spark through its Iceberg runtime). The
catalog is SQL (a SQLite file inside the archive by default, so that a copy of the directory
is a whole archive; PostgreSQL or a REST catalog for production).

What has been archived is recorded in the table itself, in the same commit as the data: the
property ``hub-ingest.archived.<stream>`` holds the highest ``hub_seq`` of each aggregate
stream, and ``hub-ingest.made.<stream>`` when that stream was made. A batch run again after
a kill (or a whole new checkpoint) only writes rows above it, so the table and Spark's
checkpoint can never disagree into a duplicate or a gap; a stream made anew (deleted and
provisioned again, or on a hub that lost its store) numbers from 1 again, and its rows are
archived from there (``hub-ingest.remade.<stream>`` marks it while what it sourced again is
looked up by key: `hub_ingest.ingest.sink`).

Every file pyiceberg writes (manifests, manifest lists, ``metadata.json``) is fsynced before
the catalog points at it (`SyncedFileIO`): a power cut cannot leave the catalog pointing at
a torn file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import structlog
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io import OutputStream
from pyiceberg.io.pyarrow import PyArrowFile, PyArrowFileIO
from pyiceberg.table import Table, Transaction

from edge_agent.protocol.files import fsync
from hub_ingest.core.config import IngestConfig
from hub_ingest.core.errors import ArchiveError

log = structlog.get_logger(__name__)

PARTITION_COLUMN = "date"
ARCHIVED = "hub-ingest.archived."  # + aggregate stream name: its highest archived hub_seq
MADE = "hub-ingest.made."  # + aggregate stream name: when that stream was made (`made_at`)
REMADE = "hub-ingest.remade."  # + aggregate stream name: when it was made anew ("": settled)
DATA_DIR = "data"
PROPERTIES = {
    "format-version": "2",
    # One manifest per commit would make every scan read thousands of them: merge them.
    "commit.manifest-merge.enabled": "true",
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "20",
}
# pyiceberg retries a commit that lost a race by applying it again on top of the winner's,
# which re-adds the batch's files and sets the archived sequences back: another ingest's
# batch would be archived twice. A lost race fails the batch instead (see `commit`).
NO_RETRIES = {"commit.retry.num-retries": "0"}


def is_local(path: Path | str) -> bool:
    """A plain path, not a URI (``hdfs://``, ``s3://``: stores that need no fsync)."""
    return ":/" not in str(path)


def location(path: Path) -> str:
    """`path` as a URI (``file:///…`` for a local path)."""
    text = str(path)
    if is_local(text):
        return f"file://{path.absolute()}"  # not percent-encoded: pyiceberg does not decode
    scheme, _, rest = text.partition(":/")  # Path() folded the URI's "//" into one "/"
    return f"{scheme}://{rest.lstrip('/')}"


def local_path(uri: str) -> Path | None:
    """The local path of a ``file:`` URI or plain path; None for a remote store."""
    if uri.startswith("file:"):
        return Path(urlparse(uri).path)
    return Path(uri) if is_local(uri) else None


class _SyncOnClose:
    """An output stream that is fsynced, with its directory, when it is closed."""

    def __init__(self, stream: Any, path: Path) -> None:
        self._stream, self._path = stream, path

    def write(self, b: bytes) -> int:
        return int(self._stream.write(b))

    def tell(self) -> int:
        return int(self._stream.tell())

    def close(self) -> None:
        self._stream.close()
        fsync(self._path)
        fsync(self._path.parent)

    def __enter__(self) -> _SyncOnClose:
        return self

    def __exit__(
        self,
        exctype: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _SyncedFile(PyArrowFile):
    def create(self, overwrite: bool = False) -> OutputStream:
        stream = super().create(overwrite)
        path = local_path(self.location)
        return stream if path is None else _SyncOnClose(stream, path)


class SyncedFileIO(PyArrowFileIO):
    """pyiceberg's pyarrow file IO, with local files fsynced as they are closed."""

    def new_output(self, location: str) -> PyArrowFile:
        plain = super().new_output(location)
        return _SyncedFile(location, plain._path, plain._filesystem, plain._buffer_size)


def catalog(config: IngestConfig) -> Catalog:
    uri = config.catalog or f"sqlite:///{config.archive.absolute()}/catalog.db"
    if uri.startswith("sqlite:"):
        # SQLite creates its file, not the directory it sits in.
        file = Path(uri.removeprefix("sqlite:///"))
        file.parent.mkdir(parents=True, exist_ok=True)
    kind = "rest" if uri.startswith(("http://", "https://")) else "sql"
    return load_catalog(
        "hub",
        type=kind,
        uri=uri,
        warehouse=location(config.archive),
        **{"py-io-impl": f"{SyncedFileIO.__module__}.{SyncedFileIO.__name__}"},
    )


def load(config: IngestConfig) -> Table | None:
    """The archive table, or None before the ingest created it."""
    try:
        table = catalog(config).load_table(config.table)
    except NoSuchTableError:
        return None
    expected = location(config.archive)
    if table.location().rstrip("/") != expected.rstrip("/"):
        raise ArchiveError(
            f"the catalog's table {config.table} lives at {table.location()}, not at "
            f"ingest.archive ({expected}): a copied or moved archive must be adopted with "
            "`hub-ingest relocate` before it is read"
        )
    return table


def create(config: IngestConfig, name: str, schema: pa.Schema) -> Table:
    """A new, empty table `name` at ``ingest.archive``, partitioned by day."""
    cat = catalog(config)
    cat.create_namespace_if_not_exists(name.rpartition(".")[0])
    with cat.create_table_transaction(
        name, schema, location=location(config.archive), properties=PROPERTIES | NO_RETRIES
    ) as tx:
        with tx.update_spec() as spec:
            spec.add_identity(PARTITION_COLUMN)
        _map_names(tx)
    log.info("archive_table_created", table=name, location=location(config.archive))
    return cat.load_table(name)


def _map_names(tx: Transaction) -> None:
    # Spark writes no Iceberg field ids: files are read by column name, through this mapping.
    mapping = tx.table_metadata.schema().name_mapping.model_dump_json()
    tx.set_properties({"schema.name-mapping.default": mapping})


def create_or_evolve(config: IngestConfig, schema: pa.Schema) -> Table:
    """The archive table with (at least) the columns of `schema`, created if missing."""
    table = load(config)
    if table is None:
        return create(config, config.table, schema)
    if any(table.properties.get(key) != value for key, value in NO_RETRIES.items()):
        with table.transaction() as tx:  # a table made before 2026-12-02
            tx.set_properties(NO_RETRIES)
        table = table.refresh()
    missing = [f.name for f in schema if f.name not in table.schema().column_names]
    if missing:
        with table.transaction() as tx:
            with tx.update_schema() as update:
                update.union_by_name(schema)
            _map_names(tx)
        log.info("archive_columns_added", table=config.table, columns=missing)
        table = table.refresh()
    return table


def archived(table: Table, made: Mapping[str, str] | None = None) -> dict[str, int]:
    """Per aggregate stream, the highest ``hub_seq`` the table holds (committed). With `made`
    (each stream's `made_at` now), a stream made anew since is left out: its sequences
    started again from 1, and none of them is archived."""
    props = table.properties
    seqs = {k.removeprefix(ARCHIVED): int(v) for k, v in props.items() if k.startswith(ARCHIVED)}
    if made is None:
        return seqs
    # An archive older than the record of `made_at` holds none: its streams are taken as they are.
    return {s: n for s, n in seqs.items() if props.get(f"{MADE}{s}", made.get(s)) == made.get(s)}


def made_at(table: Table) -> dict[str, str]:
    """Per aggregate stream, when the stream the table's rows of it came from was made."""
    props = table.properties
    return {k.removeprefix(MADE): v for k, v in props.items() if k.startswith(MADE)}


def remade(table: Table, made: Mapping[str, str]) -> dict[str, str]:
    """The streams made anew (`made`: each one's `made_at` now) since the table last had
    rows of them, or made anew before and not since: what they sourced again when they were
    made may be archived already."""
    props = table.properties
    return {
        s: when
        for s, when in made.items()
        if props.get(f"{MADE}{s}", when) != when or props.get(f"{REMADE}{s}") == when
    }


def commit(
    table: Table,
    files: list[str],
    seqs: Mapping[str, int],
    summary: dict[str, str],
    made: Mapping[str, str],
    *,
    remade: Mapping[str, str] | None = None,
) -> None:
    """Add `files` and advance the archived sequences of streams made at `made` (`remade`:
    of those, the ones made anew), as one snapshot (`summary` in it)."""
    try:
        with table.transaction() as tx:
            tx.set_properties(
                {f"{ARCHIVED}{stream}": str(seq) for stream, seq in seqs.items()}
                | {f"{MADE}{stream}": made[stream] for stream in seqs if made.get(stream)}
                | {f"{REMADE}{stream}": when for stream, when in (remade or {}).items()}
            )
            tx.add_files(files, snapshot_properties=summary, check_duplicate_files=False)
    except CommitFailedException as exc:
        raise ArchiveError(
            f"the archive table changed while this batch was committed ({exc}): another "
            "hub-ingest run on it? Nothing of the batch was committed; run again"
        ) from exc


def read(
    config: IngestConfig,
    columns: list[str] | None = None,
    row_filter: str | None = None,
) -> pa.Table | None:
    """The current snapshot's rows (all columns unless `columns`), or None if there is none."""
    table = load(config)
    if table is None or table.current_snapshot() is None:
        return None
    fields = tuple(columns) if columns is not None else ("*",)
    scan = table.scan(row_filter=row_filter or AlwaysTrue(), selected_fields=fields)
    return scan.to_arrow()


def data_files(table: Table, *, every_snapshot: bool = False) -> list[str]:
    """The data files of the current snapshot (what Spark reads without Iceberg's runtime),
    or of every snapshot still kept."""
    if every_snapshot:
        return list(dict.fromkeys(table.inspect.all_data_files()["file_path"].to_pylist()))
    return [task.file.file_path for task in table.scan().plan_files()]


def read_files(uris: list[str], columns: list[str]) -> pa.Table:
    """`columns` of the Parquet files `uris` (all in one store)."""
    if not uris:
        return pa.table({})
    fs, _ = filesystem(uris[0])
    paths = [filesystem(uri)[1] for uri in uris]
    return ds.dataset(paths, filesystem=fs, format="parquet").to_table(columns=columns)


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The store holding `uri`, and the path of `uri` in it."""
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path


@dataclass(frozen=True, slots=True)
class ListedFile:
    uri: str
    size: int
    mtime: datetime


def list_files(uri: str) -> list[ListedFile]:
    """The files under `uri` (recursively, hidden ones and Spark's markers left out)."""
    fs, root = filesystem(uri)
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    except FileNotFoundError:
        return []
    base = uri.rstrip("/")
    out = []
    for info in infos:
        relative = info.path[len(root.rstrip("/")) + 1 :]
        if info.type == pafs.FileType.File and not any(
            part.startswith((".", "_")) for part in relative.split("/")
        ):
            mtime = info.mtime or datetime.fromtimestamp(0, UTC)
            out.append(ListedFile(f"{base}/{relative}", info.size or 0, mtime))
    return out


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return bool(fs.get_file_info(path).type == pafs.FileType.File)


def list_dirs(uri: str) -> list[str]:
    """The directories right under `uri`."""
    fs, root = filesystem(uri)
    try:
        infos = fs.get_file_info(pafs.FileSelector(root))
    except FileNotFoundError:
        return []
    base = uri.rstrip("/")
    return [f"{base}/{i.base_name}" for i in infos if i.type == pafs.FileType.Directory]


def remove_tree(uri: str) -> None:
    fs, root = filesystem(uri)
    fs.delete_dir(root)


def remove_unlisted(table: Table, *, older_than: datetime) -> int:
    """Delete data files and manifests that no kept snapshot lists, last written before
    `older_than` (younger ones may belong to a commit in progress); returns how many."""
    live = set(data_files(table, every_snapshot=True))
    live |= set(table.inspect.all_manifests()["path"].to_pylist())
    live |= {s.manifest_list for s in table.snapshots()}
    root = table.location().rstrip("/")
    data = f"{root}/{DATA_DIR}"
    listed = [*list_files(data), *list_files(f"{root}/metadata")]
    doomed = {
        f.uri
        for f in listed
        if f.uri not in live and f.mtime < older_than and not f.uri.endswith(".json")
    }
    for uri in doomed:
        fs, path = filesystem(uri)
        fs.delete_file(path)
    # The directories under data/ that still hold a file, from the same listing.
    occupied = {
        f.uri.removeprefix(f"{data}/").partition("/")[0]
        for f in listed
        if f.uri.startswith(f"{data}/") and f.uri not in doomed
    }
    for directory in list_dirs(data):
        fs, path = filesystem(directory)
        info = fs.get_file_info(path)
        empty = directory.rsplit("/", 1)[-1] not in occupied
        if empty and info.mtime is not None and info.mtime < older_than:
            fs.delete_dir(path)  # emptied, or a killed write's leftovers
    return len(doomed)


def sync_files(uris: list[str]) -> None:
    """fsync local data files and the directories that name them (remote stores: nothing)."""
    paths = [p for p in map(local_path, uris) if p is not None]
    dirs = {d for p in paths for d in (p.parent, p.parent.parent, p.parent.parent.parent)}
    for path in [*paths, *sorted(dirs, key=lambda d: -len(d.parts))]:
        if path.exists():
            fsync(path)
