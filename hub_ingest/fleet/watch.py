"""Device incarnations: a re-imaged device is noticed, and mirrored afresh, by itself.

A device that is re-imaged (same id and key, empty store) starts its streams again at
sequence 1 with new incarnation ids (`edge_agent.island.streams`). A stock mirror would drop every
new message whose sequence is not above its last one, silently. Here each incarnation has its
own hub mirror, bound to the durable consumer the device made for that incarnation: the old
mirror keeps what it had (its consumer died with the old store, so it can take nothing new)
and the new one collects the new incarnation from sequence 1.

`observe` asks a device's island for the incarnation of each outbound stream (a JetStream
``STREAM.INFO`` through ``$JS.<device-domain>.API``) and, for one the registry does not have
yet, records it, with its *command fence*, and provisions its mirror and sources. `watch`
(``hub-ingest watch``, a hub service) calls `observe` for every device whose leaf link came
up, as seen on ``/leafz``, and for every linked device now and then. It also advances a
running rollout (`hub_ingest.fleet.rollout`), and answers the hub's questions about who may
connect when devices are admitted by callout (`hub_ingest.fleet.admission`).

An incarnation whose id cannot name a hub stream, or past ``server.max_incarnations`` of its
device stream, is refused: kept in the device's record (`report` flags it) and not mirrored.

The command fence is the last ``CMD_<id>`` sequence when the hub first saw a device's second or
later incarnation (0 for its first): a re-imaged agent answers the commands up to it
``rejected`` without running them, since the old incarnation may have run them already. The
hub writes it into ``CMD_<id>``'s metadata, which the agent may read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext

from edge_agent.protocol.errors import MonitorUnavailable
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.names import INCARNATION, INCARNATION_ID, OUTBOUND, command_stream
from edge_agent.protocol.pack import PACK_SUBJECT
from edge_agent.protocol.units import utc_now_iso
from hub_ingest.core.config import HubConfig
from hub_ingest.core.rounds import next_round
from hub_ingest.fleet import rollout
from hub_ingest.fleet.admission import Admission
from hub_ingest.fleet.auth import ACCOUNT
from hub_ingest.fleet.provision import mirror_targets, provision
from hub_ingest.fleet.refill import Refiller
from hub_ingest.fleet.registry import Device, Incarnation, Refusal, Registry
from hub_ingest.fleet.requests import ask_json

log = structlog.get_logger(__name__)

ASK_TIMEOUT = 2.0  # one STREAM.INFO over the leaf link
# How often a running rollout reads its open batches' reports: one request per device.
ROLLOUT_S = 2.0
RECHECK_S = 30.0  # a linked device is asked again this often, in case a reconnect was missed
REFUSED_ID_KEPT = 64  # characters of a refused id kept in the record: an island names any


@dataclass(frozen=True, slots=True)
class Seen:
    """An island's outbound stream as the hub found it."""

    id: str  # its incarnation
    packed: bool  # it holds packs of readings (`edge_agent.protocol.pack`)


async def device_incarnations(nc: Client, device: Device) -> dict[str, Seen]:
    """Incarnation of each outbound stream on the device's island; {} when unreachable."""
    found: dict[str, Seen] = {}
    for stream in OUTBOUND:
        try:
            info = await ask_json(
                nc, device, f"{device.api_prefix}.STREAM.INFO.{stream}", timeout=ASK_TIMEOUT
            )
        except (nats.errors.Error, TimeoutError, ValueError) as exc:
            log.debug(
                "incarnation_unknown", device_id=device.device_id, stream=stream, error=repr(exc)
            )
            continue
        config = info.get("config") or {}
        incarnation = (config.get("metadata") or {}).get(INCARNATION)
        if incarnation is not None:
            found[stream] = Seen(str(incarnation), config.get("subjects") == [PACK_SUBJECT])
    return found


def _refusal(device: Device, stream: str, seen: Seen, max_incarnations: int) -> str | None:
    """Why the hub will not mirror `seen`, if it will not."""
    if not INCARNATION_ID.fullmatch(seen.id):
        # Not a name part of a hub stream (a hostile or damaged island): its mirror would
        # fail every provisioning pass, for the whole fleet.
        return "not 1-32 letters, digits or dashes"
    if sum(i.stream == stream for i in device.incarnations) >= max_incarnations:
        # Each costs the hub a mirror for good: a device whose store is wiped at every boot,
        # or a hostile one, would otherwise grow the hub's streams without end.
        return (
            f"the hub mirrors {max_incarnations} of its incarnations already "
            "(server.max_incarnations)"
        )
    return None


async def _command_fence(js: JetStreamContext, device: Device, stream: str) -> int:
    if device.current(stream) is None:
        return 0  # a first install runs what was queued for it
    return (await js.stream_info(command_stream(device.device_id))).state.last_seq


async def record(
    js: JetStreamContext,
    registry: Registry,
    config: HubConfig,
    device: Device,
    seen: Mapping[str, Seen],
    *,
    via_shard: bool,
) -> list[Incarnation]:
    """Record the incarnations in `seen` the hub does not know, or their refusal; the new
    ones, whose mirrors take their deliveries renamed by their shard if `via_shard` (see
    `_via_shard`). The caller provisions their streams, once for all the devices it records
    (one pass over the whole fleet each: per device, onboarding a fleet would grow with its
    square)."""
    new = []
    for stream, found in sorted(seen.items()):
        if _known(device, stream, found):
            if device.refusal(stream):
                device = await registry.forget_refusal(device.device_id, stream)
                log.info("incarnation_refusal_over", device_id=device.device_id, stream=stream)
            continue
        reason = _refusal(device, stream, found, config.server.max_incarnations)
        if reason is not None:
            kept = found.id[:REFUSED_ID_KEPT]
            device, fresh = await registry.refuse(
                device.device_id, Refusal(stream, kept, reason, utc_now_iso())
            )
            if fresh:  # its data stays on the island: `report` flags the device
                log.error(
                    "incarnation_refused",
                    device_id=device.device_id,
                    stream=stream,
                    id=kept,
                    reason=reason,
                )
            continue
        previous = device.current(stream)
        fence = await _command_fence(js, device, stream)
        incarnation = Incarnation(stream, found.id, utc_now_iso(), fence, found.packed, via_shard)
        device = await registry.add_incarnation(device.device_id, incarnation)
        new.append(incarnation)
        log.info(
            "incarnation_changed" if previous else "incarnation_first_seen",
            device_id=device.device_id,
            stream=stream,
            incarnation=found.id,
            packed=found.packed,
            previous=previous.id if previous else None,
            command_fence=incarnation.command_fence,
        )
    return new


async def observe(
    js: JetStreamContext, nc: Client, config: HubConfig, devices: list[Device]
) -> list[Incarnation]:
    """Ask every device (those not linked now answer nothing) and `record` what is new."""
    registry = await Registry.open(js)
    found = await asyncio.gather(*(device_incarnations(nc, d) for d in devices))
    try:
        bound = _bound_to_fleet(
            await Monitor(f"http://{config.server.monitor_listen}").get("/leafz")
        )
    except MonitorUnavailable:
        bound = frozenset()  # a device linked to another node of a cluster is not listed either
    new: list[Incarnation] = []
    changed: set[str] = set()
    for device, seen in zip(devices, found, strict=True):
        if not _settled(device, seen):
            current = await registry.get(device.device_id)
            if recorded := await record(
                js, registry, config, current, seen, via_shard=_via_shard(current, bound)
            ):
                new += recorded
                changed.add(device.device_id)
    if new:
        await provision(js, config, await registry.list(), only=changed)
    return new


def _known(device: Device, stream: str, seen: Seen) -> bool:
    return any((i.stream, i.id) == (stream, seen.id) for i in device.incarnations)


def _settled(device: Device, seen: Mapping[str, Seen]) -> bool:
    """Whether the hub has what `seen` names, and has refused none of those streams."""
    return all(_known(device, s, i) and not device.refusal(s) for s, i in seen.items())


def _leafs(leafz: Mapping[str, object]) -> list[dict[str, Any]]:
    """The leaf connections `/leafz` lists."""
    leafs = leafz.get("leafs")
    return [leaf for leaf in leafs if isinstance(leaf, dict)] if isinstance(leafs, list) else []


def _leaf_ids(leafz: Mapping[str, object]) -> dict[str, int]:
    return {str(leaf.get("name")): int(leaf.get("id", 0)) for leaf in _leafs(leafz)}


def _bound_to_fleet(leafz: Mapping[str, object]) -> frozenset[str]:
    """Names of the links bound to the hub's own account: made under the users file of a
    release before 2026-11-28, they keep it until they drop."""
    return frozenset(
        str(leaf.get("name")) for leaf in _leafs(leafz) if leaf.get("account") == ACCOUNT
    )


def _via_shard(device: Device, bound_to_fleet: frozenset[str]) -> bool:
    """Whether a new incarnation's mirror takes its deliveries renamed by the device's shard
    (`auth`): not while its link is bound to the hub's own account, where no import renames
    them; that mirror keeps its deliveries' own name (and a per-device import) for good."""
    return not bound_to_fleet.intersection(device.leaf_names)


class _Fleet:
    """The registry by leaf name (``edge-<id>`` or the device's domain), re-read when stale
    or when a leaf the last reading did not know connects (at most once a second)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._by_leaf: dict[str, Device] = {}
        self._read_at = -RECHECK_S

    async def device(self, leaf_name: str) -> Device | None:
        await self._read(stale_after=1.0 if leaf_name not in self._by_leaf else RECHECK_S)
        return self._by_leaf.get(leaf_name)

    async def devices(self) -> list[Device]:
        """Every registered device, as read at most `RECHECK_S` ago."""
        await self._read(stale_after=RECHECK_S)
        return list({d.device_id: d for d in self._by_leaf.values()}.values())

    async def _read(self, stale_after: float) -> None:
        if time.monotonic() - self._read_at >= stale_after:
            devices = await self._registry.list()
            self._by_leaf = {n: d for d in devices for n in d.leaf_names}
            self._read_at = time.monotonic()

    def forget(self) -> None:
        self._read_at = -RECHECK_S


async def watch(
    js: JetStreamContext,
    nc: Client,
    config: HubConfig,
    monitor: Monitor,
    stop: asyncio.Event,
    *,
    interval: float = 0.5,
) -> None:
    """Until `stop` is set: observe each device whose leaf connection is new, and heal what
    the hub's mirrors skipped (`hub_ingest.fleet.refill`), each in its own loop, so that a long
    refill over a slow link never holds up a re-imaged device."""
    rounds: _Rounds | None = None

    async def ready() -> _Rounds:
        nonlocal rounds
        if rounds is None:
            registry = await Registry.open(js)
            rounds = _Rounds(js, nc, config, registry, _Fleet(registry), Refiller(js, nc, config))
        return rounds

    async def observe_links() -> None:
        await (await ready()).run(await monitor.get("/leafz"))

    async def heal_gaps() -> None:
        await (await ready()).refill()

    async def advance_rollout() -> None:
        await rollout.advance(js, config)

    log.info("incarnation_watch_started")
    async with asyncio.TaskGroup() as tasks:
        if config.server.admission == "callout":  # no device links without it
            tasks.create_task(Admission(js, config).run(nc, stop))
        tasks.create_task(_repeat("incarnation_watch", observe_links, interval, stop))
        tasks.create_task(_repeat("gap_watch", heal_gaps, interval, stop))
        tasks.create_task(_repeat("rollout_watch", advance_rollout, ROLLOUT_S, stop))


async def _repeat(
    name: str, step: Callable[[], Awaitable[None]], interval: float, stop: asyncio.Event
) -> None:
    """`step` every `interval` seconds until `stop`; a failure is logged once (and again when
    it changes, not twice a second while a node is down), then its recovery."""
    failing: tuple[str, int] | None = None  # the last error, and the rounds it failed
    while not stop.is_set():
        try:
            await step()
            if failing is not None:
                log.info(f"{name}_recovered", failed_rounds=failing[1])
                failing = None
        except Exception as exc:  # a hub restart or a slow device: try again
            if failing is None or failing[0] != repr(exc):
                log.warning(f"{name}_failed", error=repr(exc))
            failing = (repr(exc), failing[1] + 1 if failing else 1)
        await next_round(stop, interval)


@dataclass
class _Rounds:
    js: JetStreamContext
    nc: Client
    config: HubConfig
    registry: Registry
    fleet: _Fleet
    refiller: Refiller
    # device → (its leaf connection id, when both its streams last answered)
    checked: dict[str, tuple[int, float]] = field(default_factory=dict)
    # A recorded incarnation whose streams are not provisioned yet (the hub failed in between,
    # e.g. during a reload): the registry already knows it, so provision again until it works.
    unprovisioned: bool = False
    linked: set[str] = field(default_factory=set)  # device ids linked to this node

    async def run(self, leafz: Mapping[str, object]) -> None:
        """Ask every linked device whose connection is new (or checked long ago), at once."""
        if self.unprovisioned:
            await provision(self.js, self.config, await self.registry.list())
            self.unprovisioned = False
        now = time.monotonic()
        due: list[tuple[Device, int]] = []
        bound = _bound_to_fleet(leafz)
        linked = set()
        for name, leaf in _leaf_ids(leafz).items():
            device = await self.fleet.device(name)
            linked |= {device.device_id} if device else set()
            last = self.checked.get(device.device_id) if device else None
            if device and not (last and last[0] == leaf and now - last[1] < RECHECK_S):
                due.append((device, leaf))
        answers = await asyncio.gather(*(device_incarnations(self.nc, d) for d, _ in due))
        recorded: set[str] = set()
        for (device, leaf), seen in zip(due, answers, strict=True):
            if not _settled(device, seen):
                current = await self.registry.get(device.device_id)
                was, self.unprovisioned = self.unprovisioned, True
                via_shard = _via_shard(current, bound)
                if await record(
                    self.js, self.registry, self.config, current, seen, via_shard=via_shard
                ):
                    recorded.add(device.device_id)
                    self.fleet.forget()
                else:  # refused, as it was: nothing to provision
                    self.unprovisioned = was
            # Right after the link comes up the agent may not have made its streams yet: ask
            # again at the next round until both have answered.
            if len(seen) == len(OUTBOUND):
                self.checked[device.device_id] = (leaf, now)
        self.linked = linked
        if self.unprovisioned:  # one pass for the devices recorded in this round
            await provision(self.js, self.config, await self.registry.list(), only=recorded)
            self.unprovisioned = False

    async def refill(self) -> None:
        """Heal what the hub's mirrors skipped, from the islands (`linked` here first)."""
        await self.refiller.tick(mirror_targets(await self.fleet.devices()), self.linked)
