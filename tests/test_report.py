"""``hub-ingest report``: a connected device, a cut one and one never seen; JSON, table, dot."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from nats.js.api import RawStreamMsg

from edge_agent.protocol.envelope import supersedes
from edge_agent.protocol.units import parse_time
from hub_ingest.cli.report import render_table
from hub_ingest.commands.send import command_status
from hub_ingest.fleet.registry import Registry
from hub_ingest.local.fleet import stream_messages, write_hub_toml
from hub_ingest.report.collect import collect_report
from hub_ingest.report.flags import hub_gaps
from hub_ingest.report.model import (
    CommandCounts,
    CommandError,
    DeviceReport,
    FleetReport,
    SourceState,
)
from tests.support.cluster import Hub
from tests.support.commands import send_command
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
    lines = await hub_ingest("-c", str(hub_toml), "report", "--json-lines", "--silent-after", "5s")
    assert lines.code == 1, lines.stderr
    _check_json(_document(lines.stdout), expected)
    table = await hub_ingest("-c", str(hub_toml), "report", "--silent-after", "5s")
    assert table.code == 1
    _check_table(table.stdout)


def _document(text: str) -> dict[str, Any]:
    """The ``--json`` document put together from ``--json-lines`` output: the report's line,
    one per device, the summary's, in that order."""
    lines = [json.loads(line) for line in text.splitlines()]
    kinds = [line.pop("type") for line in lines]
    assert kinds == ["report", *["device"] * (len(lines) - 2), "summary"]
    head, *devices, summary = lines
    return {**head, "devices": devices, **summary}


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
    assert list(rows) == ["b", "c", "a"]  # flagged first
    assert rows["a"].split()[1] == "up" and "SILENT" not in rows["a"]
    assert rows["b"].split()[1] == "down" and rows["b"].endswith("SILENT")
    assert rows["c"].split()[2] == "never" and rows["c"].endswith("NEVER SEEN")
    assert "  > last error: command gone error: disk full" in devices
    assert "3 devices, 1 connected, 2 flagged" in text
    assert "SILENT: not heard from within --silent-after" in " ".join(lines)  # the legend


def test_table_keeps_long_ids_and_errors_whole_within_80_columns() -> None:
    """An id too long for its column gets a line of its own, an error is wrapped, never cut:
    both are what an operator copies to act on."""
    long_id = "refrigerated-trailer-0042-north-depot-lane-7"
    error = "exec: " + " ".join(f"/var/lib/app/step-{i}.sh failed: no space left" for i in range(6))
    device = DeviceReport(
        device_id=long_id,
        domain=f"edge-{long_id}",
        shard=0,
        link_connected=False,
        sources=(),
        last_heartbeat_at=None,
        last_heartbeat_age_s=None,
        last_seen_s=None,
        telemetry_dropped=None,
        dead_letters=None,
        commands=CommandCounts(done=1, failed=1),
        last_error=CommandError("c1", "error", error),
        flags=("never_seen",),
    )
    text = render_table(FleetReport("2026-11-23T00:00:00Z", 86400.0, (device,)))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert long_id in lines
    detail = " ".join(line.strip() for line in lines if line.startswith("    ") or "> " in line)
    assert f"last error: command c1 error: {error}" in detail


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


async def _results_at_hub(hub: Hub, device_id: str) -> int:
    info = await hub.js.stream_info(
        "FLEET_EVENTS", subjects_filter=f"fleet.{device_id}.evt.{device_id}.result"
    )
    return sum((info.state.subjects or {}).values())


def _counts_from_history(
    commands: list[RawStreamMsg], results: list[RawStreamMsg], device_id: str, now: datetime
) -> dict[str, Any]:
    """What the report must say, worked out from the whole history, as it used to be."""
    decisive: dict[str, dict[str, Any]] = {}
    anonymous: list[dict[str, Any]] = []
    for msg in results:
        body = json.loads(msg.data or b"{}")
        if msg.subject != f"fleet.{device_id}.evt.{device_id}.result":
            continue
        if body.get("device_id") not in (None, device_id):
            continue  # forged: counted for nobody
        body["_seq"] = msg.seq
        if body.get("command_id") is None:
            anonymous.append(body)
            continue
        seen = decisive.get(body["command_id"])
        if seen is None or supersedes(body["status"], seen["status"]):
            decisive[body["command_id"]] = body
    pending = expired = 0
    for msg in commands:
        envelope = json.loads(msg.data or b"{}")
        target = (msg.subject or "").split(".")[1]
        if target in (device_id, "all") and envelope["id"] not in decisive:
            if parse_time(envelope["expires_at"]) <= now:  # type: ignore[operator]
                expired += 1
            else:
                pending += 1
    answers = [*decisive.values(), *anonymous]
    failures = [r for r in answers if r["status"] != "ok"]
    last = max(failures, key=lambda r: r["_seq"], default=None)
    return {
        "commands": {
            "pending": pending,
            "expired": expired,
            "done": len(answers),
            "failed": len(failures),
        },
        "last_error": None if last is None else last["command_id"],
    }


async def _check_against_history(hub: Hub, reports: list[FleetReport]) -> None:
    commands = await stream_messages(hub.js, "COMMANDS")
    results = await stream_messages(hub.js, "FLEET_EVENTS")
    now = datetime.now(UTC)
    for report in reports:
        for device in report.devices:
            got = {
                "commands": asdict(device.commands),
                "last_error": device.last_error and device.last_error.command_id,
            }
            assert got == _counts_from_history(commands, results, device.device_id, now), (
                device.device_id
            )


async def test_report_and_status_agree_with_a_long_history(hub: Hub, tmp_path: Path) -> None:
    """Read through the command index, the report's counts equal what the whole history says,
    on the first call (index built), after more history (index caught up) and with two reports
    at once; ``command status`` finds old and broadcast commands and forged results."""
    a = await hub.device("a", heartbeat_interval="1s")
    await hub.register("c")
    pings = [await send_command(hub, "a", "ping") for _ in range(40)]
    refused = [await send_command(hub, "a", "exec", {"argv": ["rm", "-rf", "/"]}) for _ in range(3)]
    await send_command(hub, "all", "ping")
    for_c = await send_command(hub, "c", "ping")
    await send_command(hub, "c", "ping", ttl=-60)  # expired before it was sent
    await eventually(lambda: _at_least(hub, "a", 44), timeout=60, what="a's 44 results")
    # Another answer to a command already answered "ok" (it does not replace it), an answer
    # without a command id, and an answer in c's name to c's command (a forgery).
    extra = [
        {"command_id": pings[0].id, "device_id": "a", "status": "rejected", "error": "again"},
        {"command_id": None, "device_id": "a", "status": "error", "error": "no id"},
        {"command_id": for_c.id, "device_id": "c", "status": "ok", "seq": 1},
    ]
    for body in extra:
        await a.js.publish("evt.a.result", json.dumps(body).encode())
    await eventually(lambda: _at_least(hub, "a", 47), timeout=60, what="a's forged results")

    devices = await (await Registry.open(hub.js)).list()
    first = await collect_report(hub.nc, hub.config, devices, silent_after=60)
    await _check_against_history(hub, [first])
    by_id = {d.device_id: d for d in first.devices}
    assert asdict(by_id["a"].commands) == {"pending": 0, "expired": 0, "done": 45, "failed": 4}
    assert asdict(by_id["c"].commands) == {"pending": 2, "expired": 1, "done": 0, "failed": 0}
    assert by_id["a"].forged_events == 1
    assert any(w.startswith("device a sent 1 event(s) claiming another") for w in first.warnings)

    for _ in range(20):
        await send_command(hub, "a", "ping")
    later = await send_command(hub, "all", "ping")
    await eventually(lambda: _at_least(hub, "a", 68), timeout=60, what="a's next 21 results")
    twice = await asyncio.gather(
        *(collect_report(hub.nc, hub.config, devices, silent_after=60) for _ in range(2))
    )
    await _check_against_history(hub, list(twice))
    assert asdict(twice[0].devices[0].commands)["done"] == 66

    status = await command_status(hub.js, pings[1].id, devices)
    assert status.per_device() == {"a": "ok"} and status.subject == "cmd.a.ping"
    assert (await command_status(hub.js, refused[0].id, devices)).per_device() == {"a": "rejected"}
    assert (await command_status(hub.js, later.id, devices)).per_device() == {
        "a": "ok",
        "c": "pending",
    }
    hub_toml = write_hub_toml(hub.config, tmp_path / "hub.toml")
    run = await hub_ingest("-c", str(hub_toml), "command", "status", for_c.id, "--json")
    assert run.code == 1, run.stderr  # c has not answered: exit 1, as `send --wait`
    body = json.loads(run.stdout)
    assert body["command"]["id"] == for_c.id
    assert body["devices"] == {"c": {"status": "pending", "result": None}}
    assert body["forged"] == ["a: evt.a.result naming device 'c'"]
    repeat = await hub_ingest("-c", str(hub_toml), "command", "status", pings[0].id, "--json")
    assert json.loads(repeat.stdout)["devices"]["a"]["status"] == "ok"
    assert json.loads(repeat.stdout)["devices"]["a"]["result"]["output"]["pong"] is True


async def _at_least(hub: Hub, device_id: str, count: int) -> bool:
    return await _results_at_hub(hub, device_id) >= count


async def _last_seq(hub: Hub, stream: str, seq: int) -> bool:
    return (await hub.js.stream_info(stream)).state.last_seq >= seq


def test_skips_up_to_the_drops_the_device_reports_are_its_budgets() -> None:
    def source(stream: str, skipped: int | None) -> SourceState:
        return SourceState(f"FLEET_{stream}", stream, True, 0, 0.0, None, skipped)

    beat = {"streams": {"TELEMETRY": {"dropped": 40}}}
    sources = [source("TELEMETRY", 30), source("EVENTS", None)]
    assert hub_gaps(sources, beat) == {}
    assert hub_gaps([source("TELEMETRY", 41)], beat) == {"TELEMETRY": (41, 40)}
    assert hub_gaps([source("EVENTS", 1)], beat) == {"EVENTS": (1, 0)}
    assert hub_gaps([source("TELEMETRY", 1)], None) == {"TELEMETRY": (1, 0)}
