"""Health of the device: the island, the leaf link, the streams and the command mirror.

Everything is read from the island's monitoring endpoint, so ``edge-agent status`` works with
no NATS credentials and even while the agent itself is down. The agent adds what only it
knows (when the link last changed state) in small JSON files under its state directory.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import structlog

from edge_agent.commands.ledger import CommandStats
from edge_agent.commands.ledger import read_stats as read_command_stats
from edge_agent.core.config import Config
from edge_agent.core.statedb import open_readonly
from edge_agent.island.link import LinkState, clock_path, link_path
from edge_agent.island.server import quarantine_dir, quarantined
from edge_agent.island.unstall import unstalled
from edge_agent.outbox.store import OutboxStats
from edge_agent.outbox.store import read_stats as read_outbox_stats
from edge_agent.protocol.errors import MonitorUnavailable
from edge_agent.protocol.files import read_json
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.names import COMMAND_MIRROR, EVENTS, INCARNATION, TELEMETRY, hub_consumer
from edge_agent.protocol.pack import PACK_SUBJECT, READINGS
from edge_agent.protocol.units import format_size, parse_time, utc_now_iso
from edge_agent.status.reach import HubReach, reach_hub

log = structlog.get_logger(__name__)

BUDGET_WARN_PCT = 90.0
# A link down this long while the hub answers is not a reconnect under way (the island tries
# every `hub.reconnect`): the hub turns the device away, or cannot take it now.
TURNED_AWAY_S = 30.0


@dataclass(frozen=True, slots=True)
class Uplink:
    """An outbound stream's hop to the hub, read from the consumer the hub's mirror binds to.

    A message counts as crossed once the hub's mirror has confirmed it (the consumer's ack
    floor, which flow control moves); everything after it is still the device's backlog.
    """

    confirmed_seq: int
    last_crossed: str | None  # when the hub last confirmed a message (None: never)
    backlog_messages: int
    backlog_bytes: int  # estimated from the stream's mean message size
    window: int  # messages the hub's mirror may have in flight (`edge_agent.island.windows`)
    drain_rate: float | None = None  # messages/s confirmed since the previous sample
    drain_eta_s: float | None = None  # backlog at that rate; 0 with no backlog


@dataclass(frozen=True, slots=True)
class StreamStatus:
    name: str
    messages: int
    bytes: int
    max_bytes: int
    budget_used_pct: float
    first_seq: int
    last_seq: int
    # Messages removed from the device before anyone could have read them all: the budget or
    # max_age forced them out. The hub's sourcing may still have copied some of them.
    dropped: int
    # The stream's incarnation (see `streams`): a new one after a re-image or a new store.
    incarnation: str | None = None
    uplink: Uplink | None = None  # outbound streams only
    # TELEMETRY holds packs of READINGS (`hub.pack`): its figures count packs, and
    # READINGS', with TELEMETRY's incarnation, count readings.
    packed: bool = False


@dataclass(frozen=True, slots=True)
class MirrorStatus:
    lag: int
    last_contact_s: float | None
    error: str | None


@dataclass(frozen=True, slots=True)
class Status:
    device_id: str
    island_up: bool
    link: LinkState
    streams: dict[str, StreamStatus] = field(default_factory=dict)
    mirror: MirrorStatus | None = None
    outbox: OutboxStats | None = None
    commands: CommandStats | None = None
    problems: list[str] = field(default_factory=list)
    checked_at: str = ""
    # Hub minus device clock at the agent's last sync with the hub (None: not synced since the
    # agent started); see `edge_agent.commands.hubclock`.
    clock_offset_s: float | None = None
    # Island streams a power cut damaged beyond repair, set aside by the agent (see
    # `Island._set_aside`): what they held that had not reached the hub is lost.
    quarantined: list[str] = field(default_factory=list)
    # Times the agent found a hub mirror's consumer stuck and had it bound afresh (`unstall`):
    # nothing was lost, the mirror took what it lacked after each.
    uplink_unstalled: int = 0
    # With the link down, whether the hub answered (`reach`): asked by ``edge-agent status``.
    hub: HubReach | None = None

    @property
    def healthy(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["healthy"] = self.healthy
        return out


def _uplink(detail: dict[str, Any], incarnation: str | None) -> Uplink | None:
    if incarnation is None:
        return None
    consumer = next(
        (
            c
            for c in detail.get("consumer_detail") or []
            if c.get("name") == hub_consumer(incarnation)
        ),
        None,
    )
    if consumer is None:
        return None
    state = detail.get("state") or {}
    floor = consumer.get("ack_floor") or {}
    confirmed = int(floor.get("stream_seq", 0))
    messages, size = int(state.get("messages", 0)), int(state.get("bytes", 0))
    # Messages the budget evicted before they crossed are counted as `dropped`, not backlog.
    backlog = max(
        0, int(state.get("last_seq", 0)) - max(confirmed, int(state.get("first_seq", 1)) - 1)
    )
    last = floor.get("last_active")
    return Uplink(
        confirmed_seq=confirmed,
        last_crossed=str(last) if confirmed and last else None,
        backlog_messages=backlog,
        backlog_bytes=backlog * size // messages if messages else 0,
        window=int((consumer.get("config") or {}).get("max_ack_pending", 0)),
        drain_eta_s=0.0 if backlog == 0 else None,
    )


def with_drain_rates(status: Status, previous: Status | None) -> Status:
    """`status` with each uplink's drain rate and time to drain since `previous`."""
    now_at = parse_time(status.checked_at)
    then_at = parse_time(previous.checked_at) if previous else None
    if previous is None or now_at is None or then_at is None or now_at <= then_at:
        return status
    elapsed = (now_at - then_at).total_seconds()
    streams = dict(status.streams)
    for name, stream in status.streams.items():
        before = previous.streams.get(name)
        if before is None or before.incarnation != stream.incarnation:
            continue
        now, then = stream.uplink, before.uplink
        if now is None or then is None:
            continue
        rate = max(0, now.confirmed_seq - then.confirmed_seq) / elapsed
        eta = 0.0 if not now.backlog_messages else (now.backlog_messages / rate if rate else None)
        uplink = replace(
            now, drain_rate=round(rate, 2), drain_eta_s=None if eta is None else round(eta, 1)
        )
        streams[name] = replace(stream, uplink=uplink)
    return replace(status, streams=streams)


def _stream_status(detail: dict[str, Any]) -> StreamStatus:
    state = detail.get("state") or {}
    config = detail.get("config") or {}
    max_bytes = int(config.get("max_bytes", -1))
    used = int(state.get("bytes", 0))
    first_seq = int(state.get("first_seq", 0))
    incarnation = (config.get("metadata") or {}).get(INCARNATION)
    return StreamStatus(
        name=str(detail.get("name")),
        messages=int(state.get("messages", 0)),
        bytes=used,
        max_bytes=max_bytes,
        budget_used_pct=round(100.0 * used / max_bytes, 1) if max_bytes > 0 else 0.0,
        first_seq=first_seq,
        last_seq=int(state.get("last_seq", 0)),
        dropped=max(first_seq - 1, 0),
        incarnation=incarnation,
        uplink=_uplink(detail, incarnation),
        packed=config.get("subjects") == [PACK_SUBJECT],
    )


def _mirror_status(detail: dict[str, Any]) -> MirrorStatus | None:
    mirror = detail.get("mirror")
    if not mirror:
        return None
    active_ns = mirror.get("active")
    error = mirror.get("error")
    return MirrorStatus(
        lag=int(mirror.get("lag", 0)),
        last_contact_s=round(active_ns / 1e9, 3)
        if isinstance(active_ns, int) and active_ns >= 0
        else None,
        error=error.get("description") if isinstance(error, dict) else error,
    )


def _local_state(config: Config) -> tuple[OutboxStats, CommandStats] | None:
    """Outbox and ledger figures from the agent's SQLite file (None before its first run)."""
    try:
        conn = open_readonly(config.agent.database)
        if conn is None:
            return None
        try:
            return read_outbox_stats(conn, config.outbox.max_bytes), read_command_stats(conn)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        log.warning("state_db_unreadable", path=str(config.agent.database), error=str(exc))
        return None


def _device_problems(config: Config, box: OutboxStats | None, damaged: list[str]) -> list[str]:
    """What the agent's own files say is wrong: its outbox and the streams it set aside."""
    problems = []
    if box and box.bytes >= box.max_bytes * BUDGET_WARN_PCT / 100:
        problems.append(f"outbox at {box.bytes} of {box.max_bytes} bytes")
    if damaged:
        problems.append(
            f"{len(damaged)} damaged island streams set aside in {quarantine_dir(config)} "
            f"(what they held that had not reached the hub is lost)"
        )
    if box and box.dead_letters:
        problems.append(
            f"{box.dead_letters} outbox rows refused by the island for good "
            f"(edge-agent dead-letter list)"
        )
    return problems


def _turned_away(reach: HubReach, since: str | None) -> str | None:
    """The problem of a link down for `TURNED_AWAY_S` or more while the hub answers."""
    went = parse_time(since) if since else None
    if not reach.answered or went is None:
        return None
    down_s = time.time() - went.timestamp()
    if down_s < TURNED_AWAY_S:
        return None
    return (
        f"leaf link down for {down_s:.0f}s while the hub answers at {reach.url} (server "
        f"{reach.server or '?'}): the hub refuses this device (its key removed, not "
        f"registered, or in use on another machine too, as after a disk copied: "
        f"`hub-ingest report` lists the refusals) or cannot take the link now"
    )


async def collect_status(
    config: Config, monitor: Monitor | None = None, *, ask_hub: bool = False
) -> Status:
    """Read the island's state into a `Status`; never raises for an island that is down. With
    `ask_hub`, a link that is down is told apart from a hub that is unreachable (`reach`)."""
    monitor = monitor or Monitor(config.island.monitor_url)
    saved = read_json(link_path(config))
    clock = (read_json(clock_path(config)) or {}).get("offset_s")
    offset = float(clock) if isinstance(clock, int | float) else None
    local = await asyncio.to_thread(_local_state, config)
    box, cmds = local if local else (None, None)
    try:
        healthz = await monitor.get("/healthz")
        leaf_up = await monitor.leaf_connected()
        jsz = await monitor.get("/jsz?streams=true&consumers=true&config=true")
    except MonitorUnavailable as exc:
        return Status(
            device_id=config.device_id,
            island_up=False,
            link=LinkState(False, None),
            outbox=box,
            commands=cmds,
            problems=[f"island unreachable: {exc}"],
            checked_at=utc_now_iso(),
            clock_offset_s=offset,
            uplink_unstalled=unstalled(config),
        )
    since = saved.get("since") if saved and saved.get("up") == leaf_up else None
    problems: list[str] = []
    if healthz.get("status") != "ok":
        problems.append(f"island unhealthy: {healthz.get('error') or healthz}")
    details = [
        d for acc in jsz.get("account_details") or [] for d in acc.get("stream_detail") or []
    ]
    by_name = {d.get("name"): d for d in details}
    streams: dict[str, StreamStatus] = {}
    for name in (TELEMETRY, EVENTS, COMMAND_MIRROR):
        if name not in by_name:
            problems.append(f"stream {name} missing")
            continue
        streams[name] = _stream_status(by_name[name])
        if streams[name].budget_used_pct >= BUDGET_WARN_PCT and name != TELEMETRY:
            problems.append(f"stream {name} at {streams[name].budget_used_pct}% of its budget")
    if (packs := streams.get(TELEMETRY)) and packs.packed:
        if READINGS in by_name:
            readings = _stream_status(by_name[READINGS])
            streams[READINGS] = replace(readings, incarnation=packs.incarnation)
        else:
            problems.append(f"stream {READINGS} missing")
    hub = await reach_hub(config.hub.urls) if ask_hub and not leaf_up else None
    if hub and (turned_away := _turned_away(hub, since)):
        problems.append(turned_away)
    mirror = _mirror_status(by_name[COMMAND_MIRROR]) if COMMAND_MIRROR in by_name else None
    if mirror and mirror.error and leaf_up:
        problems.append(f"command mirror error: {mirror.error}")
    damaged = quarantined(config)
    problems += _device_problems(config, box, damaged)
    return Status(
        device_id=config.device_id,
        island_up=healthz.get("status") == "ok",
        link=LinkState(leaf_up, since),
        streams=streams,
        mirror=mirror,
        outbox=box,
        commands=cmds,
        problems=problems,
        checked_at=utc_now_iso(),
        clock_offset_s=offset,
        quarantined=damaged,
        uplink_unstalled=unstalled(config),
        hub=hub,
    )


def render_status(status: Status) -> str:
    """A short human-readable report (``edge-agent status`` without ``--json``)."""
    link = "up" if status.link.up else "down"
    lines = [
        f"device      {status.device_id}",
        f"health      {'healthy' if status.healthy else 'DEGRADED'}",
        f"island      {'up' if status.island_up else 'DOWN'}",
        f"link        {link}" + (f" since {status.link.since}" if status.link.since else ""),
    ]
    if (hub := status.hub) is not None:
        said = f"answers ({hub.server or 'unnamed'})" if hub.answered else f"no answer: {hub.error}"
        lines.append(f"hub         {hub.url or '-'} {said}")
    if status.streams:
        lines.append(f"{'stream':<12}{'messages':>10}{'bytes':>12}{'budget':>8}{'dropped':>9}")
        for s in status.streams.values():
            lines.append(
                f"{s.name:<12}{s.messages:>10}{format_size(s.bytes):>12}"
                f"{s.budget_used_pct:>7.1f}%{s.dropped:>9}"
            )
    for s in status.streams.values():
        if s.uplink is not None:
            up = s.uplink
            eta = f", drains in {up.drain_eta_s:.0f}s" if up.drain_eta_s else ""
            waiting = format_size(up.backlog_bytes)
            lines.append(
                f"uplink      {s.name}: {up.backlog_messages} waiting ({waiting})"
                f"{eta}, window {up.window}, last crossed {up.last_crossed or 'never'}"
            )
    if status.uplink_unstalled:
        lines.append(
            f"uplink      stuck and bound afresh {status.uplink_unstalled} times (nothing lost)"
        )
    if status.mirror is not None:
        contact = (
            f"{status.mirror.last_contact_s:.1f}s ago"
            if status.mirror.last_contact_s is not None
            else "never"
        )
        lines.append(f"mirror      lag {status.mirror.lag}, last contact {contact}")
    if status.outbox is not None:
        box = status.outbox
        oldest = f", oldest {box.oldest_age_s:.1f}s" if box.oldest_age_s is not None else ""
        lines.append(f"outbox      {box.depth} waiting, {format_size(box.bytes)}{oldest}")
    if status.commands is not None:
        c = status.commands
        lines.append(
            f"commands    last seq {c.last_seq or '-'}: {c.executed} ok, {c.failed} failed, "
            f"{c.rejected} rejected, {c.expired} expired"
        )
    lines.extend(f"problem     {p}" for p in status.problems)
    return "\n".join(lines)


def heartbeat_payload(
    status: Status, started_at: float, packer: Mapping[str, int] | None = None
) -> bytes:
    """The heartbeat's body; with `packer`, what the packer did since the agent started
    (`edge_agent.island.packer.PackerStats`)."""
    body = status.to_dict()
    body["uptime_s"] = round(time.monotonic() - started_at, 1)
    if packer is not None:
        body["packer"] = dict(packer)
    return json.dumps(body, separators=(",", ":")).encode()
