"""The agent's figures in Prometheus's text format, for node_exporter's textfile collector
(``agent.metrics_file``, rewritten at every heartbeat) or ``edge-agent status --prometheus``.

Built from the same `Status` as ``status`` and the heartbeat, so the three never disagree.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, generate_latest, write_to_textfile

from edge_agent.commands.resume import ResumeFigures
from edge_agent.protocol.units import parse_time
from edge_agent.status.health import Status

Figure = tuple[str, str, float | None]  # name, help text, value (None: left out)


def _gauge(registry: CollectorRegistry, name: str, doc: str, *labels: str) -> Gauge:
    return Gauge(name, doc, labels, registry=registry)


def registry_for(status: Status, resume: ResumeFigures | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    since = parse_time(status.link.since)
    figures: list[Figure] = [
        ("edge_agent_healthy", "1 when status finds no problem", int(status.healthy)),
        ("edge_agent_island_up", "1 when the island answers healthy", int(status.island_up)),
        ("edge_agent_link_up", "1 while the leaf link to the hub is up", int(status.link.up)),
        (
            "edge_agent_link_changed_timestamp_seconds",
            "when the link last went up or down",
            since.timestamp() if since else None,
        ),
        (
            "edge_agent_clock_offset_seconds",
            "hub clock minus device clock at the last sync",
            status.clock_offset_s,
        ),
        (
            "edge_agent_uplink_unstalled",
            "times a hub mirror's consumer was found stuck and bound afresh",
            status.uplink_unstalled,
        ),
    ]
    if (outbox := status.outbox) is not None:
        figures += [
            ("edge_agent_outbox_depth", "rows waiting for the island", outbox.depth),
            ("edge_agent_outbox_bytes", "bytes waiting for the island", outbox.bytes),
            ("edge_agent_outbox_max_bytes", "the outbox's budget", outbox.max_bytes),
            ("edge_agent_dead_letters", "rows the island refused for good", outbox.dead_letters),
            (
                "edge_agent_outbox_oldest_age_seconds",
                "age of the oldest waiting row (0 when empty)",
                outbox.oldest_age_s or 0.0,
            ),
        ]
    if status.commands is not None and status.mirror is not None:
        figures.append(
            ("edge_agent_command_mirror_lag", "commands the mirror lacks", status.mirror.lag)
        )
    if resume is not None:
        ran = resume.last_duration_s is not None
        figures += [
            ("edge_agent_resumes", "fast resumes since the agent started", resume.resumes),
            (
                "edge_agent_resume_duration_seconds",
                "how long the last fast resume read from the hub",
                resume.last_duration_s,
            ),
            (
                "edge_agent_resume_commands",
                "commands the last fast resume ran",
                resume.last_commands if ran else None,
            ),
            (
                "edge_agent_command_mirror_rebuilds",
                "times the command mirror was made again: its hub origin had been replaced",
                resume.mirror_rebuilds,
            ),
        ]
    for name, doc, value in figures:
        if value is not None:
            _gauge(registry, name, doc, "device").labels(status.device_id).set(value)
    _streams(registry, status)
    _commands(registry, status)
    return registry


def _streams(registry: CollectorRegistry, status: Status) -> None:
    device = status.device_id
    figures = {
        "edge_agent_stream_messages": "messages in the island stream",
        "edge_agent_stream_bytes": "bytes in the island stream",
        "edge_agent_stream_max_bytes": "the stream's byte budget",
        "edge_agent_stream_dropped": "messages the budget or max_age forced out, ever",
        "edge_agent_uplink_backlog_messages": "messages the hub has not confirmed yet",
        "edge_agent_uplink_window": "messages the hub's mirror may have in flight",
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
            values["edge_agent_uplink_window"] = stream.uplink.window
        for metric, value in values.items():
            gauges[metric].labels(device, name).set(value)


def _commands(registry: CollectorRegistry, status: Status) -> None:
    if (commands := status.commands) is None:
        return
    g = _gauge(
        registry, "edge_agent_commands", "commands by outcome, since the ledger began", "device",
        "outcome",
    )  # fmt: skip
    for outcome in ("executed", "failed", "rejected", "expired", "running"):
        g.labels(status.device_id, outcome).set(getattr(commands, outcome))


def exposition(status: Status, resume: ResumeFigures | None = None) -> str:
    return generate_latest(registry_for(status, resume)).decode()


def write_textfile(path: Path, status: Status, resume: ResumeFigures | None = None) -> None:
    """Replace `path` atomically (node_exporter must never read half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(path), registry_for(status, resume))
