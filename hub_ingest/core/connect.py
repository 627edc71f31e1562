"""Connections from the hub tools to the hub's nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext

from hub_ingest.core.config import HubConfig
from hub_ingest.core.errors import HubUnreachableError

log = structlog.get_logger(__name__)

_CONNECT_ATTEMPTS = 3  # per server, before a hub that refuses us or is not there is an error
# nats-py waits 5 s for a JetStream API answer; a busy hub cluster (a leader election, a node
# catching up) can take longer, and an operator's `device add` failing then is wrong.
JETSTREAM_TIMEOUT_S = 20.0


def hub_jetstream(nc: Client, config: HubConfig) -> JetStreamContext:
    """The hub tools' JetStream context on `nc`: the hub's domain, a cluster's patience."""
    return nc.jetstream(domain=config.nats.domain, timeout=JETSTREAM_TIMEOUT_S)


@asynccontextmanager
async def hub_connection(config: HubConfig, name: str = "hub-ingest") -> AsyncIterator[Client]:
    """A connection to the hub that is drained on exit.

    The first connection gives up after a few attempts, so a wrong key or a hub that is down
    is an error rather than a hang; once connected, it reconnects for as long as an outage
    lasts (nats-py would give up after about two minutes).
    """
    failures: list[Exception] = []

    async def failed(exc: Exception) -> None:
        failures.append(exc)
        log.warning("hub_connection_error", error=str(exc) or type(exc).__name__)

    try:
        nc = await nats.connect(
            list(config.nats.servers),
            name=name,
            nkeys_seed=str(config.nats.credentials),
            connect_timeout=5,
            max_reconnect_attempts=_CONNECT_ATTEMPTS,
            error_cb=failed,
        )
    except nats.errors.NoServersError:
        # The server's own refusal says more than the reset that follows it.
        refusals = [exc for exc in failures if isinstance(exc, nats.errors.Error)]
        cause = str((refusals or failures)[-1]) if failures else "no server answered"
        raise HubUnreachableError(
            f"cannot connect to the hub at {', '.join(config.nats.servers)}: {cause} "
            f"(signing in with nats.credentials = {config.nats.credentials})"
        ) from None
    nc.options["max_reconnect_attempts"] = -1  # from now on, outlast any outage
    try:
        yield nc
    finally:
        await nc.drain()


async def close_quietly(nc: Client) -> None:
    """Close `nc` whatever state its link is in, for a caller that is stopping anyway.

    nats-py's close can fail on a link that is already going (a server restarting, a reconnect
    under way), and can even raise a `CancelledError` of its own making: it waits on futures
    of its socket and its reconnect task that it cancels itself. The client is closed either
    way. A cancellation aimed at the caller's task still propagates.
    """
    try:
        await nc.close()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.info("nats_client_close_cancelled_inside_nats_py")
    except Exception as exc:  # closing what may already be broken
        log.info("nats_client_close_failed", error=str(exc) or type(exc).__name__)
