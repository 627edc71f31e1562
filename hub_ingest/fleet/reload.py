"""Reloading the hub's nats-server(s) after the users file changed: SIGHUP, and its end seen
on ``/varz``."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from edge_agent.protocol.errors import MonitorUnavailable
from edge_agent.protocol.monitor import Monitor
from hub_ingest.core.config import HubConfig, ServerConfig
from hub_ingest.core.errors import HubIngestError, HubUnreachableError

# How often a reload's end is looked for: every 5 ms for its first second, then every 100 ms.
# One takes 14 ms on an idle hub of 100 devices (79 at 500) and a device's enrolment waits for
# it (a 50 ms poll was most of its 70 ms at 100); one under load can take seconds, and `/varz`
# is not free for a busy hub.
_RELOAD_POLL_FAST_S = 0.005
_RELOAD_POLL_SLOW_S = 0.1
_RELOAD_FAST_FOR_S = 1.0


async def reload_server(
    config: HubConfig, timeout: float = 30.0, *, new_accounts: bool = False
) -> bool:
    """Ask each hub server running on this machine (its pid file is here) to re-read its
    config; False if none does. The other nodes of a cluster re-read theirs when their own
    ``hub-ingest watch`` sees the registry change.

    A leaf account a reload creates is set up only in part until the next one (nats-server
    2.15: the first device of a new shard linked there and its readings crossed, but its
    island's requests to the hub went unanswered), so with `new_accounts` it is read twice."""
    if new_accounts:
        await reload_server(config, timeout)
    if config.cluster is None:
        return await _reload(config.server, "server.monitor_listen", timeout)
    reloaded = [
        await _reload(n.server, f"cluster.nodes[{n.name}].monitor_listen", timeout)
        for n in config.cluster.nodes
    ]
    return any(reloaded)


async def _reload(server: ServerConfig, key: str, timeout: float) -> bool:
    """A reload under load can take well over 10 s (nats-server issue #4630; CI saw one miss a
    10 s deadline), hence the generous `timeout`."""
    try:
        pid = int(server.pid_file.read_text().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False  # a node that is down reads the file when it starts
    monitor = Monitor(f"http://{server.monitor_listen}")
    try:
        before = (await monitor.get("/varz")).get("config_load_time")
        try:
            os.kill(pid, signal.SIGHUP)
        except ProcessLookupError:
            return False
        start = time.monotonic()
        deadline = start + timeout
        while (await monitor.get("/varz")).get("config_load_time") == before:
            if time.monotonic() > deadline:
                raise HubIngestError(
                    f"hub nats-server {server.server_name} (pid {pid}) did not reload "
                    f"within {timeout}s"
                )
            fast = time.monotonic() - start < _RELOAD_FAST_FOR_S
            await asyncio.sleep(_RELOAD_POLL_FAST_S if fast else _RELOAD_POLL_SLOW_S)
    except MonitorUnavailable as exc:
        raise HubUnreachableError(
            f"cannot reload the hub's nats-server {server.server_name} (pid {pid}): its "
            f"monitoring endpoint {key} = {server.monitor_listen} does not answer ({exc})"
        ) from None
    return True
