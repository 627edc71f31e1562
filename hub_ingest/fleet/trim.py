"""The hub's streams trimmed of what the archive holds: the aggregates and the hub mirrors
are a buffer in front of it, and without a trim every hub's store fills in time
(docs/operations.md, "The hub's store fills").

After each ``run --once``, and on ``hub-ingest trim``, each aggregate shard loses its rows
below the first one that is either not archived yet (the table's
``hub-ingest.archived.<stream>``) or younger than ``ingest.keep_on_hub``, and each hub mirror
it sources loses its rows below the first one the shard still holds (a mirror's rows are in
order there) or, when the shard holds none of it, below what the shard has not sourced yet.

- A shard and its mirrors are left whole while one of them has a skipped sequence that the
  refill has not settled: the refill finds it by the mirror's deleted sequences, and looks for
  it in the shard before it reads it from the island again (a row trimmed there would be read
  again, and archived twice).
- Purging a stream's head leaves its sources where they stand (nats-server keeps their state
  through a purge), and a trimmed mirror's new first sequence is written in its
  ``FLEET_GAPS`` record so that the refill does not take it for a skipped head.
- Before an events shard is purged, each device's latest heartbeat and update report in what
  goes are kept (`hub_ingest.fleet.latest`); the command index reads its results first
  (`hub_ingest.archive.maintenance.trim`).

- A removed device's ``CMD_<id>`` is deleted, and its hub mirrors once the shards hold none
  of its rows (`hub_ingest.fleet.retired`).

Not trimmed: ``FLEET_REFILL``, whose subjects make a refill happen once.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from edge_agent.protocol.names import js_api
from hub_ingest.core.buckets import open_bucket
from hub_ingest.core.config import HubConfig
from hub_ingest.core.gather import REQUESTS_AT_ONCE, gather_bounded
from hub_ingest.core.replies import direct_get
from hub_ingest.fleet.aggregate_rows import source_lags, sourced_row
from hub_ingest.fleet.gaps import BUCKET, Target, expand, read_record, refilled_seqs
from hub_ingest.fleet.latest import keep_latest
from hub_ingest.fleet.provision import mirror_targets
from hub_ingest.fleet.registry import Device
from hub_ingest.fleet.requests import Listed, deleted_seqs, states_of
from hub_ingest.fleet.retired import delete_leftovers
from hub_ingest.fleet.streams import AGGREGATES, shard_of, stream_list

log = structlog.get_logger(__name__)

_EVENTS = AGGREGATES[1]


@dataclass(frozen=True, slots=True)
class Trimmed:
    """One stream's head purged."""

    stream: str
    messages: int  # purged
    first: int  # its first sequence now


@dataclass(slots=True)
class TrimReport:
    streams: list[Trimmed] = field(default_factory=list)
    held_for_refill: list[str] = field(default_factory=list)  # mirrors that held their shard
    failed: list[str] = field(default_factory=list)  # shards a request failed for
    deleted: list[str] = field(default_factory=list)  # removed devices' streams

    @property
    def messages(self) -> int:
        return sum(t.messages for t in self.streams)

    def to_dict(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "streams": [dataclasses.asdict(t) for t in self.streams],
            "held_for_refill": self.held_for_refill,
            "failed": self.failed,
            "deleted": self.deleted,
        }


async def trim_hub(
    js: JetStreamContext,
    nc: Client,
    config: HubConfig,
    archived: Mapping[str, int],
    devices: list[Device],
    *,
    now: datetime | None = None,
) -> TrimReport:
    """Purge what `archived` (aggregate stream → highest archived hub sequence) holds and is
    older than ``ingest.keep_on_hub`` from the aggregate shards and their hub mirrors
    (`devices`: the registry's)."""
    api = js_api(config.nats.domain)
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=config.ingest.keep_on_hub)
    targets = mirror_targets(devices)
    shards = {name for name in archived if shard_of(name)}
    every = await stream_list(js)
    listed = states_of(every, shards | set(targets))
    report = TrimReport()
    hub = _Hub(
        js,
        nc,
        api,
        await open_bucket(js, BUCKET, replicas=config.replicas),
        devices,
        config.replicas,
    )
    for shard in sorted(shards & set(listed)):
        mirrors = [
            (t, listed[t.mirror])
            for t in targets.values()
            if t.aggregate == shard and t.mirror in listed
        ]
        try:
            floor = min(archived[shard] + 1, await _first_since(nc, api, shard, cutoff))
            await _trim_shard(
                hub, shard, listed[shard], floor=floor, mirrors=mirrors, report=report
            )
        except (nats.errors.Error, TimeoutError) as exc:
            # A node that holds some of its mirrors is down: the next run trims them.
            log.warning("hub_trim_failed", stream=shard, error=repr(exc))
            report.failed.append(shard)
    # After the shards: a removed device's mirror goes once they hold none of its rows.
    try:
        report.deleted = await delete_leftovers(js, nc, api, hub.kv, listed=every, devices=devices)
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning("removed_device_streams_kept", error=repr(exc))  # the next run, then
    log.info(
        "hub_trimmed",
        messages=report.messages,
        streams=len(report.streams),
        held_for_refill=report.held_for_refill,
        failed=report.failed,
        deleted=len(report.deleted),
    )
    return report


async def _trim_shard(
    hub: _Hub,
    shard: str,
    state: Listed,
    *,
    floor: int,
    mirrors: list[tuple[Target, Listed]],
    report: TrimReport,
) -> None:
    skipped = [t for t, s in mirrors if s.deleted]
    found = await gather_bounded((_unsettled(hub, t) for t in skipped), REQUESTS_AT_ONCE)
    unsettled = [t.mirror for t, unsettled in zip(skipped, found, strict=True) if unsettled]
    if unsettled:
        report.held_for_refill.extend(unsettled)
        return
    if shard.startswith(_EVENTS.base_name):
        devices = [d for d in hub.devices if _EVENTS.stream_name(d.shard) == shard]
        await keep_latest(
            hub.js, shard, below=min(floor, state.last + 1), devices=devices, replicas=hub.replicas
        )
    if purged := await _purge(hub.nc, hub.api, shard, floor, state):
        report.streams.append(purged)
    lags = await source_lags(hub.nc, hub.api, shard)
    trims = (_trim_mirror(hub, target, floor, state, lags) for target, state in mirrors)
    report.streams.extend(t for t in await gather_bounded(trims, REQUESTS_AT_ONCE) if t)


@dataclass(frozen=True, slots=True)
class _Hub:
    js: JetStreamContext
    nc: Client
    api: str
    kv: KeyValue  # FLEET_GAPS
    devices: list[Device]
    replicas: int  # of the buckets it makes


async def _trim_mirror(
    hub: _Hub,
    target: Target,
    aggregate_floor: int,
    state: Listed,
    lags: Mapping[str, int | None],
) -> Trimmed | None:
    if state.first > state.last:
        return None  # empty
    floor = await sourced_row(hub.nc, hub.api, target, aggregate_floor)
    if floor is None and (lag := lags.get(target.mirror)) is not None:
        # The aggregate holds none of the mirror's rows from its floor on: all it sourced is
        # below it. The mirror's last sequence was listed before the lags, so this errs low.
        floor = state.last - lag + 1
    if floor is None or not (purged := await _purge(hub.nc, hub.api, target.mirror, floor, state)):
        return None
    await _record_head(hub.kv, target, purged.first)
    return purged


async def _first_since(nc: Client, api: str, stream: str, since: datetime) -> int:
    """The sequence of `stream`'s first message stored at or after `since` (past its last
    when there is none)."""
    request = {"start_time": since.isoformat(), "batch": 1}
    msgs = await direct_get(nc, api, stream, request, timeout=10)
    if msgs:
        return int((msgs[0].headers or {})["Nats-Sequence"])
    return 2**63


async def _unsettled(hub: _Hub, target: Target) -> bool:
    """Whether the mirror skipped a sequence that the refill has neither read again, found
    in the aggregate, counted lost nor kept as pending: it may be in the aggregate, where
    the refill must find it before it is trimmed, or it would be read again."""
    skipped = await deleted_seqs(hub.nc, hub.api, target.mirror)
    if not skipped:
        return False
    record = await read_record(hub.kv, target)
    settled = await refilled_seqs(hub.js, target.mirror)
    settled |= expand(record.kept) | expand(record.pending)
    settled = settled.union(*(expand(r) for r in record.lost.values()))
    return bool(skipped - settled)


async def _purge(nc: Client, api: str, stream: str, floor: int, state: Listed) -> Trimmed | None:
    """Purge `stream` below `floor`; what was purged (None: nothing was below it)."""
    floor = min(floor, state.last + 1)
    if floor <= state.first:
        return None
    request = json.dumps({"seq": floor}).encode()
    reply = json.loads((await nc.request(f"{api}.STREAM.PURGE.{stream}", request, timeout=10)).data)
    if "error" in reply:
        log.warning("hub_trim_refused", stream=stream, error=reply["error"])
        return None
    info = json.loads((await nc.request(f"{api}.STREAM.INFO.{stream}", b"", timeout=10)).data)
    first = int((info.get("state") or {}).get("first_seq", floor))
    return Trimmed(stream, int(reply.get("purged", 0)), first)


async def _record_head(kv: KeyValue, target: Target, first: int) -> None:
    """The refill compares a mirror's first sequence with its record's head: the same, it is
    not looked at as a head made again."""
    record = await read_record(kv, target)
    await kv.put(target.mirror, dataclasses.replace(record, head=first).to_json())
