"""What a batch's commit costs: the archive's Iceberg table (pyiceberg, SQLite catalog, every
metadata file fsynced) against a Delta table (deltalake) given the same Parquet files.

Each of `--commits` batches loads the table and adds one small Parquet file (written
beforehand, outside the timing) and the archived sequence, as the ingest's driver does.
Prints the mean commit time over the first and the last tenth of the commits (growth with
the table's history), the Iceberg/Delta ratio, then one ``name=value`` line.
Run from the repository root: ``.venv/bin/python bench/table_commit.py [--commits N]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support is not installed

from datetime import timedelta

import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.transaction import AddAction

from hub_ingest.archive import table
from hub_ingest.core.config import parse_hub_config
from tests.support import archives

STATE = Path("bench-state/table_commit")


def _files(root: Path, commits: int) -> list[Path]:
    rows = archives.readings("a", 1000, timedelta(seconds=1))
    files = []
    for i in range(commits):
        path = root / "data" / f"batch-{i:08d}" / "day=2026-11-20" / "part-00000.parquet"
        path.parent.mkdir(parents=True)
        pq.write_table(rows, path)
        files.append(path)
    return files


def iceberg(commits: int) -> list[float]:
    config = parse_hub_config({"state_dir": str(STATE / "iceberg")}).ingest
    files = _files(config.archive, commits)
    table.create_or_evolve(config, pq.read_schema(files[0]))

    def commit(i: int) -> None:
        current = table.load(config)  # as the ingest's driver does for every batch
        assert current is not None
        table.commit(current, [f"file://{files[i]}"], {"FLEET_TELEMETRY": i}, {})

    return _timed(commits, commit)


def delta(commits: int) -> list[float]:
    root = STATE / "delta"
    files = _files(root, commits)
    schema = pq.read_schema(files[0])
    DeltaTable.create(str(root), schema, partition_by=["date"])

    def commit(i: int) -> None:
        dt = DeltaTable(str(root))
        add = AddAction(
            str(files[i].relative_to(root)),
            files[i].stat().st_size,
            {"date": "2026-11-20"},
            int(time.time() * 1000),
            True,
            "{}",
        )
        dt.create_write_transaction(
            [add],
            "append",
            schema,
            partition_by=["date"],
            commit_properties=CommitProperties(app_transactions=[Transaction("hub-ingest", i)]),
        )

    return _timed(commits, commit)


def _timed(commits: int, commit: Callable[[int], None]) -> list[float]:
    times = []
    for i in range(commits):
        started = time.perf_counter()
        commit(i)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=300)
    commits = parser.parse_args().commits
    shutil.rmtree(STATE, ignore_errors=True)
    tenth = max(commits // 10, 1)
    results = {}
    for name, run in (("iceberg", iceberg), ("delta", delta)):
        times = run(commits)
        first, last = statistics.mean(times[:tenth]), statistics.mean(times[-tenth:])
        results[name] = last
        print(
            f"{name}: first {tenth} commits {first * 1e3:.1f} ms, last {tenth} {last * 1e3:.1f} ms"
        )
    ratio = results["iceberg"] / results["delta"]
    print(f"iceberg/delta commit time, last commits: {ratio:.2f}")
    print(
        f"commits={commits} iceberg_commit_ms={results['iceberg'] * 1000:.1f} "
        f"delta_commit_ms={results['delta'] * 1000:.1f} ratio={ratio:.2f}"
    )


if __name__ == "__main__":
    main()
