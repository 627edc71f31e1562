"""The hub's store fills: one device flooding it stops every device's data at the hub
(nats-server refuses every mirror and aggregate on a full store, with no error in their
info). The report says so and names the device; given room, the fleet resumes with nothing
lost or doubled."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from edge_agent.protocol.files import write_durably
from hub_ingest.core.errors import ProvisionError
from hub_ingest.fleet.provision import provision
from hub_ingest.fleet.registry import Incarnation, Registry
from hub_ingest.fleet.server import render_server_config
from hub_ingest.report.collect import collect_report
from tests.support.cluster import Hub, hub_readings, start_hub
from tests.support.waiting import eventually

TIMEOUT = 120
FLOODED = 24_000  # readings of 2,000 bytes: 48 MB, stored twice at the hub (mirror, aggregate)


async def _store_warnings(hub: Hub) -> list[str]:
    devices = await (await Registry.open(hub.js)).list()
    report = await collect_report(hub.nc, hub.config, devices, silent_after=3600)
    assert [f.node for f in report.store] == ["hub"]
    return [w for w in report.warnings if "store is" in w]


async def _refused(hub: Hub, mirror: str) -> bool:
    log = hub.server.log_path.read_text(errors="replace")
    return f"> '{mirror}': insufficient resources" in log


async def test_a_device_filling_the_hub_store_is_named_and_nothing_is_lost_once_it_has_room(
    tmp_path: Path,
) -> None:
    # COMMANDS holds back 64 MiB of it in the tests' hubs, and uses none.
    hub = await start_hub(tmp_path, max_file_store="80MiB")
    try:
        a = await hub.device("a")
        b = await hub.device("b")
        assert await _store_warnings(hub) == []
        for i in range(FLOODED):
            await a.nc.publish("tele.flood", b"x" * 2000)
            if i % 1000 == 0:
                await a.nc.flush()

        async def warned() -> list[str]:
            return await _store_warnings(hub)

        (warning,) = await eventually(warned, timeout=TIMEOUT, what="the store warning")
        assert "server.max_file_store 80.0 MiB" in warning, warning
        assert warning.split("Largest device mirrors: ")[1].startswith("EDGE_TELEMETRY_a_")
        b_events = await hub.mirror("b", "EVENTS")  # its heartbeats, every 2 s here
        await eventually(lambda: _refused(hub, b_events), timeout=TIMEOUT, what="b refused")
        for i in range(3):
            await b.js.publish("tele.temp", json.dumps({"t": i}).encode())

        # The operator gives the hub room (or sets aggregates.max_age) and restarts it.
        server = replace(hub.config.server, max_file_store=1024**3)
        hub.config = replace(hub.config, server=server)
        write_durably(server.config_file, render_server_config(hub.config))
        await hub.restart()

        async def b_readings() -> list[int]:
            return sorted(json.loads(r)["t"] for r in await hub_readings(hub.js, "b", "tele.temp"))

        async def a_readings() -> int:
            return len(await hub_readings(hub.js, "a", "tele.flood"))

        async def all_in() -> bool:
            return len(await b_readings()) >= 3 and await a_readings() >= FLOODED

        await eventually(all_in, timeout=TIMEOUT, interval=2, what="a's and b's readings")
        assert await b_readings() == [0, 1, 2]
        assert await a_readings() == FLOODED
        assert await _store_warnings(hub) == []
    finally:
        await hub.close()


async def test_a_hub_keeping_readings_less_than_two_minutes_is_provisioned(
    tmp_path: Path,
) -> None:
    """nats-server refuses a de-duplication window longer than a stream's max age: the
    refill stream's and an empty aggregate's 2 minutes made every provisioning fail."""
    hub = await start_hub(tmp_path, max_age="30s")
    try:
        a = await hub.device("a")
        await a.js.publish("tele.temp", json.dumps({"t": 1}).encode())

        async def arrived() -> bool:
            return len(await hub_readings(hub.js, "a", "tele.temp")) == 1

        await eventually(arrived, timeout=TIMEOUT, what="a's reading")
    finally:
        await hub.close()


async def test_mirrors_past_what_max_bytes_holds_back_are_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    """nats-server holds back a stream's max_bytes when it is made, and each device mirror
    has the aggregates': with 96 MiB of 1 GiB, the fourth device's mirrors find no room. The
    error names the setting and the sum, not only the server's words."""
    hub = await start_hub(tmp_path, max_bytes="96MiB")
    try:
        registry = await Registry.open(hub.js)
        for i in range(4):
            await hub.register(f"d{i}")
            for stream in ("TELEMETRY", "EVENTS"):
                seen = Incarnation(stream, f"inc{i}", "2026-12-02T00:00:00Z", 0, via_shard=True)
                await registry.add_incarnation(f"d{i}", seen)
            if i < 3:
                await provision(hub.js, hub.config, await registry.list())
        with pytest.raises(ProvisionError) as refused:
            await provision(hub.js, hub.config, await registry.list())
        assert "insufficient storage resources available" in str(refused.value)
        assert "aggregates.max_bytes (96.0 MiB)" in str(refused.value)
        assert "1.0 GiB for 4 devices" in str(refused.value)  # (2 * 4 + 3) * 96 MiB
    finally:
        await hub.close()


async def test_a_device_whose_mirrors_were_never_made_is_warned_of(tmp_path: Path) -> None:
    """An incarnation recorded whose provisioning failed (no room, above) was visible only
    in the watcher's log: the report showed the device "not sourced", with no flag or
    warning, until it went silent."""
    hub = await start_hub(tmp_path, watching=False)
    try:
        await hub.register("d")
        seen = Incarnation("TELEMETRY", "inc1", "2026-12-02T00:00:00Z", 0, via_shard=True)
        await (await Registry.open(hub.js)).add_incarnation("d", seen)  # not provisioned
        devices = await (await Registry.open(hub.js)).list()
        report = await collect_report(hub.nc, hub.config, devices, silent_after=3600)
        (warning,) = [w for w in report.warnings if "does not take it in" in w]
        assert warning.startswith("device d: the hub has seen its TELEMETRY (incarnation inc1)")
        await provision(hub.js, hub.config, devices)
        report = await collect_report(hub.nc, hub.config, devices, silent_after=3600)
        assert not [w for w in report.warnings if "does not take it in" in w]
    finally:
        await hub.close()
