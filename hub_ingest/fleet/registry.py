"""The device registry: one KV bucket on the hub, the single source of truth for the fleet.

Each device has a stable *shard*: the index of the aggregate streams that source it. A shard
is assigned once, at ``device add``, and never moves, because moving a source to another
aggregate stream would copy the device's whole stream a second time.

Each device also has the *incarnations* of its outbound streams the hub has seen, oldest
first (`hub_ingest.fleet.watch` records them): the hub keeps one mirror per incarnation.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
)
from nats.js.kv import KeyValue
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from edge_agent.protocol.names import js_api
from edge_agent.protocol.units import utc_now_iso
from hub_ingest.core.buckets import bucket_keys
from hub_ingest.core.errors import RegistryError
from hub_ingest.core.gather import gather_bounded

_WRITE_ATTEMPTS = 10  # optimistic writes that lost a race are retried this often


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


BUCKET = "FLEET_DEVICES"


@dataclass(frozen=True, slots=True)
class Device:
    device_id: str
    domain: str
    shard: int
    added_at: str
    nkey: str  # the public key the device's leaf connection authenticates with
    incarnations: tuple[Incarnation, ...] = field(default=())

    @property
    def api_prefix(self) -> str:
        return js_api(self.domain)

    def current(self, stream: str) -> Incarnation | None:
        """The newest incarnation of the device stream `stream`, if the hub has seen one."""
        return next((i for i in reversed(self.incarnations) if i.stream == stream), None)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Device:
        fields: dict[str, Any] = json.loads(data)
        seen = fields.pop("incarnations", [])
        return cls(**fields, incarnations=tuple(Incarnation(**i) for i in seen))


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


class Registry:
    def __init__(self, js: JetStreamContext, kv: KeyValue) -> None:
        self._js = js
        self._kv = kv

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
        """Every registered device, by id; read `_READ_AT_ONCE` at a time (one after the other,
        a fleet of 500 took 0.15 s a listing, and adding a device lists it several times)."""
        # Not one consumer over the bucket (tried: one request instead of a get per device):
        # making a consumer asks a cluster's meta leader, which is away for seconds when a
        # node dies, while a get needs only the bucket's own replicas.

        async def read(device_id: str) -> Device | None:
            try:
                return await self.get(device_id)
            except RegistryError:  # removed since: its subject keeps the delete marker
                return None

        keys = await bucket_keys(self._js, BUCKET)
        found = await gather_bounded(map(read, keys), _READ_AT_ONCE)
        return [device for device in found if device is not None]

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
        return await self.create(Device(device_id, domain, shard, utc_now_iso(), nkey))

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
        """Record `incarnation` (once: a second call with the same id changes nothing)."""
        for _ in range(_WRITE_ATTEMPTS):
            try:
                entry = await self._kv.get(device_id)
            except KeyNotFoundError:
                raise RegistryError(f"device {device_id!r} is not registered") from None
            assert entry.value is not None and entry.revision is not None
            device = Device.from_json(entry.value)
            if any(
                (i.stream, i.id) == (incarnation.stream, incarnation.id)
                for i in device.incarnations
            ):
                return device
            device = replace(device, incarnations=(*device.incarnations, incarnation))
            try:
                await self._kv.update(device_id, device.to_json(), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue  # another writer came first: read again
            return device
        raise RegistryError(f"device {device_id!r}: registry kept changing under the update")

    async def remove(self, device_id: str) -> Device:
        device = await self.get(device_id)
        await self._kv.delete(device_id)
        return device
