"""The archive audit: planted duplicates and gaps are caught, reported drops explain gaps,
and files a killed batch left behind are not counted."""

from __future__ import annotations

import datetime
import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hub_ingest.archive import table
from hub_ingest.archive.audit import Gap, audit_archive
from hub_ingest.core.config import IngestConfig, parse_hub_config
from hub_ingest.local.fleet import write_hub_toml
from tests.support.cluster import Hub, run_cli

DAY = datetime.date(2026, 11, 20)


def _rows(
    device_id: str,
    stream: str,
    seqs: list[int],
    payloads: list[bytes] | None = None,
    incarnation: str = "i1",
) -> pa.Table:
    subject = "evt.x.heartbeat" if stream == "FLEET_EVENTS" else "tele.temp"
    return pa.table(
        {
            "device_id": [device_id] * len(seqs),
            "incarnation": [incarnation] * len(seqs),
            "subject": [subject.replace("x", device_id)] * len(seqs),
            "device_seq": pa.array(seqs, pa.int64()),
            "hub_stream": [stream] * len(seqs),
            "hub_seq": pa.array(range(1, len(seqs) + 1), pa.int64()),
            "payload": pa.array(payloads or [b"{}"] * len(seqs), pa.binary()),
            "date": pa.array([DAY] * len(seqs), pa.date32()),
        }
    )


def _config(tmp_path: Path) -> IngestConfig:
    return parse_hub_config({"state_dir": str(tmp_path)}).ingest


def _day_dir(config: IngestConfig) -> Path:
    return config.archive / "data" / f"batch-{uuid.uuid4().hex[:8]}" / f"day={DAY}"


def _write_archive(config: IngestConfig, *tables: pa.Table) -> list[Path]:
    """Parquet files committed to the archive table as one batch, as the ingest does."""
    day = _day_dir(config)
    day.mkdir(parents=True)
    files = []
    for i, rows in enumerate(tables):
        files.append(day / f"part-{i:05d}.snappy.parquet")
        pq.write_table(rows, files[-1])
    archive = table.create_or_evolve(config, tables[0].schema)
    seqs = {}
    for rows in tables:
        for stream in set(rows["hub_stream"].to_pylist()):
            mine = pc.filter(rows["hub_seq"], pc.equal(rows["hub_stream"], stream))
            seqs[stream] = max(seqs.get(stream, 0), pc.max(mine).as_py())
    table.commit(archive, [f"file://{f}" for f in files], seqs, {}, {})
    return files


def test_audit_catches_a_planted_duplicate_and_a_planted_gap(tmp_path: Path) -> None:
    """Device a: seq 4 twice, 6..7 missing; b's gap is one its heartbeat reported dropping."""
    beat = json.dumps({"streams": {"TELEMETRY": {"first_seq": 9, "dropped": 4}}}).encode()
    config = _config(tmp_path)
    _write_archive(
        config,
        _rows("a", "FLEET_TELEMETRY", [1, 2, 3, 4, 5, 8, 9, 10]),
        _rows("a", "FLEET_TELEMETRY", [4]),
        _rows("b", "FLEET_TELEMETRY", [1, 2, 3, 4, 9, 10]),
        _rows("b", "FLEET_EVENTS", [1], [beat]),
    )
    # A batch killed mid-write leaves files no snapshot lists, some of them empty.
    stray = _day_dir(config)
    stray.mkdir(parents=True)
    (stray / "part-99999.snappy.parquet").write_bytes(b"")
    pq.write_table(_rows("a", "FLEET_TELEMETRY", [11]), stray / "stray.parquet")

    report = audit_archive(config)

    by_key = {(d.device_id, d.hub_stream): d for d in report.devices}
    a = by_key["a", "FLEET_TELEMETRY"]
    assert (a.rows, a.first_seq, a.last_seq, a.duplicates) == (9, 1, 10, 1)
    assert a.missing == (Gap(6, 7, explained=False),)
    b = by_key["b", "FLEET_TELEMETRY"]
    assert (b.duplicates, b.missing) == (0, (Gap(5, 8, explained=True, reason="dropped"),))
    assert b.ok and not a.ok and not report.ok


async def test_audit_cli_exit_codes_and_backlog(hub: Hub, tmp_path: Path) -> None:
    """`hub-ingest audit` exits 0 on a clean archive and 1 on a duplicate; --json reports the
    hub messages not archived yet."""
    await hub.register("a")
    _write_archive(hub.config.ingest, _rows("a", "FLEET_TELEMETRY", [1, 2, 3]))
    config = write_hub_toml(hub.config, tmp_path / "hub.toml")

    clean = run_cli("hub_ingest", "audit", "--config", str(config), "--json")
    assert clean.returncode == 0, clean.stderr
    doc = json.loads(clean.stdout)
    assert doc["ok"] is True
    assert doc["devices"][0]["rows"] == 3
    assert {s["stream"]: s["unarchived"] for s in doc["streams"]} == {
        "FLEET_EVENTS": 0,
        "FLEET_TELEMETRY": 0,
    }

    _write_archive(hub.config.ingest, _rows("a", "FLEET_TELEMETRY", [2]))
    dirty = run_cli("hub_ingest", "audit", "--config", str(config))
    assert dirty.returncode == 1
    assert "NOT ok" in dirty.stdout


def test_audit_checks_each_incarnation_from_its_own_sequence_1(tmp_path: Path) -> None:
    """A re-imaged device's new incarnation restarts at 1: each one is complete on its own,
    the change is reported, and a gap in the new incarnation is still caught."""
    old = _rows("a", "FLEET_TELEMETRY", list(range(1, 21)), incarnation="old")
    new = _rows("a", "FLEET_TELEMETRY", list(range(1, 26)), incarnation="new")
    new = new.set_column(5, "hub_seq", pa.array(range(21, 46), pa.int64()))
    gappy = _rows("b", "FLEET_TELEMETRY", [1, 2, 4], incarnation="b2")
    config = _config(tmp_path)
    _write_archive(config, new, old, gappy)

    report = audit_archive(config)

    by_key = {(d.device_id, d.incarnation): d for d in report.devices}
    assert (by_key["a", "old"].rows, by_key["a", "old"].last_seq) == (20, 20)
    assert (by_key["a", "new"].rows, by_key["a", "new"].last_seq) == (25, 25)
    assert by_key["a", "old"].ok and by_key["a", "new"].ok
    assert by_key["b", "b2"].missing == (Gap(3, 3, explained=False),)
    (change,) = report.incarnation_changes
    assert (change.device_id, change.previous, change.incarnation) == ("a", "old", "new")
    assert change.first_hub_seq == 21
    assert not report.ok


def test_a_packed_devices_gaps_are_explained_by_its_readings_not_its_packs(
    tmp_path: Path,
) -> None:
    """With ``hub.pack`` the heartbeat's TELEMETRY counts packs (pack 40 is not reading 40)
    and READINGS counts readings: only READINGS' drops explain missing readings."""
    packs = {"first_seq": 40, "dropped": 39, "packed": True, "incarnation": "i1"}
    readings = {"first_seq": 9, "dropped": 8, "incarnation": "i1"}
    beat = json.dumps({"streams": {"TELEMETRY": packs, "READINGS": readings}}).encode()
    config = _config(tmp_path)
    _write_archive(
        config,
        _rows("b", "FLEET_TELEMETRY", [1, 2, 3, 4, 9, 10, 20, 21]),
        _rows("b", "FLEET_EVENTS", [1], [beat]),
    )

    (b,) = [d for d in audit_archive(config).devices if d.hub_stream == "FLEET_TELEMETRY"]

    assert b.missing == (
        Gap(5, 8, explained=True, reason="dropped"),
        Gap(11, 19, explained=False),
    )
