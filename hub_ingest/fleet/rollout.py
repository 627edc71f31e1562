"""A rollout: which devices should run a release, in what order, and how far it has got.

The rollout is desired state in `ROLLOUT_BUCKET`: the plan (batches of device ids, the first
the canary) under ``rollout``, and ``desired.<id>`` = version for each device whose batch is
open. A device picks its desired version up whenever its link is up, days later if need be,
and reports each step as an ``evt.<id>.update`` event, which reaches the hub's
``FLEET_EVENTS`` like every event. `advance` (run by ``hub-ingest watch``) opens the next
batch once the open ones are through, and stops the rollout as soon as more than
``max_failures`` of their devices failed, refused it or rolled back.

A batch is through when each of its devices is healthy on the release, or is offline: not
heard from (no heartbeat at the hub) since its batch opened. An offline device does not hold
the fleet up: it takes the release whenever it returns, and the rollout stays running, and
so not done, until it has (or is aborted). The canary must have a healthy device before
anything else opens.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any

import structlog
from nats.js import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from edge_agent.protocol.names import EVENTS
from edge_agent.protocol.release import (
    ROLLOUT_BUCKET,
    ROLLOUT_KEY,
    UpdateState,
    desired_key,
)
from edge_agent.protocol.units import format_time, parse_time, utc_now_iso
from hub_ingest.core.config import HubConfig
from hub_ingest.core.errors import RegistryError, RolloutError
from hub_ingest.fleet.latest import heartbeat_subject, latest, update_report_subject
from hub_ingest.fleet.registry import Device, Registry
from hub_ingest.fleet.releases import get_record, rollout_bucket
from hub_ingest.fleet.streams import AGGREGATES

log = structlog.get_logger(__name__)


class RolloutState(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"  # open batches go on; no new batch opens
    STOPPED = "stopped"  # more than max_failures failed: resume or abort
    ABORTED = "aborted"  # devices not yet healthy on it no longer want it
    DONE = "done"


_EVENTS = next(a for a in AGGREGATES if a.device_stream == EVENTS)
ACTIVE = (RolloutState.RUNNING, RolloutState.PAUSED, RolloutState.STOPPED)
FAILURES = (UpdateState.FAILED, UpdateState.ROLLED_BACK, UpdateState.REFUSED)
WAITING = "waiting"  # its batch is not open yet
PENDING = "pending"  # its batch is open; it has not reported (offline?)
REMOVED = "removed"  # from the registry, since the rollout started
DONE_WITH = (UpdateState.HEALTHY, REMOVED)  # a batch of these is through


@dataclass
class Rollout:
    version: str
    batches: list[list[str]]  # device ids; the first batch is the canary
    max_failures: int
    state: RolloutState = RolloutState.RUNNING
    opened: int = 0  # batches[:opened] want the version
    opened_at: list[str] = field(default_factory=list)  # when each of them opened
    started_at: str = field(default_factory=utc_now_iso)
    reason: str = ""  # why it stopped, was aborted or paused

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Rollout:
        doc = json.loads(data)
        return cls(**{**doc, "state": RolloutState(doc["state"])})

    def batch_of(self, device_id: str) -> int:
        return next(i for i, batch in enumerate(self.batches) if device_id in batch)


@dataclass(frozen=True, slots=True)
class DeviceReport:
    device_id: str
    batch: int
    state: str  # WAITING, PENDING or an UpdateState
    bytes: int | None = None  # downloaded so far, while downloading
    reason: str = ""
    reported_at: str | None = None
    last_seen: str | None = None  # when its last heartbeat at the hub was sent, hub clock


def parse_shares(text: str) -> list[float]:
    """``10%,50%,100%`` as cumulative shares of the fleet; the last must be 100 %."""
    shares: list[float] = []
    for part in text.split(","):
        try:
            share = float(part.strip().removesuffix("%")) / 100
        except ValueError:
            raise RolloutError(
                f"--batches: expected percentages like 10%,100%, got {part!r}"
            ) from None
        if not 0 < share <= 1 or (shares and share <= shares[-1]):
            raise RolloutError(f"--batches: shares must grow, up to 100%, got {text!r}")
        shares.append(share)
    if shares[-1] != 1:
        raise RolloutError(f"--batches: the last batch must be 100%, got {text!r}")
    return shares


def plan_batches(device_ids: list[str], canary: int, shares: list[float]) -> list[list[str]]:
    """The canary (the first `canary` devices by id), then the fleet cut at each share."""
    ids = sorted(device_ids)
    cuts = [min(canary, len(ids))] + [math.ceil(s * len(ids)) for s in shares]
    batches, start = [], 0
    for cut in cuts:
        if cut > start:
            batches.append(ids[start:cut])
            start = cut
    return batches


async def _load(kv: KeyValue) -> tuple[Rollout, int] | None:
    try:
        entry = await kv.get(ROLLOUT_KEY)
    except KeyNotFoundError:
        return None
    return Rollout.from_json(entry.value or b""), entry.revision or 0


async def _save(kv: KeyValue, rollout: Rollout, revision: int | None) -> int:
    """Write `rollout` only if nobody else changed it since `revision` was read (None: if
    there is none); its new revision."""
    try:
        if revision is None:
            return await kv.create(ROLLOUT_KEY, rollout.to_json())
        return await kv.update(ROLLOUT_KEY, rollout.to_json(), last=revision)
    except KeyWrongLastSequenceError:
        raise RolloutError("the rollout changed meanwhile (another operator?): try again") from None


async def _open_batch(kv: KeyValue, rollout: Rollout) -> None:
    for device_id in rollout.batches[rollout.opened]:
        await kv.put(desired_key(device_id), rollout.version.encode())
    log.info("rollout_batch_opened", version=rollout.version, batch=rollout.opened)
    rollout.opened += 1
    rollout.opened_at.append(utc_now_iso())


async def start(
    js: JetStreamContext,
    config: HubConfig,
    version: str,
    *,
    canary: int,
    shares: list[float],
    max_failures: int,
) -> Rollout:
    """Record the rollout of a published `version` and open its canary batch."""
    kv = await rollout_bucket(js, config)
    if await get_record(kv, version) is None:
        raise RolloutError(f"release {version} is not published: hub-ingest release publish")
    current = await _load(kv)
    if current is not None and current[0].state in ACTIVE:
        running = current[0]
        raise RolloutError(
            f"the rollout of {running.version} is {running.state} (batch {running.opened} of "
            f"{len(running.batches)}): let it finish or abort it first"
        )
    devices = [d.device_id for d in await (await Registry.open(js)).list()]
    if not devices:
        raise RolloutError("no devices are enrolled")
    rollout = Rollout(version, plan_batches(devices, canary, shares), max_failures)
    revision = await _save(kv, rollout, current[1] if current else None)
    await _open_batch(kv, rollout)
    await _save(kv, rollout, revision)
    return rollout


async def advance(js: JetStreamContext, config: HubConfig) -> Rollout | None:
    """One step of a running rollout: stop it on too many failures, open the next batch
    when the open ones are through, or finish it."""
    try:
        kv = await js.key_value(ROLLOUT_BUCKET)  # never made here: every watcher runs this
    except BucketNotFoundError:
        return None  # nothing was ever published
    loaded = await _load(kv)
    if loaded is None or loaded[0].state != RolloutState.RUNNING:
        return loaded[0] if loaded else None
    rollout, revision = loaded
    reports = await read_reports(js, rollout)
    failed = [r for r in reports if r.state in FAILURES]
    opened = [r for r in reports if r.batch < rollout.opened]
    if len(failed) > rollout.max_failures:
        rollout.state = RolloutState.STOPPED
        rollout.reason = "; ".join(f"{r.device_id} {r.state}: {r.reason}" for r in failed)
        log.warning("rollout_stopped", version=rollout.version, failed=len(failed))
    elif not all(lets_through(rollout, r) for r in opened) or not any(
        r.state == UpdateState.HEALTHY for r in opened if r.batch == 0
    ):
        return rollout
    elif rollout.opened < len(rollout.batches):
        await _open_batch(kv, rollout)
    elif all(r.state in DONE_WITH for r in reports):
        rollout.state = RolloutState.DONE
        log.info("rollout_done", version=rollout.version)
    else:
        return rollout  # offline devices still to take it
    try:
        await _save(kv, rollout, revision)
    except RolloutError:  # another watcher (a node of a cluster hub) took this step
        return None
    return rollout


def lets_through(rollout: Rollout, report: DeviceReport) -> bool:
    """Whether `report`'s device lets its batch through: healthy, gone, or offline since its
    batch opened."""
    if report.state in DONE_WITH:
        return True
    if report.state != PENDING:
        return False  # on its way (downloading, staged, installed) or failed
    opened, seen = parse_time(rollout.opened_at[report.batch]), parse_time(report.last_seen)
    return seen is None or (opened is not None and seen < opened)


async def change(js: JetStreamContext, config: HubConfig, action: str) -> Rollout:
    """``pause``, ``resume`` or ``abort`` the rollout."""
    kv = await rollout_bucket(js, config)
    loaded = await _load(kv)
    if loaded is None or loaded[0].state not in ACTIVE:
        raise RolloutError("no rollout is running, paused or stopped")
    rollout, revision = loaded
    if action == "abort":
        rollout.state, rollout.reason = RolloutState.ABORTED, "aborted by an operator"
        healthy = {r.device_id for r in await read_reports(js, rollout) if r.state == "healthy"}
        for batch in rollout.batches[: rollout.opened]:
            for device_id in set(batch) - healthy:
                await kv.delete(desired_key(device_id))
    elif action == "pause":
        rollout.state, rollout.reason = RolloutState.PAUSED, "paused by an operator"
    else:
        if rollout.state == RolloutState.STOPPED:  # go on, accepting the failures so far
            failed = [r for r in await read_reports(js, rollout) if r.state in FAILURES]
            rollout.max_failures = max(rollout.max_failures, len(failed))
        rollout.state, rollout.reason = RolloutState.RUNNING, ""
    await _save(kv, rollout, revision)
    log.info("rollout_changed", version=rollout.version, state=rollout.state)
    return rollout


async def status(js: JetStreamContext, config: HubConfig) -> tuple[Rollout, list[DeviceReport]]:
    kv = await rollout_bucket(js, config)
    loaded = await _load(kv)
    if loaded is None:
        raise RolloutError("no rollout has been started")
    return loaded[0], await read_reports(js, loaded[0])


async def read_reports(js: JetStreamContext, rollout: Rollout) -> list[DeviceReport]:
    """Each device's last report about the rollout's version, from its update events, and
    for a device that has not reported, when its last heartbeat reached the hub."""
    registry = await Registry.open(js)
    ids = [device_id for batch in rollout.batches for device_id in batch]
    reports: list[DeviceReport] = []
    for start_at in range(0, len(ids), 32):
        reports += await asyncio.gather(
            *(_report(js, registry, rollout, d) for d in ids[start_at : start_at + 32])
        )
    return reports


async def _report(
    js: JetStreamContext, registry: Registry, rollout: Rollout, device_id: str
) -> DeviceReport:
    batch = rollout.batch_of(device_id)
    try:
        device: Device | None = await registry.get(device_id)
    except RegistryError:  # removed since the rollout started
        device = None
    if device is None or batch >= rollout.opened:
        return DeviceReport(device_id, batch, WAITING if device else REMOVED)
    stream = _EVENTS.stream_name(device.shard)
    last = await _last(js, stream, update_report_subject(device_id))
    if last is None or last.get("version") != rollout.version:
        heartbeat = await _last(js, stream, heartbeat_subject(device_id))
        return DeviceReport(device_id, batch, PENDING, last_seen=sent_at(heartbeat))
    return DeviceReport(
        device_id,
        batch,
        str(last.get("state")),
        bytes=last.get("bytes"),
        reason=str(last.get("reason") or ""),
        reported_at=last.get("at"),
    )


async def _last(js: JetStreamContext, stream: str, subject: str) -> dict[str, Any] | None:
    """The body of the last message on `subject` (or the one the trim kept of it), with
    ``stored_at``: when it reached `stream`."""
    try:
        msg = await js.get_last_msg(stream, subject)
        data, stored_at = msg.data, msg.time.isoformat() if msg.time else None
    except NotFoundError:
        kept = (await latest(js, [subject])).get(subject)
        if kept is None:
            return None
        data, stored_at = kept.data, kept.time
    try:
        body = json.loads(data or b"")
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    return {**body, "stored_at": stored_at}


def sent_at(heartbeat: dict[str, Any] | None) -> str | None:
    """When `heartbeat` left its device, on the hub's clock: its ``checked_at`` plus the
    device's last measured clock offset, never after it was stored at the hub.

    Not the store time alone: a heartbeat sent just before a link dropped can reach the
    aggregate after a batch opened (the mirror and the source lag), and would make a device
    that has been offline since look online, holding the batch up for good."""
    if heartbeat is None:
        return None
    stored = parse_time(heartbeat.get("stored_at"))
    checked = parse_time(heartbeat.get("checked_at"))
    offset = heartbeat.get("clock_offset_s")
    if checked is not None and isinstance(offset, int | float) and not isinstance(offset, bool):
        sent = checked + timedelta(seconds=offset)
        stored = sent if stored is None else min(stored, sent)
    return format_time(stored) if stored else None
