"""Whether the hub answers, asked when the leaf link is down.

A link that is down looks the same on the device whether the network is gone (normal for an
intermittent device) or the hub turns the device away (its key removed or never registered,
which no reconnect mends). nats-server greets every connection to its leaf port with an
``INFO`` line before any credential is sent, so `reach_hub` opens a plain connection to each
hub URL, reads that line and closes: it tells "no network" from "the hub answers, the link
still does not come up". It signs in as nothing, so it never competes with the island's own
link.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

REACH_TIMEOUT_S = 3.0
LEAF_PORT = 7422  # nats-server's default leaf port, for a URL that names none
_INFO_LIMIT = 64 * 1024


@dataclass(frozen=True, slots=True)
class HubReach:
    url: str  # the last URL tried: the one that answered, if one did
    answered: bool  # a nats-server greeted the connection
    server: str | None = None  # the name the answering server gave
    error: str | None = None  # why none answered


async def _greeting(url: str, timeout: float) -> HubReach:
    parts = urlsplit(url)
    if not parts.hostname:
        return HubReach(url, False, error="no host in the URL")
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                parts.hostname, parts.port or LEAF_PORT, limit=_INFO_LIMIT
            )
            try:
                line = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError, ValueError) as exc:
        return HubReach(url, False, error=repr(exc))
    if not line.startswith(b"INFO "):
        return HubReach(url, False, error=f"not a NATS server's greeting: {line[:40]!r}")
    try:
        info = json.loads(line[5:])
    except ValueError:
        info = {}
    name = info.get("server_name") if isinstance(info, dict) else None
    return HubReach(url, True, server=str(name) if name else None)


async def reach_hub(urls: tuple[str, ...], timeout: float = REACH_TIMEOUT_S) -> HubReach:
    """The first of `urls` whose server answers, or the last one's failure."""
    reach = HubReach("", False, error="no hub URL configured")
    for url in urls:
        reach = await _greeting(url, timeout)
        if reach.answered:
            break
    return reach
