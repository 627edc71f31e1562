"""The hub's mirror windows of the island's unpacked streams, sized to the link.

A hub mirror reads an outbound stream through a consumer on the island that acknowledges by
flow control: up to its window (`max_ack_pending`) of messages go up the link, then the
origin waits for the hub's reply. Whatever else the device sends up the link waits behind
that window (with fixed windows, a command sent while a 256 kbit/s link was cut started 8.5 s
after the link returned compressed, 24 s uncompressed). So this task polls each unpacked
stream's consumer; as each round begins (a whole window just sent) it times a request to the
hub that queues behind the window as the device's own do, and sets the window in place to
what lets such a request wait about 2 s (`edge_agent.island.pace.Window`): small on a slow
link, up to `MIRROR_WINDOW` where the hub, not the link, holds the window back. The window
is kept in the consumer, so a link that returns starts at the pace it had; a reconcile
(agent start, a new compression choice) starts it again at
`edge_agent.island.streams.uplink_window`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import nats.errors
import structlog
from nats.aio.client import Client
from nats.js.errors import APIError, NotFoundError

from edge_agent.core.config import Config
from edge_agent.island.pace import Window
from edge_agent.island.streams import hub_consumer_config, incarnation_of
from edge_agent.protocol.monitor import LeafRtt
from edge_agent.protocol.names import command_stream, hub_consumer
from edge_agent.protocol.reconcile import MIRROR_WINDOW

log = structlog.get_logger(__name__)

# How often the consumers are read: while something is in flight (a round of about 2 s is
# timed to within this), and while nothing is.
_BUSY_S = 0.1
_IDLE_S = 1.0
_PROBE_TIMEOUT_S = 30.0  # a probe still unanswered counts as waiting as long as it has


@dataclass(slots=True)
class _Paced:
    incarnation: str
    # Its size is the window last set: a consumer with another was set by someone else.
    pace: Window


class Windows:
    """Sizes the windows of `streams`. As each round begins it times a request to the hub
    (the info of the device's command stream, as the clock check reads it), which queues
    behind the window just sent, like the device's own requests."""

    def __init__(self, nc: Client, rtt: LeafRtt, config: Config, streams: tuple[str, ...]) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.rtt = rtt
        self.config = config
        self.streams = streams
        self._paced: dict[str, _Paced] = {}
        self._probe_subject = (
            f"{config.hub.api_prefix}.STREAM.INFO.{command_stream(config.device_id)}"
        )
        self._probe: asyncio.Task[None] | None = None
        self._probe_sent = 0.0
        self._queued: float | None = None

    async def run(self) -> None:
        try:
            while True:
                await self.rtt.read()
                busy = False
                for stream in self.streams:
                    try:
                        busy = await self._step(stream) or busy
                    except NotFoundError:  # the stream or its consumer is being made again
                        self._paced.pop(stream, None)
                    except (APIError, nats.errors.Error, TimeoutError) as exc:
                        log.warning("uplink_window_unread", stream=stream, error=repr(exc))
                await asyncio.sleep(_BUSY_S if busy else _IDLE_S)
        finally:
            if self._probe is not None:
                self._probe.cancel()

    async def _step(self, stream: str) -> bool:
        """Observe `stream`'s hub consumer, and set its window if the pace says so; whether
        anything was in flight or waiting."""
        if stream not in self._paced:
            incarnation = incarnation_of(await self.js.stream_info(stream)) or ""
            self._paced[stream] = _Paced(incarnation, Window(0, MIRROR_WINDOW))
        paced = self._paced[stream]
        info = await self.js.consumer_info(stream, hub_consumer(paced.incarnation))
        window = info.config.max_ack_pending or 1
        if window != paced.pace.size:  # first read, or a reconcile started it again
            paced.pace = Window(window, MIRROR_WINDOW)
        floor, in_flight = info.ack_floor.stream_seq, info.num_ack_pending
        paced.pace.rtt, paced.pace.queued = self.rtt.seconds, self._waited()
        ended = paced.pace.observe(floor, in_flight, window, time.monotonic())
        if paced.pace.size != window:
            config = hub_consumer_config(self.config, stream, paced.incarnation)
            config.max_ack_pending = paced.pace.size
            await self.js.add_consumer(stream, config)
            log.info("uplink_window_set", stream=stream, window=paced.pace.size, was=window)
        if ended and in_flight >= window:  # a whole window was just sent: time what waits
            self._send_probe()
        return bool(in_flight or info.num_pending)

    def _waited(self) -> float | None:
        """What the last probe waited more than a round trip (one still out: so far)."""
        queued = self._queued
        if self._probe is not None and not self._probe.done():
            so_far = time.monotonic() - self._probe_sent - self.rtt.seconds
            queued = so_far if queued is None else max(queued, so_far)
        return queued

    def _send_probe(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe_sent = time.monotonic()
            self._probe = asyncio.create_task(self._time_probe(self._probe_sent))

    async def _time_probe(self, sent: float) -> None:
        try:
            await self.nc.request(self._probe_subject, b"", timeout=_PROBE_TIMEOUT_S)
        except (nats.errors.Error, TimeoutError) as exc:
            log.debug("uplink_probe_failed", error=repr(exc))
            return
        self._queued = max(time.monotonic() - sent - self.rtt.seconds, 0.0)
