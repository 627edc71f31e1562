"""Admitting devices to the fleet and retiring them: registry, credentials, auth, streams.

Both steps end with the hub's users file rewritten and the server reloaded before the
streams are provisioned, so a device's leaf connection is accepted by the time the hub
starts mirroring its streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
from nats.js import JetStreamContext

from edge_agent.protocol.names import island_name
from edge_agent.protocol.reconcile import Reconciled
from hub_ingest.auth import new_seed, public_key, reload_server, write_auth, write_secret
from hub_ingest.config import HubConfig
from hub_ingest.provision import check_foreign_streams, provision
from hub_ingest.registry import Device, Registry

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Change:
    device: Device
    seed_file: Path | None  # where the new device's seed was written, if the hub made one
    reloaded: bool  # False: no local hub server to signal; reload it by other means
    streams: list[Reconciled]


def seed_path(config: HubConfig, device_id: str) -> Path:
    return config.state_dir / "credentials" / f"{device_id}.nk"


async def _apply(
    js: JetStreamContext,
    config: HubConfig,
    registry: Registry,
    *,
    streams: bool = True,
    adopt: bool = False,
) -> tuple[bool, list[Reconciled]]:
    devices = await registry.list()
    write_auth(config, devices)
    reloaded = await reload_server(config)
    return reloaded, await provision(js, config, devices, adopt=adopt) if streams else []


async def enrol(
    js: JetStreamContext,
    config: HubConfig,
    device_id: str,
    *,
    domain: str | None = None,
    key: str | None = None,
    seed_file: Path | None = None,
    streams: bool = True,
    adopt: bool = False,
) -> Change:
    """Register `device_id` with its public `key`, or with a new key whose seed is written to
    `seed_file` (default ``<state_dir>/credentials/<id>.nk``, mode 0600). With
    ``streams=False`` the hub's streams are left for a later `provision`. A stream of another
    owner in the way is refused before anything changes (`adopt`: see `provision`)."""
    await check_foreign_streams(js, adopt=adopt)
    registry = await Registry.open(js)
    seed = None if key is not None else new_seed()
    nkey = key if key is not None else public_key(seed or "")
    device = await registry.add(
        device_id, domain or island_name(device_id), config.aggregates.max_sources_per_stream, nkey
    )
    written = None
    if seed is not None:
        written = seed_file or seed_path(config, device_id)
        write_secret(written, seed)
    reloaded, changed = await _apply(js, config, registry, streams=streams, adopt=adopt)
    log.info("device_enrolled", device_id=device_id, shard=device.shard, reloaded=reloaded)
    return Change(device, written, reloaded, changed)


async def retire(js: JetStreamContext, config: HubConfig, device_id: str) -> Change:
    """Remove `device_id`: its key stops working and its streams stop being mirrored."""
    registry = await Registry.open(js)
    device = await registry.remove(device_id)
    reloaded, streams = await _apply(js, config, registry)
    log.info("device_retired", device_id=device_id, reloaded=reloaded)
    return Change(device, None, reloaded, streams)
