"""``hub-ingest audit``: is the archive complete, and free of duplicates?

From the archive alone, per device, incarnation and aggregate stream: rows, first and last
``device_seq``, missing ranges and duplicates (a re-imaged device starts a new incarnation at
sequence 1, so completeness is per incarnation), and every incarnation change. A missing
range is *explained* when the device itself reported, in a heartbeat that reached the
archive, that its stream's budget or max age removed those sequences
(``streams.<name>.first_seq`` past the range, with ``dropped`` > 0), or when the hub's
refill counted them lost, with a reason (`hub_ingest.fleet.refill`). Against the hub: how many
messages of each aggregate stream are not archived yet (in flight, not an error), and how
many of the readings the hub refilled are archived (each once: a duplicate is counted).

The archive is read through its table's current snapshot (`hub_ingest.archive.table`): files of a
batch killed half way are in no snapshot, and no reader counts them.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from nats.js import JetStreamContext

from edge_agent.protocol.names import TELEMETRY
from edge_agent.protocol.pack import READINGS
from hub_ingest.archive import table
from hub_ingest.commands.send import attribute
from hub_ingest.core.config import IngestConfig
from hub_ingest.fleet.gaps import Healed, Ranges, expand
from hub_ingest.fleet.registry import Refusal
from hub_ingest.fleet.streams import AGGREGATES, made_at

_HEARTBEAT = re.compile(r"^evt\.[^.]+\.heartbeat$")
_KEY_COLUMNS = ["device_id", "incarnation", "hub_stream", "device_seq", "hub_seq"]


@dataclass(frozen=True, slots=True)
class Gap:
    first: int
    last: int
    explained: bool  # the device reported dropping these, or the hub counted them lost
    reason: str | None = None  # "dropped" (the device's report), or the refill's reason


@dataclass(frozen=True, slots=True)
class DeviceAudit:
    device_id: str
    incarnation: str | None  # None: rows archived before incarnations existed
    hub_stream: str
    rows: int
    first_seq: int
    last_seq: int
    duplicates: int  # rows beyond the first for the same device_seq
    missing: tuple[Gap, ...]
    refilled: int = 0  # readings the hub refilled from the island (what the hub says)
    refilled_archived: int = 0  # of those, in the archive (the rest are in flight)

    @property
    def ok(self) -> bool:
        return self.duplicates == 0 and all(g.explained for g in self.missing)


@dataclass(frozen=True, slots=True)
class StreamBacklog:
    stream: str
    last_seq: int
    archived_seq: int  # the highest hub_seq in the archive
    unarchived: int


@dataclass(frozen=True, slots=True)
class IncarnationChange:
    """A device's stream started again (re-image, new store): `incarnation` follows
    `previous` in the archive."""

    device_id: str
    hub_stream: str
    previous: str | None
    incarnation: str | None
    first_hub_seq: int  # the new incarnation's first row in `hub_stream`


@dataclass(frozen=True, slots=True)
class AuditReport:
    devices: tuple[DeviceAudit, ...]
    streams: tuple[StreamBacklog, ...] = ()
    incarnation_changes: tuple[IncarnationChange, ...] = ()
    # By device: the incarnations the hub will not take (`hub_ingest.fleet.watch`), whose
    # data waits on the device, out of the archive's sight.
    refused: Mapping[str, tuple[Refusal, ...]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.devices) and not self.refused

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "devices": [{**asdict(d), "ok": d.ok} for d in self.devices],
            "streams": [asdict(s) for s in self.streams],
            "incarnation_changes": [asdict(c) for c in self.incarnation_changes],
            "refused": [
                {"device_id": device, **asdict(r)}
                for device, refusals in self.refused.items()
                for r in refusals
            ],
        }


def audit_archive(
    config: IngestConfig, refills: Mapping[tuple[str, str, str], Healed] | None = None
) -> AuditReport:
    """The archive alone; with `refills` (`fleet.gaps.healed`), the hub's refill too."""
    rows = table.read(config, _KEY_COLUMNS, "device_seq IS NOT NULL")
    if rows is None or rows.num_rows == 0:
        return AuditReport(())
    dropped = _reported_drops(config)
    keys = ["device_id", "incarnation", "hub_stream"]
    groups = rows.group_by(keys).aggregate([("device_seq", "list"), ("hub_seq", "min")])
    devices = []
    for group in groups.to_pylist():
        device_id, incarnation, hub_stream = (group[k] for k in keys)
        seqs = group["device_seq_list"]
        unique = np.unique(np.asarray(seqs, dtype=np.int64))  # sorted
        steps = np.flatnonzero(np.diff(unique) > 1)
        ranges = [(1, int(unique[0]) - 1)] if unique[0] > 1 else []
        ranges += [(int(unique[j]) + 1, int(unique[j + 1]) - 1) for j in steps]
        stream = _device_stream(hub_stream)
        below = dropped.get((device_id, stream, incarnation), 0)
        refill = (refills or {}).get((device_id, incarnation, stream))
        lost = refill.lost if refill else {}
        devices.append(
            DeviceAudit(
                device_id=device_id,
                incarnation=incarnation,
                hub_stream=hub_stream,
                rows=len(seqs),
                first_seq=int(unique[0]),
                last_seq=int(unique[-1]),
                duplicates=len(seqs) - len(unique),
                missing=tuple(missing_range(a, b, below, lost) for a, b in ranges),
                refilled=len(refill.refilled) if refill else 0,
                refilled_archived=len(refill.refilled & set(unique.tolist())) if refill else 0,
            )
        )
    first_seen = {tuple(g[k] for k in keys): g["hub_seq_min"] for g in groups.to_pylist()}
    devices.sort(
        key=lambda d: (
            d.device_id,
            d.hub_stream,
            first_seen[d.device_id, d.incarnation, d.hub_stream],
        )
    )
    return AuditReport(tuple(devices), incarnation_changes=_changes(devices, first_seen))


def missing_range(first: int, last: int, below: int, lost: Mapping[str, Ranges]) -> Gap:
    """A missing range, explained by the device's own drops or by the refill's losses."""
    if last < below:
        return Gap(first, last, True, "dropped")
    for reason, ranges in lost.items():
        if set(range(first, last + 1)) <= expand(ranges):
            return Gap(first, last, True, reason)
    return Gap(first, last, False)


def _changes(
    devices: list[DeviceAudit], first_seen: dict[tuple[Any, ...], int]
) -> tuple[IncarnationChange, ...]:
    """Consecutive incarnations of each device in each aggregate (`devices` in that order)."""
    changes = []
    for before, after in itertools.pairwise(devices):
        if (before.device_id, before.hub_stream) == (after.device_id, after.hub_stream):
            first = first_seen[after.device_id, after.incarnation, after.hub_stream]
            changes.append(
                IncarnationChange(
                    after.device_id, after.hub_stream, before.incarnation, after.incarnation, first
                )
            )
    return tuple(changes)


def _device_stream(hub_stream: str) -> str:
    for aggregate in AGGREGATES:
        if hub_stream.startswith(aggregate.base_name):
            return aggregate.device_stream
    return hub_stream


def _reported_drops(config: IngestConfig) -> dict[tuple[str, str, str | None], int]:
    """(device, stream, incarnation) → the first sequence the device still had after dropping
    older ones. Only a device's own heartbeats count (see `hub_ingest.commands.send.attribute`): a
    device cannot explain away another's gaps."""
    beats = table.read(
        config, ["device_id", "incarnation", "subject", "payload"], "subject LIKE 'evt.%'"
    )
    out: dict[tuple[str, str, str | None], int] = {}
    for row in beats.to_pylist() if beats is not None else []:
        if not _HEARTBEAT.match(row["subject"]):
            continue
        try:
            body = json.loads(row["payload"])
            streams = body["streams"]
        except (ValueError, KeyError, TypeError):
            continue
        hub_subject = f"fleet.{row['device_id']}.{row['subject']}"
        if not attribute(hub_subject, body, "heartbeat").trusted:
            continue
        for name, state in streams.items() if isinstance(streams, dict) else ():
            # A packed TELEMETRY counts packs; its readings' sequences are READINGS'.
            if isinstance(state, dict) and state.get("packed"):
                continue
            if isinstance(state, dict) and state.get("dropped", 0) > 0:
                # The stream's own incarnation; a heartbeat from before they were reported
                # comes from the same store as the stream it describes.
                stream = TELEMETRY if name == READINGS else name
                key = (row["device_id"], stream, state.get("incarnation") or row["incarnation"])
                out[key] = max(out.get(key, 0), int(state.get("first_seq", 0)))
    return out


async def backlog(
    js: JetStreamContext, config: IngestConfig, streams: list[str]
) -> list[StreamBacklog]:
    """Per aggregate stream: how many of its messages the archive does not have yet."""
    current = table.load(config)
    infos = {name: await js.stream_info(name) for name in streams}
    made = {name: made_at(info) for name, info in infos.items()}
    archived = table.archived(current, made) if current is not None else {}
    out = []
    for name, info in infos.items():
        state = info.state
        done = archived.get(name, 0)
        pending = state.messages if done < state.first_seq else max(state.last_seq - done, 0)
        out.append(StreamBacklog(name, state.last_seq, done, pending))
    return out
