"""The archive as each analyst tool reads it, through the table: the rows' keys."""

from __future__ import annotations

from collections.abc import Callable

import duckdb
import polars as pl
from pyiceberg.table import Table
from pyspark.sql import SparkSession

from hub_ingest.archive import table

KEY = ("device_id", "hub_stream", "device_seq")
Key = tuple[str, str, int]


def with_pyarrow(archive: Table) -> list[Key]:
    rows = archive.scan(selected_fields=KEY).to_arrow()
    return list(zip(*(rows[c].to_pylist() for c in KEY), strict=True))


def with_pandas(archive: Table) -> list[Key]:
    frame = archive.scan(selected_fields=KEY).to_pandas()[list(KEY)]
    return [(d, s, int(q)) for d, s, q in frame.itertuples(index=False)]


def with_polars(archive: Table) -> list[Key]:
    return pl.scan_iceberg(archive).select(KEY).collect().rows()


def with_duckdb(archive: Table) -> list[Key]:
    con = duckdb.connect()
    archive.scan(selected_fields=KEY).to_duckdb("archive", connection=con)
    return con.sql("SELECT device_id, hub_stream, device_seq FROM archive").fetchall()


def with_spark(spark: SparkSession) -> Callable[[Table], list[Key]]:
    """Spark without Iceberg's runtime (no Maven here): the current snapshot's data files."""

    def read(archive: Table) -> list[Key]:
        files = table.data_files(archive)
        if not files:
            return []
        return [tuple(r) for r in spark.read.parquet(*files).select(*KEY).collect()]

    return read


def readers(spark: SparkSession) -> dict[str, Callable[[Table], list[Key]]]:
    return {
        "pyarrow": with_pyarrow,
        "pandas": with_pandas,
        "polars": with_polars,
        "duckdb": with_duckdb,
        "spark": with_spark(spark),
    }
