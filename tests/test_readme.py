"""The README's analyst lines, run as written: readings per device per hour with pandas,
pyarrow, Polars, DuckDB and Spark, all giving the same counts."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from hub_ingest.core.config import parse_hub_config
from tests.support import archives

README = Path(__file__).parent.parent / "README.md"
README_ARCHIVE = "/var/lib/hub-ingest/archive"
TOOLS = ("pandas", "pyarrow", "polars", "duckdb", "spark")


def snippet(name: str) -> str:
    """The python block after ``<!-- analyst:<name> -->`` in the README."""
    found = re.search(rf"<!-- analyst:{name} -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert found, f"no analyst:{name} block in the README"
    return found[1]


def _hour(value: Any) -> str:
    when = value if isinstance(value, datetime) else value.to_pydatetime()
    if when.tzinfo is None:  # Spark's session time zone is UTC
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H")


def _counts(tool: str, per_hour: Any) -> dict[tuple[str, str], int]:
    if tool == "pandas":
        items = [(d, h, n) for (d, h), n in per_hour.items()]
    elif tool == "pyarrow":
        items = [
            tuple(r.values())
            for r in per_hour.select(["device_id", "hour", "device_id_count"]).to_pylist()
        ]
    elif tool == "spark":
        items = [(r["device_id"], r["hour"], r["count"]) for r in per_hour.collect()]
    elif tool == "polars":
        items = per_hour.select("device_id", "hour", "len").rows()
    else:
        items = per_hour
    return {(d, _hour(h)): int(n) for d, h, n in items}


@pytest.mark.spark
def test_the_readme_lines_count_readings_per_device_per_hour(
    tmp_path: Path, spark: SparkSession
) -> None:
    config = parse_hub_config({"state_dir": str(tmp_path)}).ingest
    # a: 30 readings 4 minutes apart (two hours); b: 5 an hour apart; committed in two batches
    # and a third day's file, as the ingest leaves them.
    archives.commit(config, archives.readings("a", 30, timedelta(minutes=4)))
    archives.commit(config, archives.readings("b", 5, timedelta(hours=1), first_hub_seq=31))
    want = {("a", "2026-11-20T09"): 15, ("a", "2026-11-20T10"): 15}
    want |= {("b", f"2026-11-20T{h:02d}"): 1 for h in range(9, 14)}

    opened: dict[str, Any] = {}
    exec(snippet("open").replace(README_ARCHIVE, str(config.archive)), opened)
    for tool in TOOLS:
        scope = {**opened, "spark": spark}
        exec(snippet(tool), scope)
        assert _counts(tool, scope["per_hour"]) == want, tool
