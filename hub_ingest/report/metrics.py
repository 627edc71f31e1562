"""The fleet report in Prometheus's text format (``hub-ingest report --prometheus``), for a
node_exporter textfile or a scrape through a small wrapper: one series per device."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from hub_ingest.report.model import DeviceReport, FleetReport

# name, help, how to read it from a device (None: not known, no sample)
_PER_DEVICE: tuple[tuple[str, str, str], ...] = (
    ("hub_device_link_up", "1 while the device's leaf link is up (no sample: unknown)", "link"),
    ("hub_device_last_seen_seconds", "since the hub last heard from the device", "seen"),
    ("hub_device_lag", "messages the hub's aggregates still lack of the device", "lag"),
    ("hub_device_flagged", "1 when the report flags the device (silent, gap, shared key…)", "flag"),
    ("hub_device_commands_pending", "commands waiting for the device's result", "pending"),
    ("hub_device_commands_failed", "results other than ok, since the index began", "failed"),
    ("hub_device_telemetry_dropped", "readings the device's budget forced out", "dropped"),
    ("hub_device_dead_letters", "outbox rows the device's island refused for good", "dead"),
    ("hub_device_forged_events", "results and heartbeats claiming another device", "forged"),
    ("hub_device_hub_skipped", "sequences the hub's copies of its streams skipped", "skipped"),
    ("hub_device_refilled", "skipped readings refilled from the device's island", "refilled"),
    ("hub_device_lost", "skipped readings the island no longer had (all reasons)", "lost"),
    ("hub_device_gap_pending", "skipped readings waiting for the island to answer", "gap"),
    ("hub_device_gap_pending_seconds", "since the oldest pending gap was seen", "gap_age"),
)


def _value(device: DeviceReport, what: str) -> float | None:
    values: dict[str, float | int | bool | None] = {
        "link": device.link_connected,
        "seen": device.last_seen_s,
        "lag": device.lag,
        "flag": device.flagged,
        "pending": device.commands.pending,
        "failed": device.commands.failed,
        "dropped": device.telemetry_dropped,
        "dead": device.dead_letters,
        "forged": device.forged_events,
        "skipped": device.skipped,
        "refilled": device.gaps.refilled,
        "lost": sum(device.gaps.lost.values()),
        "gap": device.gaps.pending,
        "gap_age": device.gaps.pending_age_s,
    }
    value = values[what]
    return None if value is None else float(value)


def render_prometheus(report: FleetReport) -> str:
    registry = CollectorRegistry()
    t = report.totals
    for name, doc, value in (
        ("hub_fleet_devices", "registered devices", t.devices),
        ("hub_fleet_connected", "devices whose link is up", t.connected),
        ("hub_fleet_flagged", "devices the report flags", t.flagged),
        ("hub_fleet_lag", "messages the aggregates lack, all devices", t.lag),
        ("hub_fleet_commands_pending", "commands waiting for a result", t.commands_pending),
    ):
        Gauge(name, doc, registry=registry).set(value)
    store = Gauge(
        "hub_store_used_ratio", "of server.max_file_store used", ["node"], registry=registry
    )
    for node in report.store:
        store.labels(node.node).set(node.used)
    for name, doc, what in _PER_DEVICE:
        gauge = Gauge(name, doc, ["device"], registry=registry)
        for device in report.devices:
            if (figure := _value(device, what)) is not None:
                gauge.labels(device.device_id).set(figure)
    return generate_latest(registry).decode()
