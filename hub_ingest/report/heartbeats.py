"""What the report reads from the devices' heartbeats: their figures, the last one of each
device, and the heartbeats a device sent under another's name."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from nats.js import JetStreamContext

from edge_agent.protocol.pack import READINGS
from hub_ingest.commands.attribution import Attribution, attribute
from hub_ingest.core.replies import Stored
from hub_ingest.fleet.latest import heartbeat_subject, latest
from hub_ingest.fleet.registry import Device
from hub_ingest.fleet.streams import AGGREGATES
from hub_ingest.report.hub import HubApi

EVENTS = next(a for a in AGGREGATES if a.device_stream == "EVENTS")


def beat_figure(body: Mapping[str, Any] | None, *path: str) -> int | None:
    """A count at `path` in a heartbeat's body (None: absent)."""
    value: object = body
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def readings_dropped(beat: Mapping[str, Any] | None) -> int | None:
    """Readings the device's budget dropped, by heartbeat `beat`: READINGS' when it packs
    (its TELEMETRY then counts packs), else TELEMETRY's."""
    readings = beat_figure(beat, "streams", READINGS, "dropped")
    return (
        readings if readings is not None else beat_figure(beat, "streams", "TELEMETRY", "dropped")
    )


def beat_uplinks(beat: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Each stream's ``uplink`` block of a heartbeat (see `edge_agent.status.health.Uplink`)."""
    streams = (beat or {}).get("streams")
    if not isinstance(streams, dict):
        return {}
    return {
        name: body["uplink"]
        for name, body in streams.items()
        if isinstance(body, dict) and isinstance(body.get("uplink"), dict)
    }


class Forgeries:
    """Events that claim another device, per sender, for the report's warnings."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def note(self, sender: Attribution, count: int = 1) -> None:
        device = sender.device_id or "?"
        self.counts[device] += count
        self.examples.setdefault(device, sender.forgery or "")

    def warnings(self) -> list[str]:
        return [
            f"device {d} sent {n} event(s) claiming another device, ignored (e.g. "
            f"{self.examples[d]})"
            for d, n in sorted(self.counts.items())
        ]


async def heartbeat_forgeries(api: HubApi, stream: str, forged: Forgeries) -> None:
    """Heartbeats a device published under another device's subject (counted per subject by
    the server, without reading them)."""
    info = await api.request(
        f"STREAM.INFO.{stream}", {"subjects_filter": "fleet.*.evt.*.heartbeat"}
    )
    subjects = ((info or {}).get("state") or {}).get("subjects") or {}
    for subject, count in subjects.items():
        sender = attribute(subject, None, "heartbeat")
        if not sender.trusted:
            forged.note(sender, int(count))


async def last_heartbeats(
    js: JetStreamContext, api: HubApi, infos: Mapping[str, Any], devices: Iterable[Device]
) -> dict[str, Stored]:
    """The last heartbeat of each of `devices`, by subject, read per events aggregate; of a
    device whose last one the trim took from its aggregate, the one it kept."""
    subjects: dict[str, list[str]] = {}
    for device in devices:
        subjects.setdefault(EVENTS.stream_name(device.shard), []).append(
            heartbeat_subject(device.device_id)
        )
    found: dict[str, Stored] = {}
    for stream, wanted in subjects.items():
        if infos.get(stream):
            found |= await api.last_messages(stream, wanted)
    missing = [s for wanted in subjects.values() for s in wanted if s not in found]
    kept = await latest(js, missing) if missing else {}
    return found | kept
