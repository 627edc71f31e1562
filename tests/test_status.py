"""`edge-agent status`: the link going down and coming back, budgets, and exit codes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from edge_agent.island.streams import UNCOMPRESSED_START_WINDOW
from hub_ingest.fleet.registry import Registry
from hub_ingest.report.collect import collect_report
from tests.support.cluster import Hub, run_cli, write_agent_config
from tests.support.waiting import RESUME_TIMEOUT, eventually


async def _status(config_path: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    result = await asyncio.to_thread(
        run_cli, "edge_agent", "-c", str(config_path), "status", "--json", *flags
    )
    return result.returncode, json.loads(result.stdout)


async def test_status_json_follows_the_link_down_and_up(hub: Hub, tmp_path: Path) -> None:
    """The JSON shows the link down with a since-time, then up again with a later one."""
    a = await hub.device("a")
    config_path = write_agent_config(a, tmp_path / "agent.toml")
    await a.js.publish("tele.temp", b"21.5")

    code, up = await _status(config_path)
    assert code == 0
    assert up["healthy"] is True
    assert up["island_up"] is True
    assert up["link"]["up"] is True
    assert set(up["streams"]) == {"TELEMETRY", "EVENTS", "COMMANDS"}
    telemetry = up["streams"]["TELEMETRY"]
    assert telemetry["messages"] == 1
    assert telemetry["max_bytes"] == a.config.streams.telemetry.max_bytes
    assert up["mirror"]["error"] is None

    a.proxy.cut()

    async def link_down() -> dict[str, Any] | None:
        code, body = await _status(config_path)
        return body if code == 0 and not body["link"]["up"] and body["link"]["since"] else None

    down = await eventually(link_down, timeout=30, what="status reports link down")
    assert down["link"]["since"] > up["link"]["since"]
    code, strict = await _status(config_path, "--require-link")
    assert code == 1
    assert "leaf link to the hub is down" in strict["problems"]

    a.proxy.restore()

    async def link_up() -> dict[str, Any] | None:
        _, body = await _status(config_path)
        return body if body["link"]["up"] and body["link"]["since"] else None

    again = await eventually(link_up, timeout=30, what="status reports link up again")
    assert again["link"]["since"] > down["link"]["since"]


async def test_status_without_island_is_degraded(tmp_path: Path, hub: Hub) -> None:
    """No island answering: exit 1 and a problem that says so, in text and JSON."""
    a = await hub.device("a")
    config_path = write_agent_config(a, tmp_path / "agent.toml")
    await a.stop()
    code, body = await _status(config_path)
    assert code == 1
    assert body["island_up"] is False
    assert body["problems"][0].startswith("island unreachable")
    text = await asyncio.to_thread(run_cli, "edge_agent", "-c", str(config_path), "status")
    assert text.returncode == 1
    assert "DEGRADED" in text.stdout


async def test_status_and_report_show_the_backlog_waiting_for_the_link(
    hub: Hub, tmp_path: Path
) -> None:
    """While cut: the readings since are the device's backlog, with when one last crossed;
    after the link returns the backlog drains to nothing, on the device and in the report."""
    a = await hub.device("a", register_when_ready=True)
    await hub.provision()
    config_path = write_agent_config(a, tmp_path / "agent.toml")
    await a.js.publish("tele.temp", b"before")

    async def uplink(expect: int) -> dict[str, Any] | None:
        _, body = await _status(config_path)
        up: dict[str, Any] = body["streams"]["TELEMETRY"]["uplink"]
        return up if up["backlog_messages"] == expect and up["last_crossed"] else None

    await eventually(lambda: uplink(0), timeout=RESUME_TIMEOUT, what="the first reading crossed")
    a.proxy.cut()
    await a.wait_link(up=False)
    for i in range(5):
        await a.js.publish("tele.temp", f"cut-{i}".encode())
    waiting = await eventually(lambda: uplink(5), timeout=30, what="a backlog of 5")
    assert waiting["backlog_bytes"] > 0 and waiting["drain_eta_s"] is None
    assert waiting["window"] == UNCOMPRESSED_START_WINDOW  # loopback: uncompressed, by_rtt

    a.proxy.restore()
    drained = await eventually(lambda: uplink(0), timeout=30, what="the backlog drained")
    assert drained["drain_eta_s"] == 0 and drained["last_crossed"] > waiting["last_crossed"]

    async def reported() -> dict[str, Any] | None:
        devices = (
            await collect_report(
                hub.nc, hub.config, await (await Registry.open(hub.js)).list(), silent_after=60
            )
        ).devices
        tele = devices[0].uplinks.get("TELEMETRY")
        return dict(tele) if tele and tele["backlog_messages"] == 0 else None

    assert (await eventually(reported, timeout=30, what="the report"))["last_crossed"]
