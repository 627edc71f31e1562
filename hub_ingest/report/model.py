"""The fleet report's shape: per device and for the fleet, as `report` prints it and
``--json`` emits it (schema ``hub-ingest.report/1``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from edge_agent.protocol.units import parse_time
from hub_ingest.fleet.admission_figures import AdmissionFigures
from hub_ingest.fleet.gaps import MirrorGaps
from hub_ingest.fleet.registry import Incarnation, Refusal
from hub_ingest.report.store import StoreFigures

SCHEMA = "hub-ingest.report/1"


@dataclass(frozen=True, slots=True)
class SourceState:
    """One aggregate stream's view of its source on a device."""

    stream: str  # FLEET_TELEMETRY
    device_stream: str  # TELEMETRY
    sourced: bool  # False: the aggregate has no source for this device (not provisioned)
    lag: int | None
    last_active_s: float | None  # None: the hub never heard from this source
    error: str | None
    # Sequences inside the hub's mirror's range that it does not hold (None: no mirror):
    # skipped because the device's budget removed them first, or lost on the hub's side.
    skipped: int | None = None


@dataclass(frozen=True, slots=True)
class CommandCounts:
    pending: int = 0  # addressed to the device, no result yet, not expired
    expired: int = 0  # no result and past expires_at: will never run, only be answered
    done: int = 0  # results received, whatever their status
    failed: int = 0  # results with a status other than "ok"


@dataclass(frozen=True, slots=True)
class CommandError:
    command_id: str | None
    status: str
    error: str | None


@dataclass(frozen=True, slots=True)
class GapCounts:
    """What the hub's mirrors of a device skipped and what became of it (`hub_ingest.fleet.refill`),
    summed over its streams and incarnations."""

    refilled: int = 0  # read again from the island
    in_aggregate: int = 0  # the aggregate had kept them
    lost: Mapping[str, int] = field(default_factory=dict)  # reason → readings
    pending: int = 0  # waiting for the island to answer
    pending_age_s: float | None = None  # since the oldest pending gap was first seen

    @classmethod
    def of(cls, records: Iterable[MirrorGaps], now: datetime) -> GapCounts:
        records = list(records)
        lost: Counter[str] = Counter()
        for record in records:
            lost.update(record.lost_counts())
        since = [t for r in records if r.pending and (t := parse_time(r.pending_since))]
        return cls(
            refilled=sum(r.refilled for r in records),
            in_aggregate=sum(r.in_aggregate for r in records),
            lost=dict(sorted(lost.items())),
            pending=sum(r.pending_count for r in records),
            pending_age_s=round((now - min(since)).total_seconds(), 3) if since else None,
        )

    def accounted(self) -> int:
        """Skips the refill has looked at."""
        return self.refilled + self.in_aggregate + sum(self.lost.values()) + self.pending


@dataclass(frozen=True, slots=True)
class DeviceReport:
    device_id: str
    domain: str
    shard: int
    link_connected: bool | None  # None: the hub's monitoring endpoint did not answer
    sources: tuple[SourceState, ...]
    last_heartbeat_at: str | None
    last_heartbeat_age_s: float | None
    last_seen_s: float | None  # the freshest of the heartbeat and the sources' activity
    # Readings the device's telemetry budget forced out, as of its latest heartbeat (None:
    # no heartbeat, or one without the figure): some may never have reached the hub.
    telemetry_dropped: int | None
    # Outbox rows the device's island refused for good, as of its latest heartbeat.
    dead_letters: int | None
    commands: CommandCounts
    last_error: CommandError | None
    # "never_seen" or "silent"; "hub_gap" (skips the refill has not looked at yet),
    # "gap_pending" (skips waiting for the island), "lost" (skips the island no longer had),
    # "key_shared" (its key links from two machines at once: `hub_ingest.fleet.shared_keys`),
    # "incarnation_refused" (the hub takes no incarnation of one of its streams: `fleet.watch`)
    flags: tuple[str, ...]
    # Every incarnation of the device's streams the hub has seen, oldest first: a new one
    # means the device was re-imaged (or its store replaced) at about `seen_at`.
    incarnations: tuple[Incarnation, ...] = ()
    refused: tuple[Refusal, ...] = ()  # incarnations the hub will not take, one a stream
    # Results and heartbeats this device sent that claim another device: ignored, counted.
    forged_events: int = 0
    # Per outbound stream, as of the latest heartbeat: when a message last crossed, the
    # backlog still on the device (messages, bytes) and its time to drain at the current rate.
    uplinks: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    gaps: GapCounts = field(default_factory=GapCounts)

    def to_dict(self) -> dict[str, Any]:
        """One object of the ``--json`` document's ``devices``."""
        return {
            **asdict(self),
            "flagged": self.flagged,
            "incarnation": self.incarnation,
            "incarnation_changed_at": self.incarnation_changed_at,
            "skipped": self.skipped,
        }

    @property
    def incarnation(self) -> str | None:
        """The current incarnation of the device's ``EVENTS`` (its results and heartbeats)."""
        current = next((i for i in reversed(self.incarnations) if i.stream == "EVENTS"), None)
        return current.id if current else None

    @property
    def incarnation_changed_at(self) -> str | None:
        """When the hub saw the device's current incarnation replace an earlier one."""
        events = [i for i in self.incarnations if i.stream == "EVENTS"]
        return events[-1].seen_at if len(events) > 1 else None

    @property
    def flagged(self) -> bool:
        return bool(self.flags)

    @property
    def lag(self) -> int | None:
        lags = [s.lag for s in self.sources if s.lag is not None]
        return sum(lags) if lags else None

    @property
    def skipped(self) -> int | None:
        skips = [s.skipped for s in self.sources if s.skipped is not None]
        return sum(skips) if skips else None


@dataclass(frozen=True, slots=True)
class FleetTotals:
    devices: int
    connected: int
    flagged: int
    lag: int
    commands_pending: int
    commands_expired: int
    commands_done: int
    commands_failed: int


@dataclass(frozen=True, slots=True)
class FleetReport:
    generated_at: str
    silent_after_s: float
    devices: tuple[DeviceReport, ...]
    warnings: tuple[str, ...] = field(default=())
    # Under the auth callout: what each node's watcher let in, refused and cut.
    admission: tuple[AdmissionFigures, ...] = field(default=())
    store: tuple[StoreFigures, ...] = field(default=())  # each node's, by `/jsz`

    @property
    def flagged(self) -> bool:
        return any(d.flagged for d in self.devices)

    @property
    def totals(self) -> FleetTotals:
        ds = self.devices
        return FleetTotals(
            devices=len(ds),
            connected=sum(1 for d in ds if d.link_connected),
            flagged=sum(1 for d in ds if d.flagged),
            lag=sum(d.lag or 0 for d in ds),
            commands_pending=sum(d.commands.pending for d in ds),
            commands_expired=sum(d.commands.expired for d in ds),
            commands_done=sum(d.commands.done for d in ds),
            commands_failed=sum(d.commands.failed for d in ds),
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document (README, "Fleet operations"); keys only ever get added."""
        return {
            "schema": SCHEMA,
            "generated_at": self.generated_at,
            "silent_after_s": self.silent_after_s,
            "devices": [d.to_dict() for d in self.devices],
            **self.summary(),
        }

    def summary(self) -> dict[str, Any]:
        """What the document says of the whole fleet."""
        return {
            "flagged": self.flagged,
            "totals": asdict(self.totals),
            "warnings": list(self.warnings),
            "admission": [asdict(f) for f in self.admission],
            "store": [{**asdict(f), "used": round(f.used, 4)} for f in self.store],
        }
