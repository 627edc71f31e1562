"""The hub's mirror windows of the island's unpacked streams, sized to the link's pace.

A hub mirror reads an outbound stream through a consumer on the island that acknowledges by
flow control: up to its window (`max_ack_pending`) of messages go up the link, then the
origin waits for the hub's reply. Whatever else the device sends up the link waits behind
that window (a command sent while the link was cut started 8.5 s after the link returned
over a compressed 256 kbit/s link, 24 s uncompressed, with fixed windows). So this task
polls each unpacked stream's consumer, times its rounds (`edge_agent.island.pace.Window`)
and sets the window in place to what the link carries in about 2 s: small on a slow link,
up to `MIRROR_WINDOW` on a fast one. The window is kept in the consumer, so a link that
returns starts at the pace it had; a reconcile (agent start, a new compression choice)
starts it again at `edge_agent.island.streams.uplink_window`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from edge_agent.core.config import Config
from edge_agent.island.pace import Window
from edge_agent.island.streams import hub_consumer_config
from edge_agent.protocol.errors import MonitorUnavailable
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.names import INCARNATION, hub_consumer
from edge_agent.protocol.reconcile import MIRROR_WINDOW

log = structlog.get_logger(__name__)

# How often the consumers are read: while something is in flight (a round of about 2 s is
# timed to within this), and while nothing is.
_BUSY_S = 0.1
_IDLE_S = 1.0
# The link's round trip, as nats-server measures it on the leaf connection, is read this often
# and the least of the last `_RTT_KEPT` taken: one measured behind a full window is that
# window's crossing too.
_RTT_EVERY_S = 5.0
_RTT_KEPT = 120


@dataclass(slots=True)
class _Paced:
    incarnation: str
    window: int  # as last read or set: another value means someone else set it
    pace: Window


class Windows:
    def __init__(
        self, js: JetStreamContext, monitor: Monitor, config: Config, streams: tuple[str, ...]
    ) -> None:
        self.js = js
        self.monitor = monitor
        self.config = config
        self.streams = streams
        self._paced: dict[str, _Paced] = {}
        self._rtts: deque[float] = deque(maxlen=_RTT_KEPT)
        self._rtt_at = 0.0

    async def run(self) -> None:
        while True:
            await self._sample_rtt()
            busy = False
            for stream in self.streams:
                try:
                    busy = await self._step(stream) or busy
                except NotFoundError:  # the stream or its consumer is being made again
                    self._paced.pop(stream, None)
                except (APIError, nats.errors.Error, TimeoutError) as exc:
                    log.warning("uplink_window_unread", stream=stream, error=repr(exc))
            await asyncio.sleep(_BUSY_S if busy else _IDLE_S)

    async def _step(self, stream: str) -> bool:
        """Observe `stream`'s hub consumer, and set its window if the pace says so; whether
        anything was in flight or waiting."""
        if stream not in self._paced:
            meta = (await self.js.stream_info(stream)).config.metadata or {}
            self._paced[stream] = _Paced(meta.get(INCARNATION, ""), 0, Window(0, MIRROR_WINDOW))
        paced = self._paced[stream]
        info = await self.js.consumer_info(stream, hub_consumer(paced.incarnation))
        window = info.config.max_ack_pending or 1
        if window != paced.window:  # first read, or a reconcile started it again
            paced.window, paced.pace = window, Window(window, MIRROR_WINDOW)
        floor, in_flight = info.ack_floor.stream_seq, info.num_ack_pending
        paced.pace.rtt = min(self._rtts, default=0.0)
        paced.pace.observe(floor, in_flight, window, time.monotonic())
        if paced.pace.size != window:
            paced.window = paced.pace.size
            config = hub_consumer_config(self.config, stream, paced.incarnation)
            config.max_ack_pending = paced.window
            await self.js.add_consumer(stream, config)
            log.info("uplink_window_set", stream=stream, window=paced.window, was=window)
        return bool(in_flight or info.num_pending)

    async def _sample_rtt(self) -> None:
        if time.monotonic() - self._rtt_at < _RTT_EVERY_S:
            return
        self._rtt_at = time.monotonic()
        with contextlib.suppress(MonitorUnavailable):
            if (rtt := await self.monitor.leaf_rtt()) is not None:
                self._rtts.append(rtt)
