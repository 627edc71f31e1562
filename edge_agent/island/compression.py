"""The leaf link's compression, chosen per link from its measured round trip.

With ``hub.compression = "by_rtt"`` (the default) a link starts uncompressed, and the agent
switches it to nats-server's ``s2_auto`` once the island measures a round trip of
``hub.compress_rtt`` (20 ms) or more, and back to ``off`` below half of that. A slow link
(LTE, satellite) keeps compression, where it pays; a fast one does not carry s2's framing,
whose buffers cost the hub about 1.3 MiB per link and, while hundreds of devices negotiate
it after a hub restart, gigabytes (docs/scaling.md). The hub offers ``accept``: each link's
device decides.

The choice is kept in the state directory, so the island is rendered with it on its next
start; an island the agent runs as a child is reloaded with it at once (the link reconnects
once).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from edge_agent.core.config import Config
from edge_agent.protocol.errors import MonitorUnavailable
from edge_agent.protocol.files import read_json, write_json
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.tomlconf import BY_RTT
from edge_agent.protocol.units import utc_now_iso

log = structlog.get_logger(__name__)

OFF = "off"
ON = "s2_auto"
# nats-server measures a leaf's round trip when it connects and at each ping (2 min): no
# need to ask it at every link poll.
CHECK_EVERY_S = 10.0


def choice_path(config: Config) -> Path:
    return config.agent.state_dir / "compression.json"


def link_mode(config: Config) -> str:
    """The compression the island's leaf remote is rendered with."""
    if config.hub.compression != BY_RTT:
        return config.hub.compression
    mode = (read_json(choice_path(config)) or {}).get("mode")
    return mode if mode in (OFF, ON) else OFF


def choose(rtt_s: float, current: str, threshold_s: float) -> str:
    """On from `threshold_s`, off again only below half of it: a round trip that wavers
    around the threshold does not make the link reconnect again and again."""
    if current == OFF:
        return ON if rtt_s >= threshold_s else OFF
    return OFF if rtt_s < threshold_s / 2 else ON


class LinkCompression:
    """Checks the link's round trip on every link poll and applies a new choice."""

    def __init__(
        self, config: Config, monitor: Monitor, reload: Callable[[], Awaitable[None]] | None
    ) -> None:
        self._config = config
        self._monitor = monitor
        self._reload = reload  # None: the island is not ours to reload (external mode)
        self._next_check = 0.0

    async def step(self) -> None:
        if self._config.hub.compression != BY_RTT or time.monotonic() < self._next_check:
            return
        try:
            rtt = await self._monitor.leaf_rtt()
        except MonitorUnavailable:
            return
        if rtt is None:
            return  # no link yet: asked again at the next poll
        self._next_check = time.monotonic() + CHECK_EVERY_S
        current = link_mode(self._config)
        mode = choose(rtt, current, self._config.hub.compress_rtt)
        if mode == current:
            return
        record = {"mode": mode, "rtt_ms": round(rtt * 1000, 3), "chosen_at": utc_now_iso()}
        write_json(choice_path(self._config), record, durable=False)
        log.info("link_compression_chosen", was=current, **record)
        if self._reload is not None:
            await self._reload()
