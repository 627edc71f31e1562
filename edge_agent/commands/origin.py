"""Is the hub's ``CMD_<id>`` still the stream the island's ``COMMANDS`` mirror copied?

A mirror ignores every message at or below its last sequence, so an origin made again —
its hub node lost its disk, a single hub was rebuilt, an operator deleted it and
``provision`` made it anew — is invisible to it: the new stream numbers the commands it
still keeps from 1 (fewer than before once some expired), and every command it takes until
it passes the mirror's last sequence never reaches the device. Nothing in the engine reports
this, so the agent compares the two itself (`replaced_origin`) and, when the origin was
replaced, makes its mirror again from the new origin's start (`rebuild_mirror`); the ledger
keeps the commands that come a second time from running twice. Fast resume
(`edge_agent.commands.resume`) checks when the link comes up and every 30 s while it is up.

The same is done when the mirror is bound to another consumer than the one ``CMD_<id>``'s
metadata names for the island (`ISLAND_CONSUMER_KEY`): an island made before its first link
binds to `ISLAND_CONSUMER`, and the hub names a consumer after the device's shard for every
device enrolled since 2026-11-29. It is made again the same way, bound to the right one,
and logged as the routine it is (`command_mirror_rebound`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import StreamInfo
from nats.js.errors import APIError, NotFoundError

from edge_agent.core.config import Config
from edge_agent.island.streams import bound_consumer, bound_to, reconcile
from edge_agent.protocol.names import (
    COMMAND_MIRROR,
    ISLAND_CONSUMER,
    ISLAND_CONSUMER_KEY,
    command_stream,
)

log = structlog.get_logger(__name__)

_ID = "Nats-Msg-Id"  # `command send` sets it to the envelope's id


@dataclass(frozen=True, slots=True)
class Replaced:
    """Why the origin is not the stream the mirror copied."""

    mirror_last: int
    origin_first: int
    origin_last: int
    reason: str
    consumer: str  # the origin's consumer the mirror is to bind to
    rebound: bool = False  # only the consumer differs


async def replaced_origin(
    island: JetStreamContext, hub: JetStreamContext, origin: str
) -> Replaced | None:
    """The replacement found, or None while the mirror is bound to the consumer the origin
    names and the commands both streams hold sit at the same sequences in each. Two are
    compared: the lowest sequence both hold (a command the origin had before it was
    replaced, if any is left; the mirror's later ones may come from the new origin) and the
    mirror's last. Raises the transport's errors: a question that got no answer proves
    nothing."""
    mirror_info = await island.stream_info(COMMAND_MIRROR)
    mirror = mirror_info.state
    info = await hub.stream_info(origin)
    state = info.state
    named = _named_consumer(info)
    found = Replaced(mirror.last_seq, state.first_seq, state.last_seq, "", named)
    bound = bound_to(mirror_info)
    if bound != named:
        reason = f"the mirror is bound to consumer {bound}, the origin names {named}"
        return dataclasses.replace(found, reason=reason, rebound=True)
    if mirror.last_seq == 0:
        return None
    if state.last_seq < mirror.last_seq:
        return dataclasses.replace(found, reason="the origin ends below the mirror's last sequence")
    for seq in sorted({max(mirror.first_seq, state.first_seq), mirror.last_seq}):
        if seq <= mirror.last_seq and not await _same_at(island, hub, origin, seq):
            return dataclasses.replace(found, reason=f"another command sits at sequence {seq}")
    return None


def _named_consumer(origin: StreamInfo) -> str:
    """The consumer on `origin` an island's mirror is to bind to, as its metadata says."""
    return (origin.config.metadata or {}).get(ISLAND_CONSUMER_KEY, ISLAND_CONSUMER)


async def consumer_to_bind(
    island: JetStreamContext, hub: JetStreamContext, config: Config
) -> str | None:
    """The consumer the command mirror binds to: its own when it is there; for one about to
    be made, the one the origin names, if the hub answers now (None: made offline, the
    mirror binds to `ISLAND_CONSUMER` until the link comes up)."""
    if (bound := await bound_consumer(island)) is not None:
        return bound
    try:
        return _named_consumer(await hub.stream_info(command_stream(config.device_id)))
    except (nats.errors.Error, APIError, TimeoutError):
        return None


async def _same_at(island: JetStreamContext, hub: JetStreamContext, origin: str, seq: int) -> bool:
    """Whether the mirror and the origin hold the same command at `seq` (true when either
    no longer holds it: expired or deleted, which proves nothing)."""
    try:
        mine = await island.get_msg(COMMAND_MIRROR, seq, direct=True)
        theirs = await hub.get_msg(origin, seq, direct=True)
    except NotFoundError:
        return True
    same_id = (mine.headers or {}).get(_ID) == (theirs.headers or {}).get(_ID)
    return same_id and mine.data == theirs.data


async def rebuild_mirror(
    island: JetStreamContext, hub: JetStreamContext, config: Config, why: Replaced
) -> None:
    """Make the island's ``COMMANDS`` mirror again, empty, bound to the origin's consumer
    moved back to the origin's first command (a mirror that binds takes that consumer's
    floor as what it holds); the executor makes its own consumer on the new mirror again."""
    if not why.rebound:  # a new island learning its consumer at its first link is routine
        log.warning(
            "command_origin_replaced",
            reason=why.reason,
            mirror_last=why.mirror_last,
            origin_first=why.origin_first,
            origin_last=why.origin_last,
        )
    origin = command_stream(config.device_id)
    # First the consumer (the old mirror ignores what it then sends again): a failure past
    # this point still leaves a mirror made again, never none.
    # nats-py has no call for a consumer reset (nats-server 2.14).
    await hub._api_request(
        f"{hub._prefix}.CONSUMER.RESET.{origin}.{why.consumer}",
        json.dumps({"seq": max(why.origin_first, 1)}).encode(),
        timeout=hub._timeout,
    )
    try:
        await island.delete_stream(COMMAND_MIRROR)
    finally:
        await reconcile(island, config, why.consumer)
    event = "command_mirror_rebound" if why.rebound else "command_mirror_rebuilt"
    log.info(event, from_seq=max(why.origin_first, 1), consumer=why.consumer)
