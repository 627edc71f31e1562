"""Wrong device clocks decide nothing alone: agents under libfaketime (Debian's `faketime`),
one 3 years ahead and one a day behind, against a hub on the real clock; and a hub watcher
two days behind its server.

libfaketime moves the agent's Python clock only: Go binaries such as the island's nats-server
read the time without libc, so the island (and the store times it writes) keeps real time.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from edge_agent.status.health import collect_status
from hub_ingest.commands.send import Envelope
from hub_ingest.local.fleet import write_hub_toml
from tests.support.agent_process import AgentProcess
from tests.support.cluster import Device, Hub, hub_has_reading, start_hub, write_agent_config
from tests.support.commands import results, send_command
from tests.support.ingest import ingest_config, run_once, telemetry
from tests.support.waiting import eventually

LIBFAKETIME = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
THREE_YEARS_S = 3 * 365 * 86400


def _clock(offset: str) -> dict[str, str]:
    assert LIBFAKETIME, "libfaketime missing: `make tools` installs Debian's faketime"
    # The monotonic clock stays real: only the wall clock is wrong, as on a device.
    return {
        "LD_PRELOAD": LIBFAKETIME[0],
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


@pytest.fixture
async def skewed(hub: Hub, tmp_path: Path) -> AsyncIterator[Any]:
    """A factory: `await skewed("a", "+3y")` starts device a's agent with that clock."""
    started: list[AgentProcess] = []

    async def start(device_id: str, offset: str) -> Device:
        device = await hub.device(device_id, start=False, heartbeat_interval="1s")
        config = write_agent_config(device, tmp_path / f"{device_id}.toml")
        process = AgentProcess(config, tmp_path / f"{device_id}.log").start(env=_clock(offset))
        started.append(process)
        await process.wait_event("agent_ready")
        await process.wait_event("clock_synced")
        await device.connect()
        return device

    try:
        yield start
    finally:
        for process in started:
            process.close()


async def _result(hub: Hub, envelope: Envelope) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        return (await results(hub.js, "FLEET_EVENTS")).get(envelope.id)

    found: dict[str, Any] = await eventually(probe, timeout=60, what=f"result of {envelope.id}")
    return found


async def test_a_clock_years_ahead_still_runs_valid_commands(hub: Hub, skewed: Any) -> None:
    """Its own clock says every command expired long ago; the hub's time line says not."""
    a = await skewed("a", "+3y")
    result = await _result(hub, await send_command(hub, "a", "ping", ttl=3600))
    assert result["status"] == "ok", result
    status = await collect_status(a.config)
    assert status.clock_offset_s is not None and status.clock_offset_s < -0.99 * THREE_YEARS_S


async def test_a_clock_a_day_behind_does_not_run_expired_commands(hub: Hub, skewed: Any) -> None:
    """A command that expired while the device was cut off is answered `expired` when the link
    returns, though the device's own clock says it has a day left; a fresh one runs."""
    b = await skewed("b", "-1d")
    b.proxy.cut()
    await b.wait_link(up=False)
    stale = await send_command(hub, "b", "ping", ttl=1)

    async def expired_at_hub() -> bool:
        return datetime.now(UTC) > datetime.fromisoformat(stale.expires_at)

    await eventually(expired_at_hub, timeout=10, what="the command's expiry on the hub")
    b.proxy.restore()
    result = await _result(hub, stale)
    assert result["status"] == "expired", result
    assert "on the hub's clock" in result["error"]
    fresh = await _result(hub, await send_command(hub, "b", "ping", ttl=3600))
    assert fresh["status"] == "ok"


@pytest.mark.spark
async def test_the_archive_labels_rows_of_a_device_with_a_wrong_clock(
    hub: Hub, skewed: Any, spark: SparkSession
) -> None:
    """Rows of the device whose clock is 3 years ahead are `device_time_suspect`, with the
    offset its heartbeat reported; a device on time is not labelled."""
    a = await skewed("a", "+3y")
    b = await hub.device("b", heartbeat_interval="1s")
    for device in (a, b):
        for i in range(3):
            await device.js.publish("tele.temp", json.dumps({"t": i}).encode())

    async def beats_with_offsets() -> bool:
        got = 0
        for device_id in ("a", "b"):
            msg = await hub.js.get_msg(
                "FLEET_EVENTS", subject=f"fleet.{device_id}.evt.{device_id}.heartbeat", direct=True
            )
            got += json.loads(msg.data or b"{}").get("clock_offset_s") is not None
        readings = await hub.js.stream_info("FLEET_TELEMETRY", subjects_filter="fleet.*.tele.>")
        return got == 2 and sum((readings.state.subjects or {}).values()) == 6

    await eventually(beats_with_offsets, timeout=60, what="readings and synced heartbeats")
    config = ingest_config(hub)
    await run_once(spark, config)
    rows = telemetry(config).to_pylist()
    by_device = {d: [r for r in rows if r["device_id"] == d] for d in ("a", "b")}
    assert len(by_device["a"]) == len(by_device["b"]) == 3
    assert all(r["device_time_suspect"] for r in by_device["a"])
    assert all(r["device_clock_offset_s"] < -0.99 * THREE_YEARS_S for r in by_device["a"])
    assert not any(r["device_time_suspect"] for r in by_device["b"])
    assert all(abs(r["device_clock_offset_s"]) < 60 for r in by_device["b"])


async def test_a_hub_watcher_days_behind_lets_devices_in_for_their_whole_link_life(
    tmp_path: Path,
) -> None:
    """The auth callout's answers expire by the hub server's clock (its request's), not by the
    watcher's: `hub-ingest watch` two days behind lets a device in, and its link stays."""
    hub = await start_hub(tmp_path, watching=False)
    config = write_hub_toml(hub.config, tmp_path / "hub.toml")
    with (tmp_path / "watch.log").open("wb") as out:
        watch = subprocess.Popen(
            [sys.executable, "-m", "hub_ingest", "-c", str(config), "watch"],
            env={**os.environ, **_clock("-2d")},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        a = await hub.device("a")
        await a.wait_link()
        link = await a.link_id()
        await a.js.publish("tele.clock", b"1")
        await eventually(
            lambda: hub_has_reading(hub.js, "a", "tele.clock"),
            timeout=60,
            what="a's reading at the hub",
        )
        assert await a.link_id() == link
    finally:
        watch.kill()
        watch.wait()
        await hub.close()
