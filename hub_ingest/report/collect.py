"""The fleet report: what the hub knows about every registered device, right now.

Per device: whether its leaf link is connected (the hub's ``/leafz``, where a leaf is named
after the island's ``server_name``, ``edge-<id>``), lag and last activity of each aggregate
stream's source of it, the age of its newest heartbeat, its command backlog and its last
failed command. Devices not heard from for longer than ``silent_after`` are flagged.

Stream info is read as raw JSON from ``$JS.<domain>.API.STREAM.INFO.<name>``: nats-py's
dataclasses drop a source's ``external`` block, the only thing that says which device a source
reads from (every device's stream has the same name).

Command counts and the last failure come from the command index
(`hub_ingest.commands.index`), brought up to date first; pending and expired commands are the
ones ``CMD_<id>`` holds without a result. A call reads the backlog and what is new since the
last one, never the whole command history.

Everything is read from what already exists; a hub without ``COMMANDS``, without results or
with its monitoring endpoint down still gets a report, with the missing parts left empty.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client

from edge_agent.protocol.names import command_stream
from edge_agent.protocol.units import format_time, parse_time
from hub_ingest.commands.attribution import Attribution, attribute
from hub_ingest.commands.index import (
    TALLY_STREAM,
    CommandIndex,
    Tally,
    json_object,
    tally_subject,
)
from hub_ingest.core.config import HubConfig
from hub_ingest.core.replies import Stored
from hub_ingest.fleet.admission_figures import (
    AdmissionFigures,
    figure_warnings,
    read_figures,
    shared_devices,
)
from hub_ingest.fleet.gaps import MirrorGaps, read_gaps
from hub_ingest.fleet.latest import heartbeat_subject
from hub_ingest.fleet.registry import Device
from hub_ingest.fleet.streams import AGGREGATES, mirror_name, stream_list
from hub_ingest.report.flags import device_flags, gap_warnings, hub_gaps, refusal_warnings
from hub_ingest.report.heartbeats import (
    EVENTS,
    Forgeries,
    beat_figure,
    beat_uplinks,
    heartbeat_forgeries,
    last_heartbeats,
    readings_dropped,
)
from hub_ingest.report.hub import OFFLINE, HubApi, linked_leaves, monitor_urls
from hub_ingest.report.model import (
    SCHEMA,
    CommandCounts,
    CommandError,
    DeviceReport,
    FleetReport,
    GapCounts,
    SourceState,
)
from hub_ingest.report.store import StoreFigures, read_store, store_warnings

NOT_SOURCED = "not sourced"  # a source's error: the hub knows the incarnation, not the mirror
# Devices whose hub streams are read at once: a large fleet's report waits on round trips,
# not on the hub, which answers many requests in parallel.
CONCURRENT_DEVICES = 32


@dataclass(frozen=True, slots=True)
class _Command:
    id: str
    target: str  # a device id or "all"
    expires_at: datetime | None


def _command(subject: str, data: bytes) -> _Command | None:
    """The command in a ``CMD_<id>`` message; None for a malformed envelope, which has no id
    to match a result to (its device answers "rejected")."""
    envelope = json_object(data)
    tokens = subject.split(".")
    if envelope is None or not isinstance(envelope.get("id"), str) or len(tokens) < 3:
        return None
    return _Command(envelope["id"], tokens[1], parse_time(envelope.get("expires_at")))


async def _command_state(
    api: HubApi, tally: Tally, device_id: str, now: datetime
) -> tuple[CommandCounts, CommandError | None]:
    """Counts from the device's `Tally`; pending and expired from the commands its
    ``CMD_<id>`` still holds without a result (the backlog, never the whole history)."""
    stream = command_stream(device_id)
    state = ((await api.device_stream_info(stream)) or {}).get("state") or {}
    pending = expired = 0
    if state.get("messages"):
        for lo, hi in tally.unanswered(int(state["first_seq"]), int(state["last_seq"])):
            for command in filter(None, (_command(*m) for m in await api.messages(stream, lo, hi))):
                if command.expires_at is not None and command.expires_at <= now:
                    expired += 1
                else:
                    pending += 1
    counts = CommandCounts(pending=pending, expired=expired, done=tally.done, failed=tally.failed)
    last = tally.last_error
    return counts, None if last is None else CommandError(last.command_id, last.status, last.error)


def _source_state(
    info: dict[str, Any] | None, mirror: dict[str, Any] | None, name: str, device: Device
) -> SourceState:
    """How far `name` is behind the device: the hub's mirror of the device stream (the hop
    over the link) plus the aggregate's local source of that mirror."""
    aggregate = next(a for a in AGGREGATES if name.startswith(a.base_name))
    current = device.current(aggregate.device_stream)
    if current is None:
        return SourceState(
            name, aggregate.device_stream, False, None, None, "no incarnation seen yet"
        )
    wanted = mirror_name(device.device_id, current)
    if mirror and "offline" in mirror:
        return SourceState(name, aggregate.device_stream, True, None, None, mirror["offline"])
    link = (mirror or {}).get("mirror") or {}
    skipped = (mirror.get("state") or {}).get("num_deleted", 0) if mirror else None
    for src in (info or {}).get("sources") or []:
        if src.get("name") == wanted:
            active = link.get("active")
            error = link.get("error") or src.get("error")
            return SourceState(
                stream=name,
                device_stream=aggregate.device_stream,
                sourced=True,
                lag=int(link.get("lag", 0)) + int(src.get("lag", 0)),
                # -1: no contact with the device since the hub (re)started mirroring
                last_active_s=round(active / 1e9, 3)
                if isinstance(active, int) and active >= 0
                else None,
                error=error.get("description") if isinstance(error, dict) else error,
                skipped=skipped,
            )
    return SourceState(name, aggregate.device_stream, False, None, None, NOT_SOURCED, skipped)


async def _mirror_info(api: HubApi, device: Device, device_stream: str) -> dict[str, Any] | None:
    current = device.current(device_stream)
    if current is None:
        return None
    return await api.device_stream_info(mirror_name(device.device_id, current))


def _current(device: Device, record: MirrorGaps) -> bool:
    incarnation = device.current(record.device_stream)
    return incarnation is not None and incarnation.id == record.incarnation


@dataclass(frozen=True, slots=True)
class _Fleet:
    """What every device's part of the report reads, read once for the fleet."""

    api: HubApi
    tallies: Mapping[str, Tally]  # by device id; none yet: no result read
    infos: dict[str, dict[str, Any] | None]  # the aggregates
    mirror_gaps: Mapping[str, MirrorGaps]
    leaves: set[str] | None
    forged: Forgeries
    now: datetime
    silent_after: float
    heartbeats: Mapping[str, Stored]  # each device's last, by subject
    shared: set[str]  # devices whose key links from two machines (`fleet.shared_keys`)


async def _device_report(fleet: _Fleet, device: Device) -> tuple[DeviceReport, list[str]]:
    """One device's line of the report, and the warnings it adds."""
    warnings: list[str] = []
    records = [
        fleet.mirror_gaps[name]
        for i in device.incarnations
        if (name := mirror_name(device.device_id, i)) in fleet.mirror_gaps
    ]
    device_gaps = GapCounts.of(records, fleet.now)
    current = [r for r in records if _current(device, r)]
    accounted = {
        stream: GapCounts.of(
            [r for r in current if r.device_stream == stream], fleet.now
        ).accounted()
        for stream in {r.device_stream for r in current}
    }
    sources = tuple(
        [
            _source_state(
                fleet.infos[a.stream_name(device.shard)],
                await _mirror_info(fleet.api, device, a.device_stream),
                a.stream_name(device.shard),
                device,
            )
            for a in AGGREGATES
        ]
    )
    if any(s.error == OFFLINE for s in sources):
        warnings.append(f"device {device.device_id}: its streams on the hub are {OFFLINE}")
    warnings.extend(
        f"device {device.device_id}: the hub has seen its {s.device_stream} (incarnation "
        f"{incarnation.id}) but does not take it in: its provisioning failed? (hub-ingest "
        "watch's log says why; `hub-ingest provision` tries again)"
        for s in sources
        if s.error == NOT_SOURCED and (incarnation := device.current(s.device_stream))
    )
    subject = heartbeat_subject(device.device_id)
    heartbeat = fleet.heartbeats.get(subject)
    beat = json_object(heartbeat.data) if heartbeat else None
    if heartbeat is not None and not (sender := attribute(subject, beat, "heartbeat")).trusted:
        fleet.forged.note(sender)
        heartbeat = beat = None  # it names another device: not this one's word on itself
    beat_at = parse_time(heartbeat.time) if heartbeat else None
    beat_age = round(max((fleet.now - beat_at).total_seconds(), 0.0), 3) if beat_at else None
    ages = [a for a in (beat_age, *(s.last_active_s for s in sources)) if a is not None]
    last_seen = min(ages) if ages else None
    tally = fleet.tallies.get(device.device_id, Tally())
    if tally.forged:
        fleet.forged.note(Attribution(device.device_id, tally.forged_example), tally.forged)
    counts, last_error = await _command_state(fleet.api, tally, device.device_id, fleet.now)
    gaps = hub_gaps(sources, beat, accounted)
    warnings.extend(
        f"device {device.device_id}: the hub's copy of its {stream} skipped {skipped} "
        f"sequences, the device reports dropping {dropped} (hub-ingest audit names them)"
        for stream, (skipped, dropped) in gaps.items()
    )
    warnings.extend(gap_warnings(device.device_id, device_gaps))
    warnings.extend(refusal_warnings(device))
    report = DeviceReport(
        device_id=device.device_id,
        domain=device.domain,
        shard=device.shard,
        link_connected=None
        if fleet.leaves is None
        else not fleet.leaves.isdisjoint(device.leaf_names),
        sources=sources,
        last_heartbeat_at=format_time(beat_at) if beat_at else None,
        last_heartbeat_age_s=beat_age,
        last_seen_s=last_seen,
        telemetry_dropped=readings_dropped(beat),
        dead_letters=beat_figure(beat, "outbox", "dead_letters"),
        commands=counts,
        last_error=last_error,
        flags=device_flags(
            last_seen,
            fleet.silent_after,
            gaps,
            device_gaps,
            shared=device.device_id in fleet.shared,
            refused=bool(device.refused),
        ),
        incarnations=device.incarnations,
        refused=device.refused,
        forged_events=fleet.forged.counts[device.device_id],
        uplinks=beat_uplinks(beat),
        gaps=device_gaps,
    )
    return report, warnings


class Collection:
    """A report being read: what the whole fleet shares was read at `start_report`; each
    device's part is read as `devices` is iterated, in ``device_id`` order, so a large
    fleet's report can be written out while the rest is still being read. `warnings` is
    complete once `devices` is exhausted."""

    def __init__(
        self,
        fleet: _Fleet,
        devices: list[Device],
        warnings: list[str],
        admission: list[AdmissionFigures],
        store: list[StoreFigures],
    ) -> None:
        self.generated_at = format_time(fleet.now)
        self.silent_after_s = fleet.silent_after
        self.warnings = warnings
        self.admission = admission
        self.store = store
        self._fleet, self._devices = fleet, devices

    def header(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "generated_at": self.generated_at,
            "silent_after_s": self.silent_after_s,
        }

    def finish(self, reports: Iterable[DeviceReport]) -> FleetReport:
        """The report of `reports`, read from `devices` to the end."""
        return FleetReport(
            self.generated_at,
            self.silent_after_s,
            tuple(reports),
            tuple(self.warnings),
            tuple(self.admission),
            tuple(self.store),
        )

    async def report(self) -> FleetReport:
        return self.finish([d async for d in self.devices()])

    async def devices(self) -> AsyncIterator[DeviceReport]:
        gate = asyncio.Semaphore(CONCURRENT_DEVICES)

        async def read(device: Device) -> tuple[DeviceReport, list[str]]:
            async with gate:
                return await _device_report(self._fleet, device)

        reading = [asyncio.ensure_future(read(d)) for d in self._devices]
        dead_letters: list[str] = []
        try:
            for step in reading:
                report, said = await step
                self.warnings.extend(said)
                if report.dead_letters:
                    dead_letters.append(
                        f"device {report.device_id} has {report.dead_letters} outbox rows its "
                        f"island refused for good (edge-agent dead-letter list, on the device)"
                    )
                yield report
        finally:
            for step in reading:  # a reader that stops early leaves no request running
                step.cancel()
        self.warnings.extend(self._fleet.forged.warnings())
        self.warnings.extend(dead_letters)


async def start_report(
    nc: Client,
    config: HubConfig,
    devices: Iterable[Device],
    *,
    silent_after: float,
    monitor: str | None = None,
) -> Collection:
    """Read what every device's part of the report shares: the aggregates, the links, the
    command index, the heartbeats and the gaps."""
    domain = config.nats.domain
    # nats-py's 5 s, not the hub tools' 20: a report taken while a cluster elects a leader is
    # asked again by its caller sooner (the chaos test's report during a node kill is).
    js = nc.jetstream(domain=domain)
    # Every stream's info in one listing, where one request each would cost four per device;
    # on a single server only: on a cluster the listing needs the meta leader, which is away
    # for seconds when a node dies, where asking each stream needs only its own replicas.
    listed = await stream_list(js) if config.cluster is None else []
    api = HubApi(nc, domain, listed=listed)
    devices = sorted(devices, key=lambda d: d.device_id)
    warnings: list[str] = []
    now = datetime.now(UTC)

    urls = {"hub": monitor} if monitor else monitor_urls(config)
    leaves = await asyncio.to_thread(linked_leaves, urls.values(), warnings)
    store = await asyncio.to_thread(read_store, urls)
    warnings.extend(store_warnings(store, listed))

    names = sorted({a.stream_name(d.shard) for d in devices for a in AGGREGATES})
    infos = {name: await api.stream_info(name) for name in names}
    warnings.extend(f"aggregate stream {n} does not exist" for n, i in infos.items() if i is None)

    event_streams = [n for n in names if infos[n] is not None and n.startswith(EVENTS.base_name)]
    index = await CommandIndex.open(js, config.replicas)
    await index.catch_up(event_streams, commands=False)
    forged = Forgeries()
    for name in event_streams:
        await heartbeat_forgeries(api, name, forged)

    heartbeats = await last_heartbeats(js, api, infos, devices)
    gaps = await read_gaps(js)
    tallies = await _tallies(api, devices)
    admission: list[AdmissionFigures] = []
    if config.server.admission == "callout":
        admission = await read_figures(js)
        warnings.extend(figure_warnings(admission, now))
    shared = shared_devices(admission, now)
    fleet = _Fleet(api, tallies, infos, gaps, leaves, forged, now, silent_after, heartbeats, shared)
    return Collection(fleet, devices, warnings, admission, store)


async def _tallies(api: HubApi, devices: Iterable[Device]) -> dict[str, Tally]:
    """Each device's command tally, as the index (caught up) holds it."""
    subjects = {tally_subject(d.device_id): d.device_id for d in devices}
    stored = await api.last_messages(TALLY_STREAM, list(subjects))
    # An empty value is a deleted key's marker.
    return {subjects[s]: Tally.from_json(m.data) for s, m in stored.items() if m.data}


async def collect_report(
    nc: Client,
    config: HubConfig,
    devices: Iterable[Device],
    *,
    silent_after: float,
    monitor: str | None = None,
) -> FleetReport:
    """Read the hub's streams and monitoring endpoint into a `FleetReport`."""
    started = await start_report(nc, config, devices, silent_after=silent_after, monitor=monitor)
    return await started.report()
