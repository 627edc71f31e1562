"""Idempotent reconciliation of the island's streams.

- ``TELEMETRY`` (``tele.>``) and ``EVENTS`` (``evt.>``): outbound, file storage, each with its
  own byte budget. JetStream reserves a stream's ``max_bytes`` in the store, so telemetry
  pressure can never evict events or results: it only drops the oldest telemetry.
- With ``hub.pack``, apps' ``tele.>`` goes to ``READINGS`` instead, and ``TELEMETRY`` holds
  packs of its readings (``pack.tele``, made by `edge_agent.island.packer`); ``READINGS``,
  the offline buffer, takes most of the telemetry budget (`packs_budget`). Whether an
  island packs is fixed when its ``TELEMETRY`` is made: an existing stream keeps what it
  holds, whatever the configuration says now.
- ``COMMANDS``: a mirror of the hub's ``CMD_<device_id>`` (the device's slice of the hub's
  ``COMMANDS``: ``cmd.<device_id>.>`` and ``cmd.all.>``) through ``$JS.<hub-domain>.API``, so
  commands keep arriving into local storage and stay readable while the link is down. The
  device is allowed to read that stream and no other (see docs/security.md).

Each outbound stream carries an *incarnation* id in its metadata, made when the stream is
created: a re-imaged device (same id and key, empty store) gets new ones. The hub mirrors
each outbound stream through a durable consumer named after the incarnation
(`names.hub_consumer`), which the agent creates here; the hub notices a new incarnation and
mirrors it afresh from sequence 1 (`hub_ingest.fleet.watch`), while the old mirror, whose
consumer died with the old store, keeps what it had and can take nothing new.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DiscardPolicy,
    ExternalStream,
    StorageType,
    StreamConfig,
    StreamConsumerSource,
    StreamInfo,
    StreamSource,
)
from nats.js.errors import APIError, NotFoundError

from edge_agent.core.config import Config, StreamBudget
from edge_agent.island.compression import OFF, link_mode
from edge_agent.protocol.errors import StreamError
from edge_agent.protocol.names import (
    COMMAND_MIRROR,
    EVENTS,
    INCARNATION,
    INCARNATION_ID,
    ISLAND_CONSUMER,
    OUTBOUND,
    TELEMETRY,
    command_stream,
    hub_consumer,
    hub_deliver_subject,
    incarnation_of_consumer,
    island_deliver_subject,
)
from edge_agent.protocol.pack import PACK_HEADER, PACK_SUBJECT, READINGS, pack_range
from edge_agent.protocol.reconcile import (
    Reconciled,
    mirror_consumer,
    reconcile_stream,
    stream_error,
)

log = structlog.get_logger(__name__)

MANAGED_BY = {"managed-by": "edge-agent"}


def new_incarnation() -> str:
    """A fresh incarnation id: random, so a device clock reset cannot repeat one."""
    return secrets.token_hex(6)


def _outbound(
    name: str, subject: str, budget: StreamBudget, incarnation: str | None
) -> StreamConfig:
    metadata = MANAGED_BY if incarnation is None else {**MANAGED_BY, INCARNATION: incarnation}
    return StreamConfig(
        name=name,
        subjects=[subject],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_bytes=budget.max_bytes,
        max_age=budget.max_age,
        duplicate_window=120.0,
        allow_direct=True,
        metadata=metadata,
    )


def _telemetry(
    config: Config, incarnation: str | None, packed: bool, readings_from: int | None
) -> list[StreamConfig]:
    budget = config.streams.telemetry
    if not packed:
        return [_outbound(TELEMETRY, "tele.>", budget, incarnation)]
    packs = packs_budget(budget.max_bytes, config.island.max_payload)
    rest = StreamBudget(budget.max_bytes - packs, budget.max_age)
    readings = _outbound(READINGS, "tele.>", rest, None)
    readings.first_seq = readings_from
    packed_budget = StreamBudget(packs, budget.max_age)
    # The packs first: the store reserves each stream's max_bytes, so a share that shrinks
    # must free its bytes before the other grows into them.
    return [_outbound(TELEMETRY, PACK_SUBJECT, packed_budget, incarnation), readings]


def packs_budget(telemetry_bytes: int, max_payload: int) -> int:
    """``TELEMETRY``'s bytes on an island that packs: a tenth of the telemetry budget, never
    less than every pack that can be on its way to the hub at once (the mirror's window and
    the packer's lead, each as large as a message may be), at most half.

    While the link is down nothing is packed: ``READINGS``, the rest, is what a device offline
    keeps (half the budget before 2026-11-27). Packs the hub already holds are kept only for a
    refill of a range its mirror skipped, which the hub's watcher finds within seconds of the
    link returning (docs/gaps.md)."""
    in_flight = (PACK_WINDOW + PACK_LEAD) * max_payload
    return min(max(telemetry_bytes // 10, in_flight), telemetry_bytes // 2)


async def last_packed(js: JetStreamContext, telemetry: StreamInfo) -> int | None:
    """The ``READINGS`` sequence of the last reading packed into `telemetry` (None: it holds
    no pack). The packer's cursor, and where a ``READINGS`` made again starts."""
    if not telemetry.state.messages:
        return None
    msg = await js.get_last_msg(TELEMETRY, PACK_SUBJECT, direct=True)
    return pack_range((msg.headers or {})[PACK_HEADER])[1]


async def readings_from(js: JetStreamContext, telemetry: StreamInfo | None) -> int | None:
    """Where a ``READINGS`` made again (set aside after a power cut) must start: after the
    last reading packed, so that its readings never take sequences the hub already has under
    the same incarnation. None: ``READINGS`` exists, or no pack says."""
    try:
        await js.stream_info(READINGS)
        return None
    except NotFoundError:
        pass
    last = None if telemetry is None else await last_packed(js, telemetry)
    return None if last is None else last + 1


def desired_streams(
    config: Config,
    incarnations: Mapping[str, str] | None = None,
    *,
    packed: bool = False,
    readings_from: int | None = None,
    command_consumer: str = ISLAND_CONSUMER,
) -> list[StreamConfig]:
    """The streams the island must have, as configured (outbound ones in `incarnations`);
    `packed`: its telemetry crosses in packs, and a new ``READINGS`` starts at
    `readings_from`; the command mirror binds to the hub's `command_consumer`."""
    incarnations = incarnations or {}
    mirror = StreamSource(
        name=command_stream(config.device_id),
        external=ExternalStream(api=config.hub.api_prefix),
        # Bound to a durable consumer the hub made (ADR-60): after a cut the server resumes
        # it as soon as that consumer's heartbeats cross again, instead of 10-40 s later.
        consumer=StreamConsumerSource(
            name=command_consumer, deliver_subject=island_deliver_subject(config.device_id)
        ),
    )
    return [
        *_telemetry(config, incarnations.get(TELEMETRY), packed, readings_from),
        _outbound(EVENTS, "evt.>", config.streams.events, incarnations.get(EVENTS)),
        StreamConfig(
            name=COMMAND_MIRROR,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_bytes=config.streams.commands.max_bytes,
            max_age=config.streams.commands.max_age,
            mirror=mirror,
            allow_direct=True,
            metadata=MANAGED_BY,
        ),
    ]


# Unpacked, a window starts as what crosses the slowest link planned for (256 kbit/s) in about
# 2 s, and `edge_agent.island.windows` sizes it to the link's pace from there, up to
# `MIRROR_WINDOW`. A reading takes ~50 bytes of a compressed link and ~400 of an uncompressed
# one (subject, reply and headers beside a 200-byte body).
START_WINDOW = 1_000
UNCOMPRESSED_START_WINDOW = 150
# Packs (`edge_agent.island.packer`). The origin asks for flow control (which acknowledges)
# once the window is full, so a window crosses per round trip, and whatever else goes up the
# link waits behind it: packs are sized so that a window takes about 2 s
# (`edge_agent.island.pace`). With full 32 KiB packs, compressed 600 ms, 1 Mbit/s: 16 packs
# 17.7 s, 24 13.0 s, 32 11.3 s (bench/slow_link.py --pack), and on 256 kbit/s a new
# device's fence waited behind 32 packs until the backlog was gone.
PACK_WINDOW = 32
# Packs the packer makes ahead of what the hub's mirror has been sent
# (`edge_agent.island.packer`). With 4 the drain waited on the packer's polls at every
# flow-control round trip; 16 sends half a window of 32 at once, and the rest is packed while
# it crosses.
PACK_LEAD = 16
UNCOMPRESSED_PACK_WINDOW = 6


def uplink_window(config: Config, packed: bool = False) -> int:
    """Deliveries the hub's mirrors may have in flight over this device's link, at first.

    Whatever else goes up the link (fast resume's reads of the hub's commands, status
    requests) queues behind them: on a 256 kbit/s link with compression off, a command waited
    30 s behind 10,000 readings and 7.8-14 s behind 1,000. So an unpacked stream's window is
    then sized to the link (`edge_agent.island.windows`), a packed stream's packs are
    (`edge_agent.island.pace`); a pack holds many readings, so its window counts packs."""
    compressed = link_mode(config) != OFF
    if packed:
        return PACK_WINDOW if compressed else UNCOMPRESSED_PACK_WINDOW
    return START_WINDOW if compressed else UNCOMPRESSED_START_WINDOW


def hub_consumer_config(
    config: Config, stream: str, incarnation: str, packed: bool = False
) -> ConsumerConfig:
    """The consumer the hub's mirror of `stream` binds to, for this incarnation."""
    return mirror_consumer(
        hub_consumer(incarnation),
        hub_deliver_subject(config.device_id, incarnation, stream),
        MANAGED_BY,
        uplink_window(config, packed and stream == TELEMETRY),
    )


def packs_telemetry(telemetry: StreamInfo | None, config: Config) -> bool:
    """Whether the island's telemetry crosses in packs: as its ``TELEMETRY`` holds, or, for
    one not made yet, as configured (``hub.pack``)."""
    if telemetry is None:
        return config.hub.pack
    packed = (telemetry.config.subjects or []) == [PACK_SUBJECT]
    if packed != config.hub.pack:
        # Every island made before packing became the default meets this after an upgrade:
        # expected, so not a warning.
        log.info("telemetry_packing_kept", packed=packed, configured=config.hub.pack)
    return packed


async def outbound_streams(js: JetStreamContext) -> dict[str, StreamInfo | None]:
    """Each outbound stream on the island, as it is now (None: not there)."""
    found: dict[str, StreamInfo | None] = {}
    for name in OUTBOUND:
        try:
            found[name] = await js.stream_info(name)
        except NotFoundError:
            found[name] = None
    return found


def incarnation_of(info: StreamInfo | None) -> str | None:
    """An outbound stream's incarnation (None: no stream, no id, or an id no hub stream
    could be named after, see `_repaired`)."""
    found = None if info is None else (info.config.metadata or {}).get(INCARNATION)
    return found if isinstance(found, str) and INCARNATION_ID.fullmatch(found) else None


def _incarnations(infos: Mapping[str, StreamInfo | None]) -> dict[str, str | None]:
    return {name: incarnation_of(info) for name, info in infos.items()}


async def _repaired(
    js: JetStreamContext, infos: Mapping[str, StreamInfo | None]
) -> dict[str, str | None]:
    """`_incarnations`, where a stream whose id is unusable (edited by hand, damaged: the hub
    refuses it, and no consumer can be named after it) takes back the id of the one hub
    consumer it has; with none, a fresh id follows (the hub then takes the stream again from
    its sequence 1)."""
    found = _incarnations(infos)
    for name, info in infos.items():
        if (
            info is None
            or found[name] is not None
            or INCARNATION not in (info.config.metadata or {})
        ):
            continue
        kept = {
            i
            for c in await js.consumers_info(name)
            if c.name and (i := incarnation_of_consumer(c.name))
        }
        found[name] = kept.pop() if len(kept) == 1 else None
        log.warning(
            "incarnation_unusable",
            stream=name,
            id=(info.config.metadata or {}).get(INCARNATION),
            restored=found[name],
        )
    return found


async def incarnations(js: JetStreamContext) -> dict[str, str | None]:
    """The incarnation of each outbound stream on the island (None: no stream, or no id)."""
    return _incarnations(await outbound_streams(js))


CONSUMER_NOT_FOUND = 10014  # JetStream's err_code


async def consumer_request(
    nc: Client, verb: str, stream: str, consumer: str, body: bytes = b""
) -> dict[str, Any] | None:
    """One of a consumer's own requests (``RESET``, ``PAUSE``), to the island `nc` is on; the
    error it answers, None if none. The consumer itself serves them: a missing one does not
    answer, and this raises TimeoutError."""
    reply = await nc.request(f"$JS.API.CONSUMER.{verb}.{stream}.{consumer}", body, timeout=5)
    error: dict[str, Any] | None = json.loads(reply.data).get("error")
    return error


async def reset_hub_consumers(nc: Client) -> list[str]:
    """Reset each consumer a hub mirror binds to back to its acknowledgement floor, as the
    hub's mirror itself does when it binds (see `edge_agent.island.server.open_link` for why the
    island does it first); returns the consumers reset."""
    reset = []
    js = nc.jetstream()
    for stream, incarnation in (await incarnations(js)).items():
        if incarnation is None:
            continue
        name = hub_consumer(incarnation)
        try:
            await js.consumer_info(stream, name)
        except NotFoundError:
            # The reset is the consumer's own subject: nobody would answer. The reconcile
            # makes it again (an agent stopped while `unstall` had it deleted leaves none).
            continue
        error = await consumer_request(nc, "RESET", stream, name)
        if error is None:
            reset.append(f"{stream}/{name}")
        elif error.get("err_code") != CONSUMER_NOT_FOUND:
            why = error.get("description")
            raise StreamError(f"consumer {stream}/{name}: reset refused: {why}")
    return reset


def bound_to(command_mirror: StreamInfo) -> str | None:
    """The hub consumer the island's command mirror is bound to, as its info says."""
    mirror = command_mirror.config.mirror
    return mirror.consumer.name if mirror and mirror.consumer else None


async def bound_consumer(js: JetStreamContext) -> str | None:
    """The hub consumer the island's command mirror is bound to (None: no mirror yet)."""
    try:
        return bound_to(await js.stream_info(COMMAND_MIRROR))
    except NotFoundError:
        return None


async def reconcile(
    js: JetStreamContext, config: Config, command_consumer: str | None = None
) -> list[Reconciled]:
    """Bring every island stream in line with `config`; safe to call any number of times.

    An outbound stream keeps its incarnation; one created now gets a new id (the same for
    every stream created in this call). The command mirror keeps the consumer it is bound
    to unless `command_consumer` names one (made now, it binds to `ISLAND_CONSUMER` until
    the link comes up and ``CMD_<id>`` names its own: `edge_agent.commands.origin`).
    """
    fresh = new_incarnation()
    try:
        infos = await outbound_streams(js)
        found = await _repaired(js, infos)
        packed = packs_telemetry(infos[TELEMETRY], config)
        chosen = {name: found[name] or fresh for name in OUTBOUND}
        if new := [name for name in OUTBOUND if found[name] is None]:
            log.info("incarnation_started", incarnation=fresh, streams=new)
        start = await readings_from(js, infos[TELEMETRY]) if packed else None
        consumer = command_consumer or await bound_consumer(js) or ISLAND_CONSUMER
        wanted = desired_streams(
            config, chosen, packed=packed, readings_from=start, command_consumer=consumer
        )
        results = [await reconcile_stream(js, want) for want in wanted]
        for name, incarnation in chosen.items():
            await js.add_consumer(name, hub_consumer_config(config, name, incarnation, packed))
    except APIError as exc:
        raise stream_error("island streams", exc) from exc
    for result in results:
        if result.change != "unchanged":
            log.info(
                "stream_reconciled",
                stream=result.name,
                change=result.change,
                fields=list(result.fields),
            )
    return results
