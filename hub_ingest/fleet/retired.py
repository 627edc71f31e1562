"""What a removed device leaves on the hub, deleted once nothing needs it.

`hub_ingest.fleet.enrol.retire` cuts a removed device's link, waits for its shard to source
what its hub mirrors hold, and stops the sourcing. Its mirrors stay until the archive has
their rows: the ingest reads each row's store time and incarnation from the mirror it came
from. Kept for ever, they would make a fleet that replaces devices over the years pay for
every device it ever had: each is a stream the hub recovers at every start and tries to bind
again, every two minutes at most, across a link that is gone.

The trim (`hub_ingest.fleet.trim`) deletes the device's ``CMD_<id>`` at once, and its
mirrors, with their ``FLEET_GAPS`` records, once no shard of their kind holds a row of the
device (every one archived, then trimmed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from edge_agent.protocol.names import command_stream
from hub_ingest.core.replies import direct_get
from hub_ingest.fleet.aggregate_rows import source_lags
from hub_ingest.fleet.gaps import Target
from hub_ingest.fleet.registry import Device, Registry
from hub_ingest.fleet.streams import AGGREGATES, Aggregate, is_managed, shard_of

log = structlog.get_logger(__name__)

_CMD_PREFIX = command_stream("")
_DRAIN_POLL = 0.2  # seconds between looks at a shard's sources while a removal waits
# A shard sources what its local mirror holds in milliseconds; one that has not in this long
# is stuck (a node down), and the removal goes on, saying how much it leaves.
DRAIN_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class Leftover:
    """A stream of a device that is no longer registered."""

    stream: str
    device_id: str
    kind: Aggregate | None  # a mirror: the kind of shard that sourced it


async def unsourced(js: JetStreamContext, targets: Iterable[Target]) -> dict[str, int]:
    """Per mirror of `targets`, how many of its rows its shard has not sourced (1 for a
    source in error; missing from the answer: all of them sourced)."""
    by_aggregate: dict[str, set[str]] = {}
    for target in targets:
        by_aggregate.setdefault(target.aggregate, set()).add(target.mirror)
    left: dict[str, int] = {}
    for aggregate, mirrors in by_aggregate.items():
        lags = await source_lags(js._nc, js._prefix, aggregate)
        left |= {m: lag or 1 for m, lag in lags.items() if m in mirrors and lag != 0}
    return left


async def drained(
    js: JetStreamContext, targets: list[Target], timeout: float = DRAIN_TIMEOUT
) -> dict[str, int]:
    """Wait up to `timeout` s for the shards to source everything `targets`' mirrors hold;
    what is still unsourced then (empty: nothing)."""
    deadline = time.monotonic() + timeout
    while (left := await unsourced(js, targets)) and time.monotonic() < deadline:
        await asyncio.sleep(_DRAIN_POLL)
    return left


def leftovers(listed: Iterable[Mapping[str, Any]], registered: set[str]) -> list[Leftover]:
    """The product's hub mirrors and ``CMD_<id>`` streams in `listed` (``STREAM.LIST``
    entries) whose device is not in `registered`."""
    found: list[Leftover] = []
    for info in listed:
        config = info.get("config") or {}
        name, metadata = str(config.get("name", "")), config.get("metadata") or {}
        if not is_managed(config):
            continue
        device_id = metadata.get("device-id")
        if config.get("mirror") and device_id and device_id not in registered:
            stream = metadata.get("device-stream")
            kind = next((a for a in AGGREGATES if a.device_stream == stream), None)
            if kind is not None:  # a mirror no shard collects is not known to be archived
                found.append(Leftover(name, device_id, kind))
        elif name.startswith(_CMD_PREFIX) and name.removeprefix(_CMD_PREFIX) not in registered:
            found.append(Leftover(name, name.removeprefix(_CMD_PREFIX), None))
    return found


async def delete_leftovers(
    js: JetStreamContext,
    nc: Client,
    api: str,
    kv: KeyValue,
    *,
    listed: Sequence[Mapping[str, Any]],
    devices: Iterable[Device],
) -> list[str]:
    """Delete each leftover (of a device not in `devices`, the registry read before `listed`)
    whose device is still not registered and none of whose rows a shard holds; the streams
    deleted."""
    names = [str((i.get("config") or {}).get("name")) for i in listed]
    unheld = []
    for leftover in leftovers(listed, {d.device_id for d in devices}):
        kind = leftover.kind
        shards = [n for n in names for k in shard_of(n) if kind and n == kind.stream_name(k)]
        if not await _rows_held(nc, api, shards, leftover.device_id):
            unheld.append(leftover)
    # Read again: a device enrolled again since the listing keeps its streams.
    registered = {d.device_id for d in await (await Registry.open(js)).list()}
    deleted = []
    for leftover in unheld:
        if leftover.device_id in registered:
            continue
        try:
            await js.delete_stream(leftover.stream)
        except nats.js.errors.NotFoundError:
            continue
        if leftover.kind is not None:
            await kv.purge(leftover.stream)
        log.info(
            "removed_device_stream_deleted", stream=leftover.stream, device_id=leftover.device_id
        )
        deleted.append(leftover.stream)
    return deleted


async def _rows_held(nc: Client, api: str, shards: list[str], device_id: str) -> bool:
    """Whether any of `shards` holds a row of `device_id` (not archived, or archived and kept
    for ``keep_on_hub``)."""
    for shard in shards:
        request = {"seq": 1, "next_by_subj": f"fleet.{device_id}.>", "batch": 1}
        if await direct_get(nc, api, shard, request, timeout=10):
            return True
    return False
