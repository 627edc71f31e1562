"""Disk budgets under pressure: what telemetry's budget forces out is counted, never silent,
and never costs an event or a result."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from edge_agent.core.config import StreamBudget
from edge_agent.island.streams import reconcile
from edge_agent.outbox.store import Outbox
from edge_agent.protocol.errors import StoreTrouble
from edge_agent.status.health import collect_status
from hub_ingest.fleet.registry import Registry
from hub_ingest.report.collect import collect_report
from tests.support.cluster import Hub, run_cli, write_agent_config
from tests.support.waiting import RESUME_TIMEOUT, eventually

READINGS, NOTES, BEFORE = 2000, 100, 10


async def test_telemetry_overflow_counted_events_intact(hub: Hub, tmp_path: Path) -> None:
    """2,000 readings into a 64 KiB telemetry budget while the link is down, with 100 events
    in between: the oldest readings go, status, heartbeat and the hub report count exactly
    how many, and every event reaches the hub. The hub's copy, which had the first ten,
    skips the rest of what went: the device's drops explain it, so nothing is flagged."""
    budgets = {"telemetry": {"max_bytes": "64KiB"}, "events": {"max_bytes": "4MiB"}}
    a = await hub.device(
        "a", sections={"streams": budgets}, heartbeat_interval="1s", register_when_ready=True
    )
    for i in range(BEFORE):
        await a.js.publish("tele.temp", json.dumps({"i": i}).encode())
    await eventually(
        lambda: _count(hub, "FLEET_TELEMETRY", "fleet.a.tele.>", BEFORE),
        timeout=RESUME_TIMEOUT,
        what=f"the first {BEFORE} readings at the hub",
    )
    a.proxy.cut()
    await a.wait_link(up=False)
    for i in range(READINGS):
        await a.js.publish("tele.temp", json.dumps({"i": i, "pad": "x" * 150}).encode())
        if i % (READINGS // NOTES) == 0:
            await a.js.publish("evt.a.note", str(i).encode())

    status = await collect_status(a.config)
    tele, events = status.streams["TELEMETRY"], status.streams["EVENTS"]
    assert tele.bytes <= 64 * 1024 and tele.dropped > 0
    assert tele.dropped + tele.messages == BEFORE + READINGS == tele.last_seq
    assert events.dropped == 0
    notes = await a.js.stream_info("EVENTS", subjects_filter="evt.a.note")
    assert sum((notes.state.subjects or {}).values()) == NOTES

    config = write_agent_config(a, tmp_path / "agent.toml")
    cli = await asyncio.to_thread(run_cli, "edge_agent", "-c", str(config), "status", "--json")
    assert json.loads(cli.stdout)["streams"]["TELEMETRY"]["dropped"] == tele.dropped

    a.proxy.restore()

    async def reported() -> bool:
        devices = await (await Registry.open(hub.js)).list()
        report = await collect_report(hub.nc, hub.config, devices, silent_after=60)
        return report.devices[0].telemetry_dropped == tele.dropped

    await eventually(reported, timeout=RESUME_TIMEOUT, what="drops in the hub report")
    # The hub got exactly what had crossed and what the budget kept.
    await eventually(
        lambda: _count(hub, "FLEET_TELEMETRY", "fleet.a.tele.>", BEFORE + tele.messages),
        timeout=RESUME_TIMEOUT,
        what=f"{BEFORE} + {tele.messages} kept readings at the hub",
    )
    await eventually(
        lambda: _count(hub, "FLEET_EVENTS", "fleet.a.evt.a.note", NOTES),
        timeout=RESUME_TIMEOUT,
        what="every event at the hub",
    )
    devices = await (await Registry.open(hub.js)).list()
    (device,) = (await collect_report(hub.nc, hub.config, devices, silent_after=60)).devices
    telemetry = next(s for s in device.sources if s.device_stream == "TELEMETRY")
    assert telemetry.skipped == tele.dropped - BEFORE and "hub_gap" not in device.flags


async def _count(hub: Hub, stream: str, subject: str, expected: int) -> bool:
    info = await hub.js.stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values()) == expected


async def test_full_island_store_holds_rows_in_the_outbox_until_space_returns(
    hub: Hub, tmp_path: Path
) -> None:
    """A real full disk under the island: its writes fail (and JetStream stays failed until
    a restart), so the outbox keeps every row and status says so; once space returns the
    agent restarts its island and every row arrives once."""
    store = hub.root / "full" / "jetstream"  # the device's default island.store_dir
    store.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(store)], check=True)
    try:
        a = await hub.device("full")
        assert a.agent is not None and a.agent.outbox is not None
        outbox = a.agent.outbox
        ballast = store / "ballast"
        with ballast.open("wb") as fill, contextlib.suppress(OSError):
            while True:
                fill.write(b"\0" * 65536)
                fill.flush()
        for i in range(NOTES):
            await outbox.append("evt.full.note", str(i).encode())
        config = write_agent_config(a, tmp_path / "agent.toml")

        async def held() -> dict[str, Any] | None:
            result = await asyncio.to_thread(
                run_cli, "edge_agent", "-c", str(config), "status", "--json"
            )
            body: dict[str, Any] = json.loads(result.stdout)
            return body if result.returncode == 1 and body["outbox"]["depth"] >= NOTES else None

        status = await eventually(held, timeout=60, what="outbox holding, status degraded")
        assert any("island" in p for p in status["problems"]), status["problems"]

        ballast.unlink()
        await eventually(
            lambda: _drained(outbox), timeout=90, what="outbox drained after space returned"
        )
        assert a.agent.island.restarts >= 1
        notes = await a.js.stream_info("EVENTS", subjects_filter="evt.full.note")
        assert notes.state.subjects == {"evt.full.note": NOTES}
    finally:
        for device in hub.devices:
            await device.stop()
        subprocess.run(["umount", str(store)], check=True)


async def test_streams_the_full_island_cannot_write_are_retried_not_fatal(hub: Hub) -> None:
    """Reconciling the island's streams on a full disk (a link that comes up after the disk
    filled): the refusal is the island's trouble, retried until space returns, not a bad
    stream configuration that would end the agent."""
    store = hub.root / "a" / "jetstream"
    store.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(store)], check=True)
    try:
        a = await hub.device("a")
        with (store / "ballast").open("wb") as fill, contextlib.suppress(OSError):
            while True:
                fill.write(b"\0" * 65536)
                fill.flush()
        budget = StreamBudget(max_bytes=8 * 1024**2, max_age=3600.0)
        smaller = replace(a.config, streams=replace(a.config.streams, telemetry=budget))
        with pytest.raises(StoreTrouble, match="no space left"):
            await reconcile(a.js, smaller)
    finally:
        for device in hub.devices:
            await device.stop()
        subprocess.run(["umount", str(store)], check=True)


async def _drained(outbox: Outbox) -> bool:
    return (await outbox.stats()).depth == 0
