"""The packer: the island's ``READINGS`` packed into ``TELEMETRY``, what the hub mirrors.

It packs what the link is about to carry, not what arrives: while the hub's mirror has more
than `PACK_LEAD` packs still to take (the link is down or full), it waits, and the readings wait
in ``READINGS``; when the link drains them it packs the backlog in packs as large as the
link's pace allows (`edge_agent.island.pace`, from the hub's acknowledgements it polls
here). Over an idle link a reading crosses alone within `IDLE_S`.

Its cursor is ``TELEMETRY`` itself: the last pack's ``Edge-Pack`` header names the last
reading packed, and each pack is published expecting the stream's last sequence, so a
restart (or a second packer) can neither pack a reading twice nor skip one. With no pack
left (all aged out, and so every reading they held) it starts at the first reading there is.
Readings the budget removed from ``READINGS`` before they were packed are counted
(`skipped`, and the ``readings_skipped`` event).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DEFAULT_PREFIX, AckPolicy, ConsumerConfig, DeliverPolicy, Header, StreamInfo
from nats.js.errors import APIError, NotFoundError

from edge_agent.island.pace import Pace
from edge_agent.island.streams import PACK_LEAD, incarnation_of, last_packed
from edge_agent.protocol.monitor import LeafRtt
from edge_agent.protocol.names import TELEMETRY, hub_consumer
from edge_agent.protocol.pack import (
    PACK_SUBJECT,
    READINGS,
    Reading,
    encode,
)

log = structlog.get_logger(__name__)

PACK_READINGS = 1024  # at most, per pack (its bytes: `edge_agent.island.pace`)
IDLE_S = 0.2  # the longest a reading waits for the packer when nothing is queued
# How often the hub's progress is checked: while it moves, at most, while a round crosses
# (`edge_agent.island.pace` times it), and while it has not moved for `_STILL_S`.
_POLL_S = (0.05, 0.2, 1.0)
_STILL_S = 10.0
_RETRY_S = 1.0  # after an island error, before the packer starts again
_HEADERS = 256  # bytes of a pack's headers, at most, within the island's max_payload
_REQUEST_S = 10.0  # beyond its own expiry, the longest a batch request is waited for
_BATCH_ENDS = ("404", "408")  # no more readings now; the request expired


@dataclass(slots=True)
class PackerStats:
    packs: int = 0
    readings: int = 0
    skipped: int = 0  # removed from READINGS by its budget or max_age before being packed
    pack_bytes: int = 0  # what a pack may hold now, as the link's pace says


class Packer:
    def __init__(self, nc: Client, max_payload: int, rtt: LeafRtt) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.max_payload = max_payload
        self.rtt = rtt
        self.pace = Pace()
        self.stats = PackerStats(pack_bytes=self.pace.pack_bytes)
        self._held: list[Msg] = []  # fetched, not packed yet

    async def run(self) -> None:
        while True:
            try:
                await self._pack()
            except (APIError, nats.errors.Error, TimeoutError) as exc:
                log.warning("packer_restarting", error=repr(exc))
                await asyncio.sleep(_RETRY_S)

    async def _pack(self) -> None:
        """Pack from the cursor on, until the island fails."""
        info = await self.js.stream_info(TELEMETRY)
        consumer = hub_consumer(incarnation_of(info) or "")
        last, cursor = info.state.last_seq, await self._cursor(info)
        self._held = []
        async with _Batches(self.nc, self.js, cursor + 1) as batches:
            while True:
                await self._await_room(consumer)
                readings = await self._next(batches)
                if not readings:
                    continue
                if readings[0].seq > cursor + 1:
                    self._skipped(cursor, readings[0].seq)
                last = await self._publish(readings, last)
                cursor = readings[-1].seq

    async def _cursor(self, telemetry: StreamInfo) -> int:
        """The last reading packed; with no pack left, the one before the first there is."""
        if (last := await last_packed(self.js, telemetry)) is not None:
            return last
        return max((await self.js.stream_info(READINGS)).state.first_seq - 1, 0)

    async def _await_room(self, consumer: str) -> None:
        """Until the hub's mirror has at most `PACK_LEAD` packs left to take; asked often while
        it takes them, less and less often while it does not (a link down for hours)."""
        poll, before, still = _POLL_S[0], None, time.monotonic()
        while True:
            try:
                info = await self.js.consumer_info(TELEMETRY, consumer)
            except NotFoundError:
                pending = PACK_LEAD + 1  # not made yet: the reconcile is on its way
            else:
                pending = info.num_pending
                window = info.config.max_ack_pending or 1
                floor, in_flight = info.ack_floor.stream_seq, info.num_ack_pending
                self.pace.rtt = await self.rtt.read()
                self.pace.observe(floor, in_flight, window, time.monotonic())
                self.stats.pack_bytes = self.pace.pack_bytes
            if pending <= PACK_LEAD:
                return
            if pending != before:
                poll, before, still = _POLL_S[0], pending, time.monotonic()
            else:
                longest = _POLL_S[2] if time.monotonic() - still > _STILL_S else _POLL_S[1]
                poll = min(poll * 2, longest)
            await asyncio.sleep(poll)

    async def _next(self, batches: _Batches) -> list[Reading]:
        """The next pack's readings (none when nothing came within `IDLE_S`)."""
        if len(self._held) < PACK_READINGS:
            self._held += await batches.next(PACK_READINGS - len(self._held), IDLE_S)
        taken, size = 0, 0
        for msg in self._held:
            if taken and size + len(msg.data) > self.pace.pack_bytes:
                break
            taken, size = taken + 1, size + len(msg.data)
        chosen, self._held = self._held[:taken], self._held[taken:]
        return [_reading(m) for m in chosen]

    async def _publish(self, readings: list[Reading], last: int) -> int:
        body, headers = encode(readings)
        too_large = len(body) + _HEADERS > self.max_payload
        if too_large and len(readings) > 1:
            # Over the island's max_payload (set below a full pack, or the index and headers
            # pushed it over): two packs. Only a reading too large alone is left out.
            half = len(readings) // 2
            last = await self._publish(readings[:half], last)
            return await self._publish(readings[half:], last)
        if too_large:
            log.error("reading_too_large_to_pack", seq=readings[0].seq, bytes=len(body))
            self.stats.skipped += 1
            return last
        headers["Nats-Expected-Last-Sequence"] = str(last)
        ack = await self.js.publish(PACK_SUBJECT, body, stream=TELEMETRY, headers=headers)
        self.pace.sent(ack.seq, len(body), cut=bool(self._held))
        self.stats.packs += 1
        self.stats.readings += len(readings)
        return ack.seq

    def _skipped(self, cursor: int, first: int) -> None:
        self.stats.skipped += first - cursor - 1
        log.warning("readings_skipped", first=cursor + 1, last=first - 1, reason="budget")


class _Batches:
    """``READINGS`` from `start` on, read in batches through an ephemeral pull consumer into
    a subscription's callback: nats-py's `fetch` awaits each message with a timeout of its
    own, and took 13,000 readings/s here where a callback takes 113,000, while a compressed
    LTE link carries more than 10,000 readings/s in packs."""

    def __init__(self, nc: Client, js: JetStreamContext, start: int) -> None:
        self.nc, self.js, self.start = nc, js, start
        self._inbox = nc.new_inbox()
        self._got: list[Msg] = []
        self._wanted = 0
        self._done = asyncio.Event()
        self._failed: nats.errors.Error | None = None

    async def __aenter__(self) -> _Batches:
        self._sub = await self.nc.subscribe(self._inbox, cb=self._on_msg)
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.start,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=60.0,
        )
        info = await self.js.add_consumer(READINGS, config)
        self._next_subject = f"{DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{READINGS}.{info.name}"
        return self

    async def __aexit__(self, *_: object) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()

    async def next(self, most: int, wait: float) -> list[Msg]:
        """Up to `most` readings: `most` as soon as they are there, else those within `wait`.
        One request at a time: each ends in `most` readings or a status, and a request that
        is not answered raises TimeoutError, ending this reader."""
        self._got, self._wanted = [], most
        self._done.clear()
        request = {"batch": most, "expires": int(wait * 1e9)}
        await self.nc.publish(self._next_subject, json.dumps(request).encode(), reply=self._inbox)
        await asyncio.wait_for(self._done.wait(), wait + _REQUEST_S)
        if self._failed is not None:
            raise self._failed
        return self._got

    async def _on_msg(self, msg: Msg) -> None:
        if status := (msg.headers or {}).get(Header.STATUS):
            if status not in _BATCH_ENDS:  # 503: no responders (the consumer is gone), …
                self._failed = nats.errors.Error(f"reading READINGS: status {status}")
            self._done.set()
            return
        self._got.append(msg)
        if len(self._got) >= self._wanted:
            self._done.set()


def _reading(msg: Msg) -> Reading:
    # $JS.ACK.<stream>.<consumer>.<delivered>.<seq>.<consumer seq>.<time ns>.<pending>, or
    # that with domain and account hash after ACK (and a token at the end).
    tokens = msg.reply.split(".")
    seq, time_ns = (tokens[5], tokens[7]) if len(tokens) == 9 else (tokens[7], tokens[9])
    headers = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
    if msg.headers and "Nats-Msg-Id" in msg.headers:
        headers["Nats-Msg-Id"] = msg.headers["Nats-Msg-Id"]
    return Reading(
        seq=int(seq),
        time_ns=int(time_ns),
        subject=msg.subject,
        data=msg.data,
        headers=headers,
    )
