"""Metrics in Prometheus's format, read back with prometheus_client's own parser: the agent's
textfile (rewritten at each heartbeat) and ``status --prometheus``, and the fleet's
``report --prometheus``."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from hub_ingest.local.fleet import write_hub_toml
from tests.support.cluster import Hub, run_cli, write_agent_config
from tests.support.waiting import RESUME_TIMEOUT, eventually


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_agent_writes_its_metrics_file_at_every_heartbeat(hub: Hub, tmp_path: Path) -> None:
    """The textfile node_exporter reads: link, streams, outbox, commands, fast resumes."""
    metrics = tmp_path / "textfile" / "edge_agent.prom"
    a = await hub.device("a", heartbeat_interval="1s", metrics_file=str(metrics))
    for i in range(7):
        await a.js.publish("tele.temp", str(i).encode())

    async def written() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        if not metrics.exists():
            return None
        found = samples(metrics.read_text())
        resumed = found.get(("edge_agent_resumes", (("device", "a"),)), 0)
        telemetry = (("device", "a"), ("stream", "TELEMETRY"))
        stored = found.get(("edge_agent_stream_messages", telemetry), 0)
        return found if resumed >= 1 and stored >= 7 else None

    found = await eventually(written, timeout=RESUME_TIMEOUT, what="metrics written")
    device = (("device", "a"),)
    assert found[("edge_agent_link_up", device)] == 1
    assert found[("edge_agent_island_up", device)] == 1
    assert ("edge_agent_outbox_depth", device) in found
    assert found[("edge_agent_commands", (("device", "a"), ("outcome", "executed")))] >= 0
    assert ("edge_agent_resume_duration_seconds", device) in found

    config = write_agent_config(a, tmp_path / "agent.toml")
    cli = await asyncio.to_thread(
        run_cli, "edge_agent", "-c", str(config), "status", "--prometheus"
    )
    assert cli.returncode == 0, cli.stderr
    assert samples(cli.stdout)[("edge_agent_island_up", device)] == 1


async def test_report_prometheus_has_a_series_per_device(hub: Hub, tmp_path: Path) -> None:
    """`report --prometheus`: fleet totals and, per device, link, last seen and commands."""
    await hub.device("a", heartbeat_interval="1s", register_when_ready=True)
    b = await hub.device("b", heartbeat_interval="1s", register_when_ready=True)
    b.proxy.cut()
    await b.wait_link(up=False)
    config = write_hub_toml(hub.config, tmp_path / "hub.toml")

    async def report() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        run = await asyncio.to_thread(
            run_cli, "hub_ingest", "-c", str(config), "report", "--prometheus"
        )
        found = samples(run.stdout)
        links = {d: found.get(("hub_device_link_up", (("device", d),))) for d in "ab"}
        return found if links == {"a": 1, "b": 0} else None

    found = await eventually(report, timeout=60, interval=1.0, what="both links in the report")
    assert found[("hub_fleet_devices", ())] == 2 and found[("hub_fleet_connected", ())] == 1
    assert found[("hub_device_commands_pending", (("device", "a"),))] == 0
    assert ("hub_device_last_seen_seconds", (("device", "a"),)) in found
    assert 0 < found[("hub_store_used_ratio", (("node", "hub"),))] < 0.1
