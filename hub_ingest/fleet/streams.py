"""The hub's fleet streams by name: the aggregates (``FLEET_TELEMETRY``, ``FLEET_EVENTS`` and
their shards), the device mirrors (``EDGE_<stream>_<id>_<incarnation>``), the mark on every
stream hub-ingest made, and the listing of what the hub holds. `provision` creates them; the
ingest, the report, the audit and the commands only need their names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import StreamInfo
from nats.js.errors import NotFoundError

from edge_agent.protocol.errors import StreamError
from edge_agent.protocol.units import format_size
from hub_ingest.core.config import HubConfig
from hub_ingest.fleet.registry import Incarnation

MANAGED_BY = {"managed-by": "hub-ingest"}


@dataclass(frozen=True, slots=True)
class Aggregate:
    """One kind of device stream and the hub streams that collect it."""

    base_name: str  # FLEET_TELEMETRY
    device_stream: str  # TELEMETRY
    prefix: str  # tele

    def stream_name(self, shard: int) -> str:
        return self.base_name if shard == 0 else f"{self.base_name}_{shard + 1}"

    def subject_prefix(self, device_id: str) -> str:
        return f"fleet.{device_id}.{self.prefix}"


MIRROR_PREFIX = "EDGE_"
_NO_ROOM = 10047  # JetStream's err_code: a stream's max_bytes cannot be held back


def held_back(config: HubConfig, devices: int, exc: StreamError) -> str:
    """Why a stream found no room, when ``aggregates.max_bytes`` is the likely cause (said
    after `exc`'s own words), or ""."""
    size = config.aggregates.max_bytes
    if exc.err_code != _NO_ROOM or size <= 0:
        return ""
    return (
        f": nats-server holds back aggregates.max_bytes ({format_size(size)}) for each "
        f"aggregate and device mirror, about {format_size((2 * devices + 3) * size)} for "
        f"{devices} devices, of server.max_file_store "
        f"({format_size(config.server.max_file_store)}); use aggregates.max_age or a "
        'smaller max_bytes (docs/operations.md, "The hub\'s store fills")'
    )


DEFAULT_DEDUP_WINDOW = 120.0  # nats-server's, for a stream with neither mirror nor sources


def dedup_window(window: float, max_age: float) -> float:
    """`window`, within a stream's `max_age` (0: none), which nats-server requires."""
    return min(window, max_age) if max_age > 0 else window


def mirror_name(device_id: str, incarnation: Incarnation) -> str:
    """The hub's mirror of one incarnation of a device stream (``EDGE_TELEMETRY_a_<id>``)."""
    return f"{MIRROR_PREFIX}{incarnation.stream}_{device_id}_{incarnation.id}"


# Where the hub's account takes each shard's deliveries of the islands' consumers, renamed by
# its import (`auth`): ``shardin.2.hubin.<id>.…`` for ``hubin.<id>.…`` in ``DEVICES_2``.
SHARD_DELIVERIES = "shardin"


def shard_deliveries(shard: int) -> str:
    """The prefix a shard's deliveries take in the hub's account, numbered as its aggregates."""
    return f"{SHARD_DELIVERIES}.{shard + 1}"


AGGREGATES = (
    Aggregate("FLEET_TELEMETRY", "TELEMETRY", "tele"),
    Aggregate("FLEET_EVENTS", "EVENTS", "evt"),
)


async def every_stream(js: JetStreamContext) -> list[StreamInfo]:
    """Every stream's info in the domain, all pages of the listing. A stream made between two
    pages shifts the next one back, so one may come twice: the pages are counted by what the
    server listed (counting distinct names would ask for the same page for as long as that
    stream exists)."""
    infos: list[StreamInfo] = []
    while page := await js.streams_info(offset=len(infos)):
        infos.extend(page)
    return infos


def is_managed(config: Mapping[str, Any]) -> bool:
    """Whether a stream's config (as the API answers it) carries hub-ingest's mark."""
    return (config.get("metadata") or {}).get("managed-by") == MANAGED_BY["managed-by"]


def made_at(info: StreamInfo) -> str:
    """When a stream was made, which tells a stream made anew under the same name (its
    sequences start again from 1) from the one before; kept by nats-server through restarts."""
    return info.created.isoformat() if info.created is not None else ""


async def made_now(js: JetStreamContext, names: list[str]) -> dict[str, str]:
    """`made_at` of each of `names` that exists."""
    found = {}
    for name in names:
        try:
            found[name] = made_at(await js.stream_info(name))
        except NotFoundError:
            continue
    return found


async def stream_names(js: JetStreamContext) -> list[str]:
    """Every stream name in the domain, sorted."""
    return sorted({info.config.name or "" for info in await every_stream(js)})


async def stream_list(js: JetStreamContext, subject: str | None = None) -> list[dict[str, Any]]:
    """Every stream's info as the server lists it, all pages; with `subject`, the streams
    whose subjects overlap it. Raw: nats-py has no call for the subject filter, and its
    `StreamState` drops the first message's time."""
    found: list[dict[str, Any]] = []
    while True:
        body = {"offset": len(found)} | ({"subject": subject} if subject else {})
        page = await js._api_request(
            f"{js._prefix}.STREAM.LIST", json.dumps(body).encode(), timeout=js._timeout
        )
        streams = page.get("streams") or []
        found += streams
        if not streams or len(found) >= page.get("total", 0):
            return found


async def aggregate_stream_names(js: JetStreamContext) -> list[str]:
    """Every aggregate stream (all shards), sorted."""
    return sorted(name for name in await stream_names(js) if shard_of(name))


def shard_of(name: str) -> list[int]:
    """The shard an aggregate stream holds (`[0]` for the first), or `[]` for another stream."""
    for aggregate in AGGREGATES:
        if name == aggregate.base_name:
            return [0]
        suffix = name.removeprefix(f"{aggregate.base_name}_")
        if suffix != name and suffix.isdigit() and int(suffix) >= 2:
            return [int(suffix) - 1]
    return []
