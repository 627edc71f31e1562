"""The device registry: one KV bucket on the hub, the single source of truth for the fleet.

Each device has a stable *shard*: the index of the aggregate streams that source it. A shard
is assigned once, at ``device add``, and never moves, because moving a source to another
aggregate stream would copy the device's whole stream a second time.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
)
from nats.js.kv import KeyValue

from edge_agent.health import utc_now_iso
from hub_ingest.errors import RegistryError

BUCKET = "FLEET_DEVICES"


@dataclass(frozen=True, slots=True)
class Device:
    device_id: str
    domain: str
    shard: int
    added_at: str
    nkey: str  # the public key the device's leaf connection authenticates with

    @property
    def api_prefix(self) -> str:
        return f"$JS.{self.domain}.API"


class Registry:
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, js: JetStreamContext) -> Registry:
        try:
            kv = await js.key_value(BUCKET)
        except BucketNotFoundError:
            kv = await js.create_key_value(
                KeyValueConfig(bucket=BUCKET, history=5, storage=StorageType.FILE)
            )
        return cls(kv)

    async def list(self) -> list[Device]:
        try:
            keys = await self._kv.keys()
        except NoKeysError:
            return []
        devices = [await self.get(key) for key in keys]
        return sorted(devices, key=lambda d: d.device_id)

    async def get(self, device_id: str) -> Device:
        try:
            entry = await self._kv.get(device_id)
        except KeyNotFoundError:
            raise RegistryError(f"device {device_id!r} is not registered") from None
        assert entry.value is not None
        return Device(**json.loads(entry.value))

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
        load = Counter(d.shard for d in existing)
        shard = next(i for i in range(len(existing) + 1) if load[i] < max_per_shard)
        device = Device(device_id, domain, shard, utc_now_iso(), nkey)
        try:
            await self._kv.create(device_id, json.dumps(asdict(device)).encode())
        except KeyWrongLastSequenceError:
            raise RegistryError(f"device {device_id!r} is already registered") from None
        return device

    async def remove(self, device_id: str) -> Device:
        device = await self.get(device_id)
        await self._kv.delete(device_id)
        return device
