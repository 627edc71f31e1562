"""The hub's time line, as a device can know it: command expiry is judged on it.

A device's clock may be years ahead or days behind (no RTC, no NTP on a closed network), and
a command's ``expires_at`` was written on the hub's side. So the agent never decides expiry
on its own clock:

- While the link is up it asks the hub for the time: every JetStream API response carries the
  server's time (``ts``); the agent takes the middle of the round trip. Between syncs, and
  across outages, it carries that time forward with the monotonic clock, which no wall-clock
  step moves. The offset (hub minus device clock) goes into heartbeats and ``status``.
- Every command in the island's mirror carries the hub's store time of the command, a time
  the hub has certainly passed.
- Before the first sync since the agent started, the hub's time is known only to be at
  least the newest such store time: only a command that expired before that is expired.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from nats.aio.client import Client

from edge_agent.protocol.units import parse_time


@dataclass(frozen=True, slots=True)
class _Sync:
    hub: datetime  # the hub's time at `mono`
    mono: float
    offset_s: float  # hub minus device wall clock, then


class HubClock:
    def __init__(
        self,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self._wall = wall
        self._mono = mono
        self._sync: _Sync | None = None
        self._floor: datetime | None = None

    @property
    def offset_s(self) -> float | None:
        """Hub minus device clock at the last sync, in seconds; None before the first."""
        return None if self._sync is None else round(self._sync.offset_s, 3)

    def synced(self, hub: datetime, sent: float, received: float) -> None:
        """The hub said `hub` during a request sent and answered at these monotonic times."""
        middle = (sent + received) / 2
        device = self._wall() - timedelta(seconds=self._mono() - middle)
        self._sync = _Sync(hub, middle, (hub - device).total_seconds())

    def saw(self, stored_at: datetime) -> None:
        """A hub store time (of a command): the hub's clock has passed it."""
        if self._floor is None or stored_at > self._floor:
            self._floor = stored_at

    def now(self) -> datetime | None:
        """The hub's time now, as far as it is known (None: nothing heard from the hub)."""
        carried = None
        if self._sync is not None:
            carried = self._sync.hub + timedelta(seconds=self._mono() - self._sync.mono)
        if carried is None or (self._floor is not None and self._floor > carried):
            return self._floor
        return carried

    async def sync(self, nc: Client, subject: str, timeout: float = 2.0) -> None:
        """Ask the hub (any JetStream API request answered by it) for its time."""
        sent = self._mono()
        reply = await nc.request(subject, b"", timeout=timeout)
        received = self._mono()
        hub = parse_time(json.loads(reply.data).get("ts"))
        if hub is None:
            raise ValueError(f"no server time in the reply from {subject}")
        self.synced(hub, sent, received)
