"""The agent's figures in Prometheus's text format, for node_exporter's textfile collector
(``agent.metrics_file``, rewritten at every heartbeat) or ``edge-agent status --prometheus``.

Built from the same `Status` as ``status`` and the heartbeat, so the three never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, generate_latest, write_to_textfile

from edge_agent.health import Status
from edge_agent.protocol.units import parse_time


@dataclass(frozen=True, slots=True)
class ResumeFigures:
    """What fast resume did after the link last came up (only the running agent knows)."""

    resumes: int
    last_duration_s: float | None
    last_commands: int


def _gauge(registry: CollectorRegistry, name: str, doc: str, *labels: str) -> Gauge:
    return Gauge(name, doc, labels, registry=registry)


def registry_for(status: Status, resume: ResumeFigures | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    device = status.device_id
    g = _gauge(registry, "edge_agent_healthy", "1 when status finds no problem", "device")
    g.labels(device).set(int(status.healthy))
    g = _gauge(registry, "edge_agent_island_up", "1 when the island answers healthy", "device")
    g.labels(device).set(int(status.island_up))
    g = _gauge(registry, "edge_agent_link_up", "1 while the leaf link to the hub is up", "device")
    g.labels(device).set(int(status.link.up))
    if (since := parse_time(status.link.since)) is not None:
        g = _gauge(
            registry,
            "edge_agent_link_changed_timestamp_seconds",
            "when the link last went up or down",
            "device",
        )
        g.labels(device).set(since.timestamp())
    _outbox(registry, status)
    _streams(registry, status)
    _commands(registry, status)
    if resume is not None:
        _resume(registry, device, resume)
    if status.clock_offset_s is not None:
        g = _gauge(
            registry,
            "edge_agent_clock_offset_seconds",
            "hub clock minus device clock at the last sync",
            "device",
        )
        g.labels(device).set(status.clock_offset_s)
    return registry


def _outbox(registry: CollectorRegistry, status: Status) -> None:
    outbox, device = status.outbox, status.device_id
    if outbox is None:
        return
    for name, doc, value in (
        ("edge_agent_outbox_depth", "rows waiting for the island", outbox.depth),
        ("edge_agent_outbox_bytes", "bytes waiting for the island", outbox.bytes),
        ("edge_agent_outbox_max_bytes", "the outbox's budget", outbox.max_bytes),
        ("edge_agent_dead_letters", "rows the island refused for good", outbox.dead_letters),
    ):
        _gauge(registry, name, doc, "device").labels(device).set(value)
    age = _gauge(
        registry,
        "edge_agent_outbox_oldest_age_seconds",
        "age of the oldest waiting row (0 when empty)",
        "device",
    )
    age.labels(device).set(outbox.oldest_age_s or 0.0)


def _streams(registry: CollectorRegistry, status: Status) -> None:
    device = status.device_id
    figures = {
        "edge_agent_stream_messages": "messages in the island stream",
        "edge_agent_stream_bytes": "bytes in the island stream",
        "edge_agent_stream_max_bytes": "the stream's byte budget",
        "edge_agent_stream_dropped": "messages the budget or max_age forced out, ever",
        "edge_agent_uplink_backlog_messages": "messages the hub has not confirmed yet",
    }
    gauges = {n: _gauge(registry, n, doc, "device", "stream") for n, doc in figures.items()}
    for name, stream in sorted(status.streams.items()):
        values = {
            "edge_agent_stream_messages": stream.messages,
            "edge_agent_stream_bytes": stream.bytes,
            "edge_agent_stream_max_bytes": stream.max_bytes,
            "edge_agent_stream_dropped": stream.dropped,
        }
        if stream.uplink is not None:
            values["edge_agent_uplink_backlog_messages"] = stream.uplink.backlog_messages
        for metric, value in values.items():
            gauges[metric].labels(device, name).set(value)


def _commands(registry: CollectorRegistry, status: Status) -> None:
    commands, device = status.commands, status.device_id
    if commands is None:
        return
    g = _gauge(
        registry, "edge_agent_commands", "commands by outcome, since the ledger began", "device",
        "outcome",
    )  # fmt: skip
    for outcome in ("executed", "failed", "rejected", "expired", "running"):
        g.labels(device, outcome).set(getattr(commands, outcome))
    if status.mirror is not None:
        lag = _gauge(
            registry, "edge_agent_command_mirror_lag", "commands the mirror lacks", "device"
        )
        lag.labels(device).set(status.mirror.lag)


def _resume(registry: CollectorRegistry, device: str, resume: ResumeFigures) -> None:
    g = _gauge(registry, "edge_agent_resumes", "fast resumes since the agent started", "device")
    g.labels(device).set(resume.resumes)
    if resume.last_duration_s is not None:
        g = _gauge(
            registry,
            "edge_agent_resume_duration_seconds",
            "how long the last fast resume read from the hub",
            "device",
        )
        g.labels(device).set(resume.last_duration_s)
        g = _gauge(
            registry,
            "edge_agent_resume_commands",
            "commands the last fast resume ran",
            "device",
        )
        g.labels(device).set(resume.last_commands)


def exposition(status: Status, resume: ResumeFigures | None = None) -> str:
    return generate_latest(registry_for(status, resume)).decode()


def write_textfile(path: Path, status: Status, resume: ResumeFigures | None = None) -> None:
    """Replace `path` atomically (node_exporter must never read half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(path), registry_for(status, resume))
