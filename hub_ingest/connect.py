"""Connections from the hub tools to the hub's nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats
from nats.aio.client import Client

from hub_ingest.config import HubConfig


@asynccontextmanager
async def hub_connection(config: HubConfig, name: str = "hub-ingest") -> AsyncIterator[Client]:
    """A connection to the hub that is drained on exit."""
    nc = await nats.connect(
        list(config.nats.servers),
        name=name,
        nkeys_seed=str(config.nats.credentials),
        connect_timeout=5,
        max_reconnect_attempts=-1,
        allow_reconnect=True,
    )
    try:
        yield nc
    finally:
        await nc.drain()
