"""The archive audit: planted duplicates and gaps are caught, reported drops explain gaps,
and files a killed batch left behind are not counted."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hub_ingest.audit import Gap, audit_archive, committed_files
from hub_ingest.localfleet import write_hub_toml
from tests.support.cluster import Hub, run_cli


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
        }
    )


def _write_archive(archive: Path, *tables: pa.Table) -> list[Path]:
    """Parquet files committed as batch 0 of a file sink's metadata log, as Spark writes it."""
    day = archive / "date=2026-11-20"
    day.mkdir(parents=True)
    files = []
    for i, table in enumerate(tables):
        files.append(day / f"part-{i:05d}.snappy.parquet")
        pq.write_table(table, files[-1])
    log = archive / "_spark_metadata"
    log.mkdir()
    lines = ["v1", *(json.dumps({"path": f.as_uri(), "action": "add"}) for f in files)]
    (log / "0").write_text("\n".join(lines))
    return files


def test_audit_catches_a_planted_duplicate_and_a_planted_gap(tmp_path: Path) -> None:
    """Device a: seq 4 twice, 6..7 missing; b's gap is one its heartbeat reported dropping."""
    beat = json.dumps({"streams": {"TELEMETRY": {"first_seq": 9, "dropped": 4}}}).encode()
    _write_archive(
        tmp_path,
        _rows("a", "FLEET_TELEMETRY", [1, 2, 3, 4, 5, 8, 9, 10]),
        _rows("a", "FLEET_TELEMETRY", [4]),
        _rows("b", "FLEET_TELEMETRY", [1, 2, 3, 4, 9, 10]),
        _rows("b", "FLEET_EVENTS", [1], [beat]),
    )
    # A batch killed mid-write leaves files outside the log, some of them empty.
    (tmp_path / "date=2026-11-20" / "part-99999.snappy.parquet").write_bytes(b"")
    pq.write_table(
        _rows("a", "FLEET_TELEMETRY", [11]), tmp_path / "date=2026-11-20" / "stray.parquet"
    )

    report = audit_archive(tmp_path)

    by_key = {(d.device_id, d.hub_stream): d for d in report.devices}
    a = by_key["a", "FLEET_TELEMETRY"]
    assert (a.rows, a.first_seq, a.last_seq, a.duplicates) == (9, 1, 10, 1)
    assert a.missing == (Gap(6, 7, explained=False),)
    b = by_key["b", "FLEET_TELEMETRY"]
    assert (b.duplicates, b.missing) == (0, (Gap(5, 8, explained=True),))
    assert b.ok and not a.ok and not report.ok


def test_metadata_log_compaction_and_deletes_are_followed(tmp_path: Path) -> None:
    """Files come from the newest .compact file and the batches after it, minus deletes."""
    day = tmp_path / "date=2026-11-20"
    day.mkdir(parents=True)
    names = ["old", "kept", "new", "gone"]
    for name in names:
        pq.write_table(_rows("a", "FLEET_TELEMETRY", [1]), day / f"{name}.parquet")
    log = tmp_path / "_spark_metadata"
    log.mkdir()

    def entry(name: str, action: str = "add") -> str:
        return json.dumps({"path": (day / f"{name}.parquet").as_uri(), "action": action})

    (log / "8").write_text("v1\n" + entry("old"))
    (log / "9.compact").write_text("v1\n" + entry("kept") + "\n" + entry("gone"))
    (log / "10").write_text("v1\n" + entry("new") + "\n" + entry("gone", "delete"))
    (log / ".11.tmp").write_text("v1\n" + entry("old"))

    assert [p.stem for p in committed_files(tmp_path)] == ["kept", "new"]


async def test_audit_cli_exit_codes_and_backlog(hub: Hub, tmp_path: Path) -> None:
    """`hub-ingest audit` exits 0 on a clean archive and 1 on a duplicate; --json reports the
    hub messages not archived yet."""
    await hub.register("a")
    archive = hub.config.ingest.archive
    _write_archive(archive, _rows("a", "FLEET_TELEMETRY", [1, 2, 3]))
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

    pq.write_table(_rows("a", "FLEET_TELEMETRY", [2]), archive / "date=2026-11-20" / "dup.parquet")
    log = archive / "_spark_metadata"
    (log / "1").write_text(
        "v1\n"
        + json.dumps(
            {"path": (archive / "date=2026-11-20" / "dup.parquet").as_uri(), "action": "add"}
        )
    )
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
    _write_archive(tmp_path, new, old, gappy)

    report = audit_archive(tmp_path)

    by_key = {(d.device_id, d.incarnation): d for d in report.devices}
    assert (by_key["a", "old"].rows, by_key["a", "old"].last_seq) == (20, 20)
    assert (by_key["a", "new"].rows, by_key["a", "new"].last_seq) == (25, 25)
    assert by_key["a", "old"].ok and by_key["a", "new"].ok
    assert by_key["b", "b2"].missing == (Gap(3, 3, explained=False),)
    (change,) = report.incarnation_changes
    assert (change.device_id, change.previous, change.incarnation) == ("a", "old", "new")
    assert change.first_hub_seq == 21
    assert not report.ok
