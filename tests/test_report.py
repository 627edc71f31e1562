"""``hub-ingest report``: a connected device, a cut one and one never seen; JSON, table, dot."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from edge_agent.protocol.units import parse_time
from hub_ingest.localfleet import write_hub_toml
from hub_ingest.registry import Registry
from hub_ingest.report import collect_report
from tests.support.cluster import Hub
from tests.support.waiting import eventually

SILENT_AFTER = 5.0  # heartbeats every second; a cut device crosses this within seconds


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str


async def hub_ingest(*args: str) -> Run:
    """The real CLI in a subprocess, without blocking the loop the test's agents run in."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hub_ingest",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(), err.decode())


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


async def _flags(hub: Hub) -> dict[str, list[str]]:
    devices = await (await Registry.open(hub.js)).list()
    report = await collect_report(hub.nc, hub.config, devices, silent_after=SILENT_AFTER)
    return {d.device_id: list(d.flags) for d in report.devices}


async def _stored(hub: Hub, stream: str, subject: str) -> bool:
    info = await hub.js.stream_info(stream, subjects_filter=subject)
    return bool(info.state.subjects)


async def test_report_flags_cut_and_never_seen_devices(hub: Hub, tmp_path: Path) -> None:
    """JSON, table and dot agree: `a` healthy, `b` silent since its cut, `c` never seen; exit 1."""
    a = await hub.device("a", heartbeat_interval="1s")
    b = await hub.device("b", heartbeat_interval="1s")
    await hub.register("c")
    now = datetime.now(UTC)
    for command_id, expires in (("c-live", now + timedelta(hours=1)), ("c-old", now)):
        envelope = {"id": command_id, "type": "ping", "args": {}, "issued_at": _iso(now)}
        await hub.js.publish(
            "cmd.c.ping", json.dumps({**envelope, "expires_at": _iso(expires)}).encode()
        )
    # A failed result for a command that has aged out of COMMANDS: done, failed, last error.
    result = {"command_id": "gone", "device_id": "a", "status": "error", "error": "disk full"}
    await a.js.publish("evt.a.result", json.dumps(result).encode())
    for subject in ("fleet.a.evt.a.result", "fleet.a.evt.a.heartbeat", "fleet.b.evt.b.heartbeat"):
        await eventually(
            lambda s=subject: _stored(hub, "FLEET_EVENTS", s), timeout=60, what=subject
        )

    b.proxy.cut()
    await b.wait_link(up=False)
    expected = {"a": [], "b": ["silent"], "c": ["never_seen"]}
    await eventually(lambda: _wait_flags(hub, expected), timeout=60, what=f"flags {expected}")

    hub_toml = write_hub_toml(hub.config, tmp_path / "hub.toml")
    dot = tmp_path / "fleet.dot"
    run = await hub_ingest(
        "-c", str(hub_toml), "report", "--json", "--dot", str(dot), "--silent-after", "5s"
    )
    assert run.code == 1, run.stderr
    _check_json(json.loads(run.stdout), expected)
    _check_dot(dot.read_text())
    table = await hub_ingest("-c", str(hub_toml), "report", "--silent-after", "5s")
    assert table.code == 1
    _check_table(table.stdout)


def _check_json(doc: dict[str, Any], expected: dict[str, list[str]]) -> None:
    assert doc["schema"] == "hub-ingest.report/1"
    assert doc["flagged"] is True
    assert doc["warnings"] == []
    devices = {d["device_id"]: d for d in doc["devices"]}
    assert list(devices) == ["a", "b", "c"]
    assert {k: d["flags"] for k, d in devices.items()} == expected
    links = {k: d["link_connected"] for k, d in devices.items()}
    assert links == {"a": True, "b": False, "c": False}
    da, db, dc = devices["a"], devices["b"], devices["c"]
    assert da["last_heartbeat_age_s"] < SILENT_AFTER
    assert db["last_heartbeat_age_s"] > SILENT_AFTER
    assert dc["last_heartbeat_at"] is None and dc["last_seen_s"] is None
    assert [s["stream"] for s in da["sources"]] == ["FLEET_TELEMETRY", "FLEET_EVENTS"]
    assert all(s["sourced"] and s["last_active_s"] is not None for s in da["sources"])
    # Never seen: the hub has no incarnation of its streams to mirror yet.
    assert all(not s["sourced"] and s["error"] == "no incarnation seen yet" for s in dc["sources"])
    assert da["incarnation"] is not None and da["incarnation_changed_at"] is None
    assert dc["incarnation"] is None and dc["incarnations"] == []
    assert da["commands"] == {"pending": 0, "expired": 0, "done": 1, "failed": 1}
    assert da["last_error"] == {"command_id": "gone", "status": "error", "error": "disk full"}
    assert dc["commands"] == {"pending": 1, "expired": 1, "done": 0, "failed": 0}
    assert db["commands"]["pending"] == 0 and db["last_error"] is None
    totals = doc["totals"]
    assert (totals["devices"], totals["connected"], totals["flagged"]) == (3, 1, 2)
    assert (totals["commands_pending"], totals["commands_failed"]) == (1, 1)


def _check_dot(graph: str) -> None:
    assert graph.startswith("digraph fleet {") and graph.rstrip().endswith("}")
    assert graph.count("{") == graph.count("}")
    edges = _edges(graph)
    for device, style in (("a", "solid"), ("b", "dashed")):
        for kind, aggregate in (("TELEMETRY", "FLEET_TELEMETRY"), ("EVENTS", "FLEET_EVENTS")):
            attrs = edges[(f"edge-{device}/{kind}", f"hub/{aggregate}")]
            assert f"style={style}" in attrs
            assert ("color=red" in attrs) == (device != "a")
    # c was never seen: the hub mirrors nothing of it yet, so no edge is drawn.
    assert not [edge for edge in edges if edge[0].startswith("edge-c/")]
    assert ("hub/FLEET_TELEMETRY", "archive") in edges
    assert ("hub/FLEET_EVENTS", "archive") in edges


def _check_table(text: str) -> None:
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    devices = lines[1 : lines.index("")]
    rows = {line.split()[0]: line for line in devices if not line.startswith(" ")}
    assert list(rows) == ["a", "b", "c"]
    assert rows["a"].split()[1] == "up" and "SILENT" not in rows["a"]
    assert rows["b"].split()[1] == "down" and rows["b"].endswith("SILENT")
    assert rows["c"].split()[2] == "never" and rows["c"].endswith("NEVER SEEN")
    assert "  > last error: command gone error: disk full" in devices
    assert "3 devices, 1 connected, 2 flagged" in text


async def test_report_is_healthy_without_commands_stream(hub: Hub, tmp_path: Path) -> None:
    """A fleet that is all heard from exits 0, even on a hub with no COMMANDS stream."""
    a = await hub.device("a", heartbeat_interval="1s")
    await eventually(lambda: _stored(hub, "FLEET_EVENTS", "fleet.a.evt.a.heartbeat"), timeout=60)
    await hub.js.delete_stream("COMMANDS")
    run = await hub_ingest(
        "-c", str(write_hub_toml(hub.config, tmp_path / "h.toml")), "report", "--json"
    )
    assert run.code == 0, run.stdout + run.stderr
    (device,) = json.loads(run.stdout)["devices"]
    assert device["device_id"] == a.id and device["flags"] == [] and device["link_connected"]
    assert device["commands"] == {"pending": 0, "expired": 0, "done": 0, "failed": 0}


async def test_report_says_when_link_state_is_unknown(hub: Hub) -> None:
    """An unreachable monitoring endpoint leaves link state unknown and says so; no crash."""
    await hub.register("c")
    report = await collect_report(
        hub.nc,
        hub.config,
        await (await Registry.open(hub.js)).list(),
        silent_after=60,
        monitor="http://127.0.0.1:9",
    )
    (device,) = report.devices
    assert device.link_connected is None
    assert device.flags == ("never_seen",)
    assert len(report.warnings) == 1 and report.warnings[0].startswith("link state unknown")


def test_parse_time_reads_jetstream_nanoseconds_and_envelope_forms() -> None:
    """Stream timestamps carry nanoseconds; envelopes may use ISO strings or epoch seconds."""
    expected = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    assert parse_time("2026-01-02T03:04:05.123456789Z") == expected
    assert parse_time("2026-01-02T03:04:05.123456+00:00") == expected
    assert parse_time(expected.timestamp()) == expected
    assert parse_time("soon") is None
    assert parse_time(None) is None


async def _wait_flags(hub: Hub, expected: dict[str, list[str]]) -> bool:
    return await _flags(hub) == expected


def _edges(graph: str) -> dict[tuple[str, str], str]:
    found: dict[tuple[str, str], str] = {}
    for m in re.finditer(r'^\s*"([^"]+)" -> "([^"]+)"(?: \[(.*)\])?;$', graph, re.MULTILINE):
        found[(m.group(1), m.group(2))] = m.group(3) or ""
    return found
