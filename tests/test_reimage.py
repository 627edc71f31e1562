"""A re-imaged device (same id and key, empty store and agent state) is a new incarnation:
the hub notices it by itself, keeps the old incarnation's data, collects the new one from
sequence 1, and no command whose result the hub has runs again.

Most devices here pack their telemetry, as the product does by default (`hub.pack`): a new
incarnation's packs restart with its readings at sequence 1; two re-images in a row send
reading by reading, the other path."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from edge_agent.commands.executor import CONSUMER
from edge_agent.island.streams import bound_consumer
from edge_agent.protocol.names import INCARNATION, command_stream, island_consumer
from edge_agent.protocol.pack import PACK_SUBJECT
from hub_ingest.archive.audit import audit_archive
from hub_ingest.commands.send import command_status
from hub_ingest.fleet.registry import Registry
from hub_ingest.local.fleet import write_hub_toml
from hub_ingest.report.collect import collect_report
from tests.support.cluster import (
    PACKED,
    Device,
    Hub,
    hub_readings,
    run_cli,
    start_hub,
    stream_has,
    stream_messages,
)
from tests.support.commands import command_fence, counter_program, runs, send_command
from tests.support.ingest import ingest_config, run_once, telemetry
from tests.support.waiting import eventually

TIMEOUT = 60


async def _publish(device: Device, values: range) -> None:
    for i in values:
        await device.js.publish("tele.temp", json.dumps({"t": i}).encode())


async def _temps(hub: Hub) -> list[int]:
    """Device a's readings in the telemetry aggregate, in its order."""
    return [json.loads(d)["t"] for d in await hub_readings(hub.js, "a", "tele.temp")]


async def _subjects(hub: Hub) -> set[str]:
    return {m.subject or "" for m in await stream_messages(hub.js, "FLEET_TELEMETRY")}


async def _confirmed(hub: Hub, device_id: str, seq: int) -> bool:
    """Whether the consumer the island's command mirror reads through has its ack floor at
    `seq` (the island told the hub it holds every command up to it); the device is in the
    first shard."""
    info = await hub.js.consumer_info(command_stream(device_id), island_consumer(0))
    return (info.ack_floor.stream_seq if info.ack_floor else 0) >= seq


async def _readings(hub: Hub, device_id: str, count: int) -> bool:
    return len(await hub_readings(hub.js, device_id, "tele.temp")) >= count


async def _results(hub: Hub, command_id: str) -> list[dict[str, Any]]:
    msgs = await stream_messages(hub.js, "FLEET_EVENTS")
    bodies = [json.loads(m.data or b"{}") for m in msgs if (m.subject or "").endswith(".result")]
    return [b for b in bodies if b.get("command_id") == command_id]


async def _consumed(device: Device, seq: int) -> bool:
    """Whether the agent's consumer on its island's command mirror acknowledged `seq`."""
    info = await device.js.consumer_info("COMMANDS", CONSUMER)
    return (info.ack_floor.stream_seq if info.ack_floor else 0) >= seq


async def _incarnations(hub: Hub, device_id: str, count: int) -> list[str]:
    device = await (await Registry.open(hub.js)).get(device_id)
    ids = [i.id for i in device.incarnations if i.stream == "TELEMETRY"]
    return ids if len(ids) >= count else []


@pytest.mark.spark
async def test_reimaged_device_loses_nothing_and_runs_no_command_twice(
    hub: Hub, spark: SparkSession, tmp_path: Path
) -> None:
    """Readings, events and a command result before the re-image, readings after: every one
    is archived once under its incarnation, audit is clean and names the change, and the old
    command is answered by the new incarnation without running."""
    counter = counter_program(tmp_path)
    ran = tmp_path / "runs"
    commands = {"commands": {"exec_allow": [[*counter, "*"]]}}
    a = await hub.device("a", sections=PACKED | commands)
    await _publish(a, range(20))
    before = await send_command(hub, "a", "exec", {"argv": [*counter, str(ran), "0"]})
    await eventually(lambda: _results(hub, before.id), timeout=TIMEOUT, what="first result")
    await eventually(lambda: _readings(hub, "a", 20), timeout=TIMEOUT, what="20 readings")
    # The island's mirror has confirmed the command to the hub: the re-imaged island's fresh
    # mirror starts after it, so only fast resume brings it to the new incarnation.
    await eventually(lambda: _confirmed(hub, "a", 1), timeout=TIMEOUT, what="confirmed")
    (old,) = await _incarnations(hub, "a", 1)

    await a.reimage()
    await _publish(a, range(20, 45))
    old_, new = await eventually(lambda: _incarnations(hub, "a", 2), timeout=TIMEOUT)
    assert old_ == old != new
    # Commands sent from here on are past the new incarnation's fence: they run.
    after = await send_command(hub, "a", "ping")

    await eventually(lambda: _readings(hub, "a", 45), timeout=TIMEOUT, what="45 readings")
    assert await _temps(hub) == [*range(45)]
    assert await _subjects(hub) == {f"fleet.a.{PACK_SUBJECT}"}, "in packs only"
    ok = await eventually(lambda: _results(hub, after.id), timeout=TIMEOUT, what="new result")
    assert ok[0]["status"] == "ok"
    answers = await eventually(
        lambda: _has(_results(hub, before.id), 2), timeout=TIMEOUT, what="old command answered"
    )
    assert [r["status"] for r in answers] == ["ok", "rejected"]
    assert "device re-imaged" in answers[1]["error"] and "not run" in answers[1]["error"]
    assert runs(ran) == 1
    registry = await Registry.open(hub.js)
    status = await command_status(hub.js, before.id, await registry.list())
    assert status.results["a"]["status"] == "ok"
    fleet = await collect_report(hub.nc, hub.config, await registry.list(), silent_after=3600)
    (device,) = fleet.devices
    # The re-imaged device's "not run" answer does not hide the result of the run.
    assert (device.commands.failed, device.last_error) == (0, None)
    assert device.incarnation_changed_at is not None

    config = ingest_config(hub)
    await run_once(spark, config)
    rows = telemetry(config).to_pylist()
    keys = sorted((r["incarnation"], r["device_seq"], json.loads(r["payload"])["t"]) for r in rows)
    expected = [(old, s, s - 1) for s in range(1, 21)] + [(new, s, s + 19) for s in range(1, 26)]
    assert keys == sorted(expected)
    report = audit_archive(config.ingest)
    assert report.ok, report.to_dict()
    changes = {
        (c.device_id, c.hub_stream, c.previous, c.incarnation) for c in report.incarnation_changes
    }
    assert ("a", "FLEET_TELEMETRY", old, new) in changes


async def _has(results: Any, count: int) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = await results
    return got if len(got) >= count else []


async def test_reimage_while_the_link_is_down(hub: Hub) -> None:
    """Re-imaged and filled while cut off: when the link returns, the hub mirrors the new
    incarnation from sequence 1 and keeps the old one's readings."""
    a = await hub.device("a", sections=PACKED)
    await _publish(a, range(10))
    await eventually(lambda: _readings(hub, "a", 10), timeout=TIMEOUT, what="10 readings")
    a.proxy.cut()
    await a.wait_link(up=False)
    await a.reimage()
    await _publish(a, range(10, 30))
    assert await hub_readings(hub.js, "a", "tele.temp") == [
        json.dumps({"t": i}).encode() for i in range(10)
    ]
    a.proxy.restore()
    await eventually(lambda: _readings(hub, "a", 30), timeout=TIMEOUT, what="30 readings")
    values = await _temps(hub)
    assert values == [*range(30)]
    assert len(await _incarnations(hub, "a", 2)) == 2
    assert await _subjects(hub) == {f"fleet.a.{PACK_SUBJECT}"}, "in packs only"


async def test_an_island_naming_an_unusable_incarnation_holds_up_no_other_device(
    hub: Hub,
) -> None:
    """An island names its streams' incarnation itself. One that cannot be part of a hub
    stream's name ("x.y", as a hostile or damaged island might) is refused and flagged; a
    device that links after it is mirrored as ever (the provisioning pass that would have
    made the bad mirror failed for the whole fleet, round after round). The agent, started
    again, takes back the id of its hub consumer (it crashed on the id before), and the flag
    clears with nothing doubled."""
    b = await hub.device("b")
    await _publish(b, range(2))
    await eventually(lambda: _readings(hub, "b", 2), timeout=TIMEOUT, what="b's 2 readings")

    async def rebound() -> bool:  # the agent's last change to its streams until it restarts
        return await bound_consumer(b.js) == island_consumer(0)

    await eventually(rebound, timeout=TIMEOUT, what="b's command mirror on its shard's consumer")
    before = {s: (await b.js.stream_info(s)).config.metadata for s in ("TELEMETRY", "EVENTS")}
    for name in ("TELEMETRY", "EVENTS"):
        config = (await b.js.stream_info(name)).config
        config.metadata = {**(config.metadata or {}), INCARNATION: "x.y"}
        await b.js.update_stream(config)
    b.proxy.cut()  # its next link is a new one, which the watcher asks about at once
    await b.wait_link(up=False)
    b.proxy.restore()
    await b.wait_link()

    c = await hub.device("c")
    await _publish(c, range(3))
    await eventually(lambda: _readings(hub, "c", 3), timeout=TIMEOUT, what="c's 3 readings")
    b_record = await (await Registry.open(hub.js)).get("b")
    assert "x.y" not in {i.id for i in b_record.incarnations}
    flags, warnings = await _refusals(hub, "b")
    assert flags == ["incarnation_refused"]
    assert len(warnings) == 2 and all("'x.y'" in w and "letters" in w for w in warnings)

    await b.stop()
    await b.start()
    after = {s: (await b.js.stream_info(s)).config.metadata for s in ("TELEMETRY", "EVENTS")}
    assert after == before
    await _publish(b, range(2, 4))
    await eventually(lambda: _readings(hub, "b", 4), timeout=TIMEOUT, what="b's 4 readings")

    async def cleared() -> bool:
        return await _refusals(hub, "b") == ([], [])

    await eventually(cleared, timeout=TIMEOUT, what="b's flag cleared")
    bodies = await hub_readings(hub.js, "b", "tele.temp")
    assert sorted(json.loads(d)["t"] for d in bodies) == [0, 1, 2, 3]


async def _refusals(hub: Hub, device_id: str) -> tuple[list[str], list[str]]:
    """The device's flags of refusal in the report, and its warnings of them."""
    devices = await (await Registry.open(hub.js)).list()
    report = await collect_report(hub.nc, hub.config, devices, silent_after=3600)
    (line,) = [d for d in report.devices if d.device_id == device_id]
    refused = [f for f in line.flags if f == "incarnation_refused"]
    assert bool(refused) == bool(line.to_dict()["refused"])
    warnings = [w for w in report.warnings if w.startswith(f"device {device_id}: the hub does not")]
    return refused, warnings


async def test_a_device_reimaged_past_the_limit_is_flagged_and_taken_once_it_is_raised(
    hub: Hub, tmp_path: Path
) -> None:
    """Each incarnation costs the hub a mirror a stream for good: a device whose store is wiped
    at every boot (or a hostile one) would grow the hub's streams without end. Past
    ``server.max_incarnations`` a new one is refused, the report flags the device and says
    why, and its readings wait on the island; raised, the hub takes it and they arrive."""
    hub.config = replace(hub.config, server=replace(hub.config.server, max_incarnations=1))
    await hub.stop_watching()
    hub.start_watch()
    a = await hub.device("a")
    await _publish(a, range(2))
    await eventually(lambda: _readings(hub, "a", 2), timeout=TIMEOUT, what="a's 2 readings")
    streams_before = len(await hub.js.streams_info())
    await a.reimage()
    await _publish(a, range(2, 5))

    async def refused() -> bool:
        return (await _refusals(hub, "a"))[0] == ["incarnation_refused"]

    await eventually(refused, timeout=TIMEOUT, what="a flagged")
    _, warnings = await _refusals(hub, "a")
    assert len(warnings) == 2 and all("server.max_incarnations" in w for w in warnings)
    b = await hub.device("b")  # the fleet goes on
    await _publish(b, range(1))
    await eventually(lambda: _readings(hub, "b", 1), timeout=TIMEOUT, what="b's reading")
    assert len(await hub_readings(hub.js, "a", "tele.temp")) == 2
    assert len(await hub.js.streams_info()) == streams_before + 3  # b's: no mirror for a's new
    audit = run_cli(
        "hub_ingest", "audit", "--config", str(write_hub_toml(hub.config, tmp_path / "hub.toml"))
    )
    assert audit.returncode == 1, audit.stderr  # the archive cannot see what a's island holds
    assert "a: the hub does not take its TELEMETRY" in audit.stdout

    hub.config = replace(hub.config, server=replace(hub.config.server, max_incarnations=2))
    await hub.stop_watching()
    hub.start_watch()
    await eventually(lambda: _readings(hub, "a", 5), timeout=TIMEOUT, what="a's 5 readings")
    assert await _refusals(hub, "a") == ([], [])


async def test_two_reimages_in_a_row(hub: Hub) -> None:
    """Three incarnations, each collected from its sequence 1; nothing lost or doubled.

    (What a store held that never left the device is gone with it: each re-image here comes
    after the hub has the readings, as it would for a device re-imaged in the field.)"""
    a = await hub.device("a")
    await _publish(a, range(5))
    await eventually(lambda: _readings(hub, "a", 5), timeout=TIMEOUT, what="5 readings")
    await a.reimage()
    await _publish(a, range(5, 12))
    await eventually(lambda: _readings(hub, "a", 12), timeout=TIMEOUT, what="12 readings")
    await a.reimage()
    await _publish(a, range(12, 20))
    await eventually(lambda: _readings(hub, "a", 20), timeout=TIMEOUT, what="20 readings")
    assert len(await _incarnations(hub, "a", 3)) == 3
    values = await _temps(hub)
    assert sorted(values) == [*range(20)]


async def test_lost_agent_state_with_the_store_kept_runs_no_command_again(
    hub: Hub, tmp_path: Path
) -> None:
    """Only the agent's SQLite file is lost (same incarnation): nothing its island already held
    runs again (the fence covers what the island's consumer would hand out again); a command
    sent afterwards runs."""
    counter = counter_program(tmp_path)
    ran = tmp_path / "runs"
    commands = {"commands": {"exec_allow": [[*counter, "*"]]}}
    a = await hub.device("a", sections=PACKED | commands)
    before = await send_command(hub, "a", "exec", {"argv": [*counter, str(ran), "0"]})
    await eventually(lambda: _results(hub, before.id), timeout=TIMEOUT, what="first result")
    # Through the mirror: the other order is the next test's.
    await eventually(lambda: _consumed(a, 1), timeout=TIMEOUT, what="the mirror's copy")

    await a.stop()
    for path in a.config.agent.state_dir.glob(f"{a.config.agent.database.name}*"):
        path.unlink()
    await a.start()

    assert await eventually(lambda: command_fence(a), timeout=TIMEOUT, what="fence") >= 1
    after = await send_command(hub, "a", "exec", {"argv": [*counter, str(ran), "0"]})
    (result,) = await eventually(lambda: _results(hub, after.id), timeout=TIMEOUT)
    assert result["status"] == "ok"
    assert [r["status"] for r in await _results(hub, before.id)] == ["ok"]
    assert runs(ran) == 2  # `before` once, `after` once


async def test_lost_agent_state_after_fast_resume_runs_no_command_again(
    hub: Hub, tmp_path: Path
) -> None:
    """Fast resume runs a command the island's mirror does not hold yet (the hub consumer the
    mirror reads through is paused here; after a cut a mirror lags 10-40 s), then the agent's
    SQLite file is lost: the fence covers what the island's ``EVENTS`` answered, so the
    mirror's later copy is answered without running. An answer an app on the device forged
    fences off no command the hub has not issued yet."""
    counter = counter_program(tmp_path)
    ran = tmp_path / "runs"
    commands = {"commands": {"exec_allow": [[*counter, "*"]]}}
    a = await hub.device("a", sections=PACKED | commands)
    await hub.js.pause_consumer(command_stream("a"), island_consumer(0), "2100-01-01T00:00:00Z")
    a.proxy.cut()
    await a.wait_link(up=False)
    before = await send_command(hub, "a", "exec", {"argv": [*counter, str(ran), "0"]})
    a.proxy.restore()
    await eventually(lambda: _results(hub, before.id), timeout=TIMEOUT, what="first result")
    assert not await stream_has(a.js, "COMMANDS", "cmd.a.>")  # fast resume ran it
    forged = {"command_id": "forged", "device_id": "a", "status": "ok", "seq": 10**9}
    await a.js.publish("evt.a.result", json.dumps(forged).encode())

    await a.stop()
    for path in a.config.agent.state_dir.glob(f"{a.config.agent.database.name}*"):
        path.unlink()
    await a.start()

    assert await eventually(lambda: command_fence(a), timeout=TIMEOUT, what="fence") == 1
    await hub.js.resume_consumer(command_stream("a"), island_consumer(0))
    await eventually(lambda: stream_has(a.js, "COMMANDS", "cmd.a.exec"), timeout=TIMEOUT)
    after = await send_command(hub, "a", "exec", {"argv": [*counter, str(ran), "0"]})
    (result,) = await eventually(lambda: _results(hub, after.id), timeout=TIMEOUT)
    assert result["status"] == "ok"
    statuses = await eventually(lambda: _statuses(hub, before.id, 2), timeout=TIMEOUT)
    assert statuses == ["ok", "rejected"]  # the mirror's copy answered, not run
    assert runs(ran) == 2  # `before` once, `after` once


async def _statuses(hub: Hub, command_id: str, count: int) -> list[str]:
    statuses = [r["status"] for r in await _results(hub, command_id)]
    return statuses if len(statuses) >= count else []


async def test_the_watch_command_mirrors_a_new_device_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    """`hub-ingest watch` as its unit runs it: a device's first incarnation is mirrored (its
    readings reach the aggregate), and SIGTERM ends it with exit code 0."""
    hub = await start_hub(tmp_path, watching=False)
    watch = None
    try:
        config = write_hub_toml(hub.config, tmp_path / "hub.toml")
        log = tmp_path / "watch.log"
        with log.open("wb") as out:
            watch = subprocess.Popen(
                [sys.executable, "-m", "hub_ingest", "-c", str(config), "watch"],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        a = await hub.device("a")
        await _publish(a, range(3))
        await eventually(lambda: _readings(hub, "a", 3), timeout=TIMEOUT, what="3 readings")
        watch.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(watch.wait, 30)
        output = log.read_text()
        assert code == 0, output
        assert "incarnation_first_seen" in output
    finally:
        if watch is not None and watch.poll() is None:
            watch.kill()
            watch.wait()
        await hub.close()
