"""The island's leaf link as the agent sees it: when it last went up or down, and the
last clock sync with the hub, kept in small JSON files under the state directory so that
``edge-agent status`` can show them while the agent is down."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from edge_agent.core.config import Config
from edge_agent.protocol.errors import MonitorUnavailable
from edge_agent.protocol.files import write_json
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.units import utc_now_iso

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class LinkState:
    up: bool
    since: str | None  # ISO-8601 UTC of the last change the agent saw, None if unknown


def link_path(config: Config) -> Path:
    """Where the agent records the link's last change."""
    return config.agent.state_dir / "link.json"


def clock_path(config: Config) -> Path:
    """Where the agent keeps its last clock sync with the hub, for ``status``."""
    return config.agent.state_dir / "clock.json"


def write_clock(config: Config, offset_s: float | None) -> None:
    write_json(
        clock_path(config), {"offset_s": offset_s, "synced_at": utc_now_iso()}, durable=False
    )


class LinkTracker:
    """Remembers when the leaf link last went up or down, for ``status`` and heartbeats."""

    def __init__(self, config: Config, monitor: Monitor) -> None:
        self._path = link_path(config)
        self._monitor = monitor
        self.state = LinkState(False, None)
        # For tasks that act on a change (fast resume): exactly one of the two is set.
        self.is_up = asyncio.Event()
        self.is_down = asyncio.Event()
        self.is_down.set()

    async def poll(self) -> LinkState:
        try:
            up = await self._monitor.leaf_connected()
        except MonitorUnavailable:
            up = False
        if up != self.state.up or self.state.since is None:
            self.state = LinkState(up, utc_now_iso())
            write_json(self._path, asdict(self.state), durable=False)
            log.info("link_restored" if up else "link_lost", since=self.state.since)
        (self.is_up if up else self.is_down).set()
        (self.is_down if up else self.is_up).clear()
        return self.state
