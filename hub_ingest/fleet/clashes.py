"""Streams of other owners in the fleet's way: refused before provisioning changes anything.

A stream hub-ingest did not make that has one of the fleet's names, or listens on subjects
the fleet's streams carry, would be rewritten or would store fleet messages a second time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import StreamConfig, StreamInfo
from nats.js.errors import NotFoundError

from edge_agent.protocol.names import HUB_COMMANDS
from hub_ingest.core.errors import ProvisionError
from hub_ingest.core.gather import REQUESTS_AT_ONCE, gather_bounded
from hub_ingest.fleet.gaps import REFILL_STREAM
from hub_ingest.fleet.streams import (
    SHARD_DELIVERIES,
    every_stream,
    is_managed,
    shard_of,
    stream_list,
)

# Subjects the fleet's streams carry (devices' `tele.>` and `evt.>`, the aggregates' `fleet.>`,
# commands) and the deliveries of mirrors across the link (`names.to_hub_prefix`,
# `to_device_prefix`, `streams.shard_deliveries`). Another stream listening on any of them
# would store fleet messages a second time, or take them from the streams that should have
# them.
FLEET_SUBJECTS = (
    "cmd.>",
    "fleet.>",
    "tele.>",
    "evt.>",
    "hubin.>",
    "devin.>",
    "refill.>",
    f"{SHARD_DELIVERIES}.>",
)


def subjects_overlap(a: str, b: str) -> bool:
    """Whether some subject matches both patterns (``*`` is one token, ``>`` one or more)."""
    left, right = a.split("."), b.split(".")
    for x, y in zip(left, right, strict=False):
        if ">" in (x, y):
            return True
        if x != y and "*" not in (x, y):
            return False
    return len(left) == len(right)


def _ours(name: str) -> bool:
    """Names hub-ingest manages: a stream of another owner under one of them is a clash."""
    return (
        name in (HUB_COMMANDS, REFILL_STREAM)
        or name.startswith(("CMD_", "EDGE_"))
        or bool(shard_of(name))
    )


def _clash(config: dict[str, Any], adopt: bool) -> str | None:
    """Why provisioning must not go on beside (or over) this existing stream, if it must not."""
    name = str(config.get("name"))
    if is_managed(config):
        return None
    if _ours(name):
        if adopt:
            return None
        return (
            f"stream {name} exists but was not created by hub-ingest (no metadata "
            f"managed-by: hub-ingest): refusing to rewrite it; --adopt takes it over"
        )
    for subject in config.get("subjects") or []:
        for fleet in FLEET_SUBJECTS:
            if subjects_overlap(subject, fleet):
                return (
                    f"stream {name} listens on {subject!r}, which overlaps {fleet!r} that the "
                    f"fleet uses: it would store fleet messages a second time; change its "
                    f"subjects or delete it"
                )
    return None


async def check_names(
    js: JetStreamContext, names: Iterable[str], *, adopt: bool
) -> dict[str, StreamConfig | None]:
    """`check_foreign_streams` at a cost that does not grow with the fleet: the streams on
    the fleet's subjects (asked of the server by subject) and those under `names`. The
    configs of those under `names` as read (None: no such stream), for `reconcile_stream`."""
    names = list(names)
    on_subjects = await gather_bounded(
        (_streams_on(js, s) for s in FLEET_SUBJECTS), REQUESTS_AT_ONCE
    )
    named = await gather_bounded((_stream_info(js, name) for name in names), REQUESTS_AT_ONCE)
    found = [info for infos in on_subjects for info in infos]
    for info in [*found, *(i for i in named if i is not None)]:
        if problem := _clash(info.config.as_dict(), adopt):
            raise ProvisionError(problem)
    return {name: info.config if info else None for name, info in zip(names, named, strict=True)}


async def _stream_info(js: JetStreamContext, name: str) -> StreamInfo | None:
    try:
        return await js.stream_info(name)
    except NotFoundError:
        return None


async def _streams_on(js: JetStreamContext, subject: str) -> list[StreamInfo]:
    """The streams whose subjects overlap `subject` (the server's STREAM.LIST filter)."""
    return [StreamInfo.from_response(info) for info in await stream_list(js, subject)]


async def check_foreign_streams(
    js: JetStreamContext, *, adopt: bool = False
) -> dict[str, StreamConfig | None]:
    """Refuse (`ProvisionError`) before anything changes if another stream is in the way;
    every stream's config as read, by name."""
    read: dict[str, StreamConfig | None] = {}
    for info in await every_stream(js):
        if problem := _clash(info.config.as_dict(), adopt):
            raise ProvisionError(problem)
        read[info.config.name or ""] = info.config
    return read
