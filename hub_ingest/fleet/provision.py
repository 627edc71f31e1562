"""Idempotent creation of the hub's streams.

- ``COMMANDS`` listens on ``cmd.>``; ``CMD_<id>`` sources each device's slice of it
  (``cmd.<id>.>`` and ``cmd.all.>``) from the device's enrolment on, and the device mirrors
  ``CMD_<id>``.
- ``EDGE_TELEMETRY_<id>_<incarnation>`` and ``EDGE_EVENTS_<id>_<incarnation>`` *mirror* each
  incarnation of a device's ``TELEMETRY`` / ``EVENTS`` through ``$JS.<device-domain>.API``,
  bound to the durable consumer the device made for that incarnation: the only hop over the
  link. A mirror keeps the device's sequence numbers and store times exactly (a source would
  stamp the hub's arrival time), so the ingest reads ``device_time`` from it. A re-imaged
  device starts new incarnations at sequence 1; each gets its own mirror, and the old ones keep
  what they had (see `hub_ingest.fleet.watch`, which notices new incarnations).
- ``FLEET_TELEMETRY`` and ``FLEET_EVENTS`` (then ``_2``, ``_3``… once a shard is full)
  *source* those hub-side mirrors. A subject transform puts the device id in the subject
  (``tele.>`` on device d becomes ``fleet.d.tele.>``) and the ``Nats-Stream-Source`` header
  carries the mirror's sequence, which is the device's. Aggregate streams have no subjects
  of their own: listening on a subject devices publish would store every message twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from types import MappingProxyType

import structlog
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DiscardPolicy,
    ExternalStream,
    StorageType,
    StreamConfig,
    StreamConsumerSource,
    StreamSource,
    SubjectTransform,
)
from nats.js.errors import APIError, NotFoundError

from edge_agent.protocol.errors import StreamError
from edge_agent.protocol.names import (
    HUB_COMMANDS,
    ISLAND_CONSUMER,
    ISLAND_CONSUMER_KEY,
    command_filters,
    command_stream,
    fence_key,
    hub_consumer,
    hub_deliver_subject,
    is_island_consumer,
    island_deliver_subject,
)
from edge_agent.protocol.pack import PACK_SUBJECT
from edge_agent.protocol.reconcile import (
    UNREAD,
    Reconciled,
    mirror_consumer,
    reconcile_stream,
    settling,
)
from edge_agent.protocol.release import RELEASES_BUCKET, ROLLOUT_BUCKET
from edge_agent.protocol.units import parse_time
from hub_ingest.core.buckets import PROVISIONED, bucket_stream, open_bucket
from hub_ingest.core.config import HubConfig
from hub_ingest.core.errors import ProvisionError
from hub_ingest.core.gather import REQUESTS_AT_ONCE, gather_bounded
from hub_ingest.fleet.clashes import check_foreign_streams, check_names
from hub_ingest.fleet.gaps import REFILL_STREAM, Target, refill_source, refill_stream
from hub_ingest.fleet.registry import BUCKET, Device, Incarnation, Registry
from hub_ingest.fleet.streams import (
    AGGREGATES,
    DEFAULT_DEDUP_WINDOW,
    MANAGED_BY,
    Aggregate,
    dedup_window,
    held_back,
    mirror_name,
    shard_deliveries,
    shard_of,
)

log = structlog.get_logger(__name__)

_ROUNDS = 5  # of provisioning, while the registry changes under it
_NONE_READ: Mapping[str, StreamConfig | None] = MappingProxyType({})
COMMAND_DEDUP_WINDOW = 600.0  # seconds


def mirror_metadata(device_id: str, incarnation: Incarnation) -> dict[str, str]:
    """What a mirror says about its rows; the ingest reads the incarnation from here."""
    return {
        **MANAGED_BY,
        "device-id": device_id,
        "device-stream": incarnation.stream,
        "incarnation": incarnation.id,
    }


def device_mirror(config: HubConfig, device: Device, incarnation: Incarnation) -> StreamConfig:
    """The hub's copy of one incarnation of a device stream, with its sequences and times."""
    return StreamConfig(
        name=mirror_name(device.device_id, incarnation),
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        # The ingest reads device times here when it archives a row: keep them as long as
        # the aggregates keep the rows.
        max_bytes=config.aggregates.max_bytes,
        max_age=config.aggregates.max_age,
        mirror=StreamSource(
            name=incarnation.stream,
            external=ExternalStream(api=device.api_prefix),
            consumer=StreamConsumerSource(
                name=hub_consumer(incarnation.id),
                deliver_subject=mirror_deliveries(device, incarnation),
            ),
        ),
        allow_direct=True,
        metadata=mirror_metadata(device.device_id, incarnation),
        num_replicas=config.device_replicas,
    )


def mirror_deliveries(device: Device, incarnation: Incarnation) -> str:
    """Where the mirror takes its deliveries: the island's consumer delivers on a subject only
    this device may publish to, which its shard's import renames (see hub_ingest.fleet.auth)."""
    island = hub_deliver_subject(device.device_id, incarnation.id, incarnation.stream)
    return f"{shard_deliveries(device.shard)}.{island}" if incarnation.via_shard else island


def device_mirrors(config: HubConfig, device: Device) -> list[StreamConfig]:
    return [device_mirror(config, device, i) for i in device.incarnations]


def mirror_targets(devices: Iterable[Device]) -> dict[str, Target]:
    """Every hub mirror of `devices` by name, with the aggregate that sources it."""
    found = {}
    for device in devices:
        for incarnation in device.incarnations:
            for aggregate in AGGREGATES:
                if aggregate.device_stream == incarnation.stream:
                    name = mirror_name(device.device_id, incarnation)
                    found[name] = Target(
                        name, device, incarnation, aggregate.stream_name(device.shard)
                    )
    return found


def device_commands(config: HubConfig, device: Device) -> StreamConfig:
    """``CMD_<id>``: the device's commands and the broadcasts, the one stream it may read."""
    return StreamConfig(
        name=command_stream(device.device_id),
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=config.commands.max_age,
        sources=[
            StreamSource(
                name=HUB_COMMANDS,
                # From its enrolment on: a device enrolled today must not run the broadcasts
                # of last week (COMMANDS keeps them for commands.max_age).
                opt_start_time=parse_time(device.added_at),
                subject_transforms=[
                    SubjectTransform(src=f, dest=f) for f in command_filters(device.device_id)
                ],
            )
        ],
        allow_direct=True,
        metadata={
            **MANAGED_BY,
            **{fence_key(i.id): str(i.command_fence) for i in device.incarnations},
            # What the island binds to, read when it links (`edge_agent.commands.origin`);
            # left out for the consumer an island binds to unasked, so the streams of the
            # devices enrolled before it was named stay as they were.
            **(
                {}
                if device.command_consumer == ISLAND_CONSUMER
                else {ISLAND_CONSUMER_KEY: device.command_consumer}
            ),
        },
        num_replicas=config.device_replicas,
    )


def island_consumer(device: Device) -> ConsumerConfig:
    """The consumer on ``CMD_<id>`` that the island's ``COMMANDS`` mirror binds to (see
    `edge_agent.island.streams`); it delivers under a prefix only that device may read."""
    deliver = island_deliver_subject(device.device_id)
    return mirror_consumer(device.command_consumer, deliver, MANAGED_BY)


async def provision_commands(
    js: JetStreamContext,
    config: HubConfig,
    device: Device,
    read: Mapping[str, StreamConfig | None] = _NONE_READ,
) -> Reconciled:
    """``CMD_<id>`` and the consumer the device's mirror of it reads through (`read`: see
    `_reconcile_read`)."""
    result = await _reconcile_read(js, device_commands(config, device), read)
    # Asked of the stream's leader, which a stream just made on a cluster may not have yet.
    await settling(js.add_consumer)(result.name, island_consumer(device))
    if result.change == "updated":  # e.g. the device enrolled again, its consumer renamed
        await _drop_other_island_consumers(js, result.name, device.command_consumer)
    return result


async def _drop_other_island_consumers(js: JetStreamContext, stream: str, keep: str) -> None:
    """Delete the consumers an island bound to before its device's was renamed: they deliver
    to the same subject, and a mirror takes the heartbeats there whichever consumer sent
    them (nats-server checks the consumer of deliveries only), which can make it set itself
    up again."""
    for info in await js.consumers_info(stream):
        ours = (info.config.metadata or {}).items() >= MANAGED_BY.items()
        if info.name != keep and ours and is_island_consumer(info.name):
            await js.delete_consumer(stream, info.name)
            log.info("island_consumer_dropped", stream=stream, consumer=info.name, kept=keep)


async def _reconcile_read(
    js: JetStreamContext, want: StreamConfig, read: Mapping[str, StreamConfig | None]
) -> Reconciled:
    """`reconcile_stream` with `want`'s config from `read` (configs the caller has just read
    by name, None for a stream that is not there) when it is there: with hundreds of
    sources, an aggregate's info is the slowest request in adding a device."""
    return await reconcile_stream(js, want, read.get(want.name or "", UNREAD))


def device_sources(aggregate: Aggregate, device: Device) -> list[StreamSource]:
    return [
        device_source(aggregate, device, i)
        for i in device.incarnations
        if i.stream == aggregate.device_stream
    ]


def device_source(aggregate: Aggregate, device: Device, incarnation: Incarnation) -> StreamSource:
    # From the hub's own mirror, not over the link again: each message crosses the link
    # once, and an aggregate row never gets ahead of the device time the ingest looks up.
    # A packed stream holds one subject; the transform is per incarnation, as changing an
    # existing source's would make the server source it again from its start.
    src = PACK_SUBJECT if incarnation.packed else f"{aggregate.prefix}.>"
    return StreamSource(
        name=mirror_name(device.device_id, incarnation),
        subject_transforms=[SubjectTransform(src=src, dest=f"fleet.{device.device_id}.{src}")],
    )


def commands_stream(config: HubConfig) -> StreamConfig:
    return StreamConfig(
        name=HUB_COMMANDS,
        subjects=["cmd.>"],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=config.commands.max_age,
        max_bytes=config.commands.max_bytes,
        # Long enough for `command send` retries to be de-duplicated by Nats-Msg-Id; the
        # server refuses a window longer than the stream keeps messages.
        duplicate_window=dedup_window(COMMAND_DEDUP_WINDOW, config.commands.max_age),
        allow_direct=True,
        metadata=MANAGED_BY,
        num_replicas=config.replicas,
    )


def aggregate_streams(
    config: HubConfig, devices: Iterable[Device], shards: Iterable[int] = ()
) -> list[StreamConfig]:
    """Aggregate streams for `devices`, plus empty ones for `shards` that have none left."""
    by_shard: dict[int, list[Device]] = {shard: [] for shard in (0, *shards)}
    for device in sorted(devices, key=lambda d: d.device_id):
        by_shard.setdefault(device.shard, []).append(device)
    streams = []
    for aggregate in AGGREGATES:
        for shard in sorted(by_shard):
            sources = [s for d in by_shard[shard] for s in device_sources(aggregate, d)]
            name = aggregate.stream_name(shard)
            if sources:  # what the hub's mirrors skipped, read again from the islands
                sources.append(refill_source(name))
            streams.append(
                StreamConfig(
                    name=name,
                    # The server gives a stream with neither subjects nor sources its own name
                    # as subject (no device publishes that); say so, or every run "updates" it.
                    subjects=None if sources else [name],
                    storage=StorageType.FILE,
                    discard=DiscardPolicy.OLD,
                    max_bytes=config.aggregates.max_bytes,
                    max_age=config.aggregates.max_age,
                    sources=sources or None,
                    # No window: nats-server de-duplicates what a stream sources by Nats-Msg-Id,
                    # which apps set as they like, so a window here would keep one device's
                    # message and drop another's with the same id. The server gives a stream
                    # without sources its default window, and echoes it.
                    duplicate_window=0
                    if sources
                    else dedup_window(DEFAULT_DEDUP_WINDOW, config.aggregates.max_age),
                    allow_direct=True,
                    metadata=MANAGED_BY,
                    num_replicas=config.replicas,
                )
            )
    return streams


_BUCKET_STREAMS = tuple(bucket_stream(b) for b in (BUCKET, *PROVISIONED))
_RELEASE_STREAMS = (bucket_stream(ROLLOUT_BUCKET), f"OBJ_{RELEASES_BUCKET}")


async def _bucket_replicas(
    js: JetStreamContext,
    stream: str,
    replicas: int,
    read: Mapping[str, StreamConfig | None],
    *,
    missing_ok: bool = False,
) -> Reconciled | None:
    """A key-value bucket's stream (the registry's, made by `Registry.open` with the
    server's default of one replica; the command index's) kept as many times as the hub's
    streams; None for a stream not made yet, if `missing_ok`. Its config is read unless
    `read` has it (a bucket `read` has not seen may have been made since)."""
    have = read.get(stream)
    if have is None:
        try:
            have = (await js.stream_info(stream)).config
        except NotFoundError:
            if missing_ok:
                return None
            raise
    if have.num_replicas == replicas:
        return Reconciled(stream, "unchanged")
    await js.update_stream(dataclasses.replace(have, num_replicas=replicas))
    return Reconciled(stream, "updated", ("num_replicas",))


async def provision(
    js: JetStreamContext,
    config: HubConfig,
    devices: Iterable[Device],
    *,
    adopt: bool = False,
    only: Collection[str] | None = None,
) -> list[Reconciled]:
    """Create or update ``COMMANDS`` and every aggregate stream; safe to repeat.

    Refuses, changing nothing, when a stream of another owner is in the way (see `_clash`);
    with `adopt`, same-named streams of another owner are taken over. With `only` (device
    ids) the pass touches those devices' streams and their shards' aggregates, besides the
    fleet-wide streams: adding a device to a large fleet costs what that device needs, and
    other owners' streams are checked by the next full pass (``hub-ingest provision``).
    """
    registry = await Registry.open(js)
    devices = list(devices)
    for _ in range(_ROUNDS):
        results = await _provision_once(js, config, devices, only, adopt)
        # Another provisioner (`hub-ingest watch` recording an incarnation, a `device add`)
        # may have written from an older registry while this one ran: whoever finishes last
        # makes the streams match the registry as it is now.
        fresh = await registry.list()
        if fresh == sorted(devices, key=lambda d: d.device_id):
            return results
        devices = fresh
    raise ProvisionError(f"the device registry kept changing over {_ROUNDS} provisioning rounds")


async def _provision_once(
    js: JetStreamContext,
    config: HubConfig,
    devices: list[Device],
    only: Collection[str] | None,
    adopt: bool,
) -> list[Reconciled]:
    touched = devices if only is None else [d for d in devices if d.device_id in only]
    read: Mapping[str, StreamConfig | None] = _NONE_READ
    if only is None:
        # Every stream's config, read once: the pass compares against these.
        read = await check_foreign_streams(js, adopt=adopt)
        # Shards whose last device was removed still exist and must stop sourcing it.
        shards = {shard for name in read for shard in shard_of(name)}
        aggregates = aggregate_streams(config, devices, shards)
    else:
        wanted = {d.shard for d in touched} | {0}
        in_shards = [d for d in devices if d.shard in wanted]
        aggregates = [
            a for a in aggregate_streams(config, in_shards) if shard_of(a.name or "")[0] in wanted
        ]
    mirrors = [m for d in touched for m in device_mirrors(config, d)]
    try:
        if only is not None:
            # One round reads every config this pass compares against: adding a device
            # costs that round and the writes, not a round trip per step.
            names = [*_BUCKET_STREAMS, *_RELEASE_STREAMS, HUB_COMMANDS, REFILL_STREAM]
            names += [command_stream(d.device_id) for d in touched]
            names += [s.name or "" for s in (*mirrors, *aggregates)]
            read = await check_names(js, names, adopt=adopt)
        # In rounds, each round's requests at once: what a stream sources exists before it
        # (COMMANDS before CMD_<id>, mirrors before aggregates). One after the other,
        # adding a device to 200 took 0.2 s of round trips.
        # The command index is made here, with every node up, rather than by the first
        # report or status: made while a node is down, its replica group may be left
        # without a leader when another node goes (seen on a 3-node hub).
        await gather_bounded(
            [
                open_bucket(js, bucket, replicas=config.replicas, direct=direct)
                for bucket, direct in PROVISIONED.items()
                if read.get(bucket_stream(bucket)) is None
            ],
            REQUESTS_AT_ONCE,
        )
        fleet_wide = await gather_bounded(
            [
                *(_bucket_replicas(js, s, config.replicas, read) for s in _BUCKET_STREAMS),
                # Made by the first `release publish`, if there was one.
                *(
                    _bucket_replicas(js, s, config.replicas, read, missing_ok=True)
                    for s in _RELEASE_STREAMS
                ),
                _reconcile_read(js, commands_stream(config), read),
                _reconcile_read(js, refill_stream(config), read),
            ],
            REQUESTS_AT_ONCE,
        )
        results = [r for r in fleet_wide if r is not None]
        results += await gather_bounded(
            [
                *(provision_commands(js, config, d, read) for d in touched),
                *(_reconcile_read(js, want, read) for want in mirrors),
            ],
            REQUESTS_AT_ONCE,
        )
        results += await gather_bounded(
            (_reconcile_read(js, a, read) for a in aggregates), REQUESTS_AT_ONCE
        )
    except StreamError as exc:
        raise ProvisionError(f"{exc}{held_back(config, len(devices), exc)}") from exc
    except APIError as exc:
        raise ProvisionError(f"{exc.description} (code {exc.err_code})") from exc
    for result in results:
        if result.change != "unchanged":
            log.info(
                "stream_provisioned",
                stream=result.name,
                change=result.change,
                fields=list(result.fields),
            )
    return results
