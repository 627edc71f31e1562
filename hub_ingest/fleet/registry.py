"""The device registry: one KV bucket on the hub, the single source of truth for the fleet.

Each device has a stable *shard*: the index of the aggregate streams that source it. A shard
is assigned once, at ``device add``, and never moves, because moving a source to another
aggregate stream would copy the device's whole stream a second time.

Each device also has the *incarnations* of its outbound streams the hub has seen, oldest
first (`hub_ingest.fleet.watch` records them): the hub keeps one mirror per incarnation.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType, StreamInfo
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
)
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from edge_agent.protocol.names import ISLAND_CONSUMER, island_consumer, island_name, js_api
from edge_agent.protocol.units import utc_now_iso
from hub_ingest.core.buckets import bucket_keys, bucket_stream
from hub_ingest.core.errors import RegistryError
from hub_ingest.core.gather import gather_bounded

_WRITE_ATTEMPTS = 10  # optimistic writes that lost a race are retried this often

# Where the hub's account reaches a shard's islands, each under its domain, through one
# import a shard (`auth`): ``shardapi.2.edge-pump.API`` for ``$JS.edge-pump.API`` in
# ``DEVICES_2``.
SHARD_APIS = "shardapi"


def shard_api(shard: int) -> str:
    """The prefix under which the hub's account reaches the APIs of a shard's islands."""
    return f"{SHARD_APIS}.{shard + 1}"


def shard_island_api(shard: int, domain: str) -> str:
    """The JetStream API of the island of `domain`, as the hub's account reaches it."""
    return f"{shard_api(shard)}.{domain}.API"


class _Raced(Exception):
    """An optimistic write found another revision than it read: another writer came first,
    or the read came from a replica that had not caught up yet (a cluster's direct gets are
    answered by any replica)."""


@dataclass(frozen=True, slots=True)
class Incarnation:
    """One life of a device stream: from a (re)created store until the next."""

    stream: str  # the device stream: TELEMETRY or EVENTS
    id: str  # the stream's ``incarnation`` metadata
    seen_at: str  # when the hub first saw it (hub clock)
    # Commands stored in CMD_<id> up to this sequence predate the incarnation: a re-imaged
    # device answers them without running them (0 for the device's first incarnation).
    command_fence: int
    packed: bool = False  # its stream holds packs of readings (`edge_agent.protocol.pack`)
    # Its hub mirror takes the island's deliveries as its shard's import renames them
    # (`streams.shard_deliveries`); False for the mirrors made before (2026-11-29), which
    # keep a per-device import (a mirror's source cannot change in place).
    via_shard: bool = False


@dataclass(frozen=True, slots=True)
class Refusal:
    """An incarnation of a device stream the hub will not mirror (`hub_ingest.fleet.watch`):
    what it holds stays on the island. Kept until the hub takes a later one of the stream."""

    stream: str
    id: str  # as the island names it
    reason: str
    at: str  # when the hub first refused it (hub clock)


BUCKET = "FLEET_DEVICES"


@dataclass(frozen=True, slots=True)
class Device:
    device_id: str
    domain: str
    shard: int
    added_at: str
    nkey: str  # the public key the device's leaf connection authenticates with
    incarnations: tuple[Incarnation, ...] = field(default=())
    # The consumer on its CMD_<id> that its island's command mirror binds to: its shard's
    # (`new`), or `ISLAND_CONSUMER` for the devices enrolled before 2026-11-29, whose
    # islands are bound to it (docs/scaling.md, "Command consumers named by shard").
    command_consumer: str = ISLAND_CONSUMER
    # The prefix its island's JetStream API takes in the hub's account: under its shard's
    # (`new`), or its own ``$JS.<domain>.API`` ("") for the devices enrolled before
    # 2026-11-30, which keep an import of their own: their hub mirrors were made with it, and
    # a mirror's source cannot change in place.
    island_api: str = ""
    refused: tuple[Refusal, ...] = field(default=())  # at most one a device stream

    @classmethod
    def new(cls, device_id: str, domain: str, shard: int, nkey: str) -> Device:
        """A device enrolled now."""
        api = shard_island_api(shard, domain)
        return cls(device_id, domain, shard, utc_now_iso(), nkey, (), island_consumer(shard), api)

    @property
    def api_prefix(self) -> str:
        """How the hub's account addresses its island's JetStream API."""
        return self.island_api or js_api(self.domain)

    @property
    def leaf_names(self) -> tuple[str, str]:
        """The names the hub's ``/leafz`` may give the device's link: its island's server
        name or its domain."""
        return island_name(self.device_id), self.domain

    def current(self, stream: str) -> Incarnation | None:
        """The newest incarnation of the device stream `stream`, if the hub has seen one."""
        return next((i for i in reversed(self.incarnations) if i.stream == stream), None)

    def refusal(self, stream: str) -> Refusal | None:
        """Why the hub refuses the incarnation of `stream` its island names, if it does."""
        return next((r for r in self.refused if r.stream == stream), None)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Device:
        fields: dict[str, Any] = json.loads(data)
        seen = fields.pop("incarnations", [])
        refused = tuple(Refusal(**r) for r in fields.pop("refused", []))
        return cls(**fields, incarnations=tuple(Incarnation(**i) for i in seen), refused=refused)


def assign_shards(existing: Iterable[Device], count: int, max_per_shard: int) -> list[int]:
    """Shards for `count` new devices, in order: each goes to the lowest shard with room."""
    load = Counter(d.shard for d in existing)
    shards = []
    for _ in range(count):
        shard = next(i for i in itertools.count() if load[i] < max_per_shard)
        load[shard] += 1
        shards.append(shard)
    return shards


_READ_AT_ONCE = 64
# A listing reads what was written since the last one, message by message, unless more was
# written than this (or than there are devices): then it reads every device again.
_CATCH_UP_AT_MOST = 256
_STREAM = bucket_stream(BUCKET)
_SUBJECTS = f"$KV.{BUCKET}."


@dataclass(slots=True)
class _View:
    """The registry as last read, and where its stream stood then: each write to the bucket
    is one message of that stream, so the next listing reads only the messages after."""

    created: datetime | None = None  # the stream's: a bucket made again is read afresh
    seq: int = 0
    devices: dict[str, Device] = field(default_factory=dict)
    reading: asyncio.Lock = field(default_factory=asyncio.Lock)  # one listing at a time


# One view per hub connection's JetStream context, shared by every `Registry` opened on it;
# keyed weakly, and a view refers to nothing that would keep its context alive.
_VIEWS: weakref.WeakKeyDictionary[JetStreamContext, _View] = weakref.WeakKeyDictionary()


class Registry:
    def __init__(self, js: JetStreamContext, kv: KeyValue) -> None:
        self._js = js
        self._kv = kv
        self._view = _VIEWS.setdefault(js, _View())

    @classmethod
    async def open(cls, js: JetStreamContext) -> Registry:
        try:
            kv = await js.key_value(BUCKET)
        except BucketNotFoundError:
            kv = await js.create_key_value(
                KeyValueConfig(bucket=BUCKET, history=5, storage=StorageType.FILE)
            )
        return cls(js, kv)

    async def list(self) -> list[Device]:
        """Every registered device, by id. Reads what was written since the last listing (a
        fleet of 500 took 0.15 s a listing read afresh, and adding a device lists it several
        times), from the stream's leader, as a get does."""
        async with self._view.reading:
            info = await self._js.stream_info(_STREAM)
            view, last = self._view, info.state.last_seq
            behind = last - view.seq
            remade = info.created != view.created or behind < 0
            if remade or behind > min(_CATCH_UP_AT_MOST, len(view.devices)):
                await self._read_all(info)
            elif behind:
                await self._catch_up(last)
            return [self._view.devices[k] for k in sorted(self._view.devices)]

    async def _read_all(self, info: StreamInfo) -> None:
        """Read every device; `info` is the bucket's stream as it stood before."""
        # Not one consumer over the bucket (tried: one request instead of a get per device):
        # making a consumer asks a cluster's meta leader, which is away for seconds when a
        # node dies, while a get needs only the bucket's own replicas.
        keys = await bucket_keys(self._js, BUCKET)

        async def read(device_id: str) -> Device | None:
            try:
                return await self.get(device_id)
            except RegistryError:  # removed since: its subject keeps the delete marker
                return None

        found = await gather_bounded(map(read, keys), _READ_AT_ONCE)
        # The stream's last sequence before the keys and gets: a value they read that is newer
        # is read again by the next listing, which changes nothing.
        view = self._view
        view.created, view.seq = info.created, info.state.last_seq
        view.devices = {d.device_id: d for d in found if d is not None}

    async def _catch_up(self, last: int) -> None:
        """Apply the writes after the view's sequence up to `last`, oldest first."""
        seq = self._view.seq + 1
        while seq <= last:
            try:
                msg = await self._js.get_msg(_STREAM, seq, subject=f"{_SUBJECTS}>", next=True)
            except NotFoundError:
                break  # the rest were overwritten (the bucket keeps a few values per key)
            assert msg.seq is not None and msg.subject is not None
            device_id = msg.subject.removeprefix(_SUBJECTS)
            if (msg.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE):  # a delete marker
                self._view.devices.pop(device_id, None)
            elif msg.data:
                self._view.devices[device_id] = Device.from_json(msg.data)
            seq = msg.seq + 1
        self._view.seq = last

    async def get(self, device_id: str) -> Device:
        try:
            entry = await self._kv.get(device_id)
        except KeyNotFoundError:
            raise RegistryError(f"device {device_id!r} is not registered") from None
        assert entry.value is not None
        return Device.from_json(entry.value)

    async def add(self, device_id: str, domain: str, max_per_shard: int, nkey: str) -> Device:
        existing = await self.list()
        if any(d.device_id == device_id for d in existing):
            raise RegistryError(f"device {device_id!r} is already registered")
        clash = next((d for d in existing if d.domain == domain), None)
        if clash is not None:
            raise RegistryError(f"domain {domain!r} is already used by device {clash.device_id!r}")
        holder = next((d for d in existing if d.nkey == nkey), None)
        if holder is not None:
            raise RegistryError(f"key {nkey} is already used by device {holder.device_id!r}")
        (shard,) = assign_shards(existing, 1, max_per_shard)
        return await self.create(Device.new(device_id, domain, shard, nkey))

    @retry(
        # A registry bucket made a moment ago on a cluster may have no leader yet: the write
        # gets no responders (seen right after a 3-node hub came up, on a loaded machine).
        # No responder stored nothing, so asking again cannot register a device twice.
        retry=retry_if_exception_type(NoStreamResponseError),
        stop=stop_after_attempt(8),
        wait=wait_exponential_jitter(multiplier=0.2, jitter=0.2, max=2.0),
        reraise=True,
    )
    async def create(self, device: Device) -> Device:
        """Store a new `device` as it is (see `assign_shards`); refused if its id is taken."""
        try:
            await self._kv.create(device.device_id, device.to_json())
        except KeyWrongLastSequenceError:
            raise RegistryError(f"device {device.device_id!r} is already registered") from None
        return device

    async def add_incarnation(self, device_id: str, incarnation: Incarnation) -> Device:
        """Record `incarnation` (once: a second call with the same id changes nothing), and
        forget the refusal of an earlier one of its stream."""

        def add(device: Device) -> Device:
            if any(
                (i.stream, i.id) == (incarnation.stream, incarnation.id)
                for i in device.incarnations
            ):
                return device
            return replace(
                device,
                incarnations=(*device.incarnations, incarnation),
                refused=tuple(r for r in device.refused if r.stream != incarnation.stream),
            )

        return await self._update(device_id, add)

    async def refuse(self, device_id: str, refusal: Refusal) -> tuple[Device, bool]:
        """Record `refusal` in place of any other of its stream, unless the device has it
        already (same id and reason); the device, and whether it is new."""

        def refuse(device: Device) -> Device:
            if any(
                (r.stream, r.id, r.reason) == (refusal.stream, refusal.id, refusal.reason)
                for r in device.refused
            ):
                return device
            others = tuple(r for r in device.refused if r.stream != refusal.stream)
            return replace(device, refused=(*others, refusal))

        device = await self._update(device_id, refuse)
        return device, refusal in device.refused

    async def forget_refusal(self, device_id: str, stream: str) -> Device:
        """Forget the refusal of `stream`'s incarnation: its island went back to one the hub
        has (an id repaired by the agent)."""

        def forget(device: Device) -> Device:
            return replace(device, refused=tuple(r for r in device.refused if r.stream != stream))

        return await self._update(device_id, forget)

    async def _update(self, device_id: str, change: Callable[[Device], Device]) -> Device:
        try:
            return await self._write(device_id, change)
        except _Raced:
            raise RegistryError(
                f"device {device_id!r}: registry kept changing under the update"
            ) from None

    # Read again after a pause: a lagging replica needs time to catch up, not a tight loop
    # (ten attempts without one failed on a loaded three-node cluster).
    @retry(
        retry=retry_if_exception_type(_Raced),
        stop=stop_after_attempt(_WRITE_ATTEMPTS),
        wait=wait_exponential_jitter(multiplier=0.05, jitter=0.05, max=1.0),
        reraise=True,
    )
    async def _write(self, device_id: str, change: Callable[[Device], Device]) -> Device:
        """Write `change` of the device as stored now, if it changes anything."""
        try:
            entry = await self._kv.get(device_id)
        except KeyNotFoundError:
            raise RegistryError(f"device {device_id!r} is not registered") from None
        assert entry.value is not None and entry.revision is not None
        device = Device.from_json(entry.value)
        changed = change(device)
        if changed == device:
            return device
        try:
            await self._kv.update(device_id, changed.to_json(), last=entry.revision)
        except KeyWrongLastSequenceError:
            raise _Raced from None
        return changed

    async def remove(self, device_id: str) -> Device:
        device = await self.get(device_id)
        await self._kv.delete(device_id)
        return device
