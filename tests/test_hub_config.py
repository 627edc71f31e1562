"""The hub config: what `check-config` refuses (exit 2, naming the key) beyond unknown keys,
and the payload schema check that runs without a JVM agreeing with Spark's own parser."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.types import StructType

from hub_ingest.core.ddl import DdlError, check_ddl
from tests.support.cluster import run_cli

pytestmark = pytest.mark.spark

VALID = [
    "temp DOUBLE, unit STRING",
    "a INT NOT NULL, b ARRAY<STRUCT<x: INT, y: STRING>>, m MAP<STRING, DOUBLE>",
    "d DECIMAL(10,2), t TIMESTAMP, n BIGINT COMMENT 'count', `odd name` BOOLEAN",
]
INVALID = ["temp DOUBL", "temp", "a INT,", "a ARRAY<INT", "a INT b INT", "a INT;"]


@pytest.mark.parametrize("ddl", VALID)
def test_schemas_spark_reads_are_accepted(spark: SparkSession, ddl: str) -> None:
    assert isinstance(StructType.fromDDL(ddl), StructType)
    assert check_ddl(ddl) == ddl


@pytest.mark.parametrize("ddl", INVALID)
def test_schemas_spark_refuses_are_refused(spark: SparkSession, ddl: str) -> None:
    with pytest.raises(Exception):  # noqa: B017 - Spark's parse error type varies
        StructType.fromDDL(ddl)
    with pytest.raises(DdlError):
        check_ddl(ddl)


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ('[ingest]\npayload_schema = "temp DOUBL"', "ingest.payload_schema"),
        ('[ingest]\ntrigger_interval = "0s"', "ingest.trigger_interval"),
        ('[nats]\nurl = "nats://h:4222"', "nats.url"),
        ('[cluster]\nreplicas = 3\n[[cluster.nodes]]\nname = "a"\nroute = "x"', "route"),
    ],
)
def test_check_config_names_the_bad_key(tmp_path: Path, section: str, key: str) -> None:
    config = tmp_path / "hub.toml"
    config.write_text(section + "\n")
    result = run_cli("hub_ingest", "-c", str(config), "check-config")
    assert result.returncode == 2, result.stderr
    assert key in result.stderr and result.stdout == ""


def test_check_config_says_a_good_config_is_fine(tmp_path: Path) -> None:
    config = tmp_path / "hub.toml"
    config.write_text('[ingest]\npayload_schema = "temp DOUBLE, unit STRING"\n')
    result = run_cli("hub_ingest", "-c", str(config), "check-config")
    assert (result.returncode, result.stdout) == (0, f"{config}: ok\n"), result.stderr
