"""Unsticks the consumers the hub's mirrors read the device's streams through.

Such a consumer acknowledges by flow control: it sends a window, then waits for the hub's
reply, which acknowledges what the mirror holds. nats-server can deadlock it for good: after
a reset the mirror did not see (the island's at each start; a restart of a second or two goes
unnoticed), the mirror's reply, counting deliveries from before the reset, raises the
consumer's acknowledgement floor above what it has delivered since; every later reply then
looks old and is ignored, the window stays full, and the idle heartbeats tell the mirror all
is well. Seen under load in the power-cut test: the mirror at lag 0, a few
packs short of the island, for minutes, with the link up.

So while the link is up, each such consumer with something unacknowledged is watched; one
whose delivered and acknowledged positions have not moved for ``agent.uplink_stall_after``
(60 s), or for 10 s with its floor's delivery count above its delivered one (the deadlock's
own mark), is made to be bound again. A reset from the island would not do: the bound mirror
keeps its count, and the next window sticks the same way. Nor can its deliveries be moved
elsewhere while the mirror listens. So the consumer is deleted; the mirror, hearing nothing
(not even heartbeats), gives it up after 10-20 s and asks for it again every 10 s or so; the
consumer is then made again as it was, at the floor it had, and the mirror binds to it afresh
(its own count at zero) and takes what it lacks from the floor on. Nothing is lost: what the
consumer has not had acknowledged stays in the stream. A round of the uplink takes about 2 s
by design (`edge_agent.island.pace`), far from a minute. Each such rebinding is logged and
counted in ``uplink.json`` under the state directory, for ``status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats.errors
import structlog
from nats.aio.client import Client
from nats.js.api import ConsumerInfo
from nats.js.errors import APIError, NotFoundError

from edge_agent.core.config import Config
from edge_agent.island.link import LinkTracker
from edge_agent.island.streams import consumer_request, incarnations
from edge_agent.protocol.files import read_json, write_json
from edge_agent.protocol.names import hub_consumer
from edge_agent.protocol.units import utc_now_iso

log = structlog.get_logger(__name__)

_POLL_S = 5.0
# A mirror checks on its origin every 10 s, and gives up one it has not heard from in 10 s.
_GIVEN_UP_S = 25.0
# A floor above the delivered count that lasts this long, nothing moving, is no passing state.
_CERTAIN_S = 10.0


def uplink_path(config: Config) -> Path:
    """Where the agent counts the stuck uplink consumers it had bound afresh, for ``status``."""
    return config.agent.state_dir / "uplink.json"


def unstalled(config: Config) -> int:
    """How many times the agent has had a stuck uplink consumer bound afresh (ever)."""
    count = (read_json(uplink_path(config)) or {}).get("unstalled", 0)
    return count if isinstance(count, int) else 0


@dataclass(slots=True)
class _Seen:
    position: tuple[int, int]  # (delivered, acknowledged) stream sequences
    since: float  # monotonic: when it was first seen there


class Unstaller:
    """Watches each outbound stream's hub consumer while the link is up (see the module)."""

    def __init__(self, nc: Client, config: Config, link: LinkTracker) -> None:
        self.nc, self.config, self.link = nc, config, link
        self.js = nc.jetstream()
        self._seen: dict[str, _Seen] = {}
        # Consumers deleted to be made again (their config and floor) until they are: one
        # whose making failed is tried again at each round, never left deleted.
        self._unmade: dict[str, tuple[ConsumerInfo, int]] = {}

    async def run(self) -> None:
        while True:
            await self.link.is_up.wait()
            try:
                for stream, (info, floor) in list(self._unmade.items()):
                    await self._make_again(stream, info, floor)
                for stream, incarnation in (await incarnations(self.js)).items():
                    if incarnation is not None:
                        await self._check(stream, hub_consumer(incarnation), time.monotonic())
            except (APIError, nats.errors.Error, TimeoutError) as exc:
                log.warning("uplink_watch_failed", error=str(exc))
            await asyncio.sleep(min(_POLL_S, self.config.agent.uplink_stall_after / 4))

    async def _check(self, stream: str, consumer: str, now: float) -> None:
        try:
            info = await self.js.consumer_info(stream, consumer)
        except NotFoundError:  # being made again
            self._seen.pop(stream, None)
            return
        position = (info.delivered.stream_seq, info.ack_floor.stream_seq)
        seen = self._seen.get(stream)
        if not info.num_ack_pending or not self.link.state.up:
            self._seen.pop(stream, None)
        elif seen is None or seen.position != position:
            self._seen[stream] = _Seen(position, now)
        elif now - seen.since >= self._stall_after(info):
            self._seen.pop(stream, None)
            log.warning(
                "uplink_stalled",
                stream=stream,
                delivered=info.delivered.stream_seq,
                delivered_consumer_seq=info.delivered.consumer_seq,
                ack_floor=info.ack_floor.stream_seq,
                ack_floor_consumer_seq=info.ack_floor.consumer_seq,
                unacknowledged=info.num_ack_pending,
                stalled_s=round(now - seen.since, 1),
            )
            await self._rebind(stream, info, position[1])
            log.warning("uplink_unstalled", stream=stream, took_s=round(time.monotonic() - now, 1))
            count = unstalled(self.config) + 1
            last = {"unstalled": count, "last_at": utc_now_iso()}
            write_json(uplink_path(self.config), last, durable=False)

    def _stall_after(self, info: ConsumerInfo) -> float:
        """How long `info`'s consumer may stand still: a floor above what it has delivered is
        the deadlock itself, certain once it has lasted `_CERTAIN_S`."""
        floor, delivered = info.ack_floor, info.delivered
        if floor and delivered and floor.consumer_seq > delivered.consumer_seq:
            return min(_CERTAIN_S, self.config.agent.uplink_stall_after)
        return self.config.agent.uplink_stall_after

    async def _rebind(self, stream: str, info: ConsumerInfo, floor: int) -> None:
        """Delete `info`'s consumer until its mirror has given it up, then make it again at
        `floor`, its acknowledgement floor (see the module). Made again even when cancelled
        midway: the agent's next start would otherwise make it from the first message on."""
        self._unmade[stream] = (info, floor)
        await self.js.delete_consumer(stream, info.name)
        try:
            await asyncio.sleep(_GIVEN_UP_S)
        finally:
            # Should it fail, the next round tries again (`run`); at shutdown, the next start.
            with contextlib.suppress(APIError, nats.errors.Error, TimeoutError):
                await self._make_again(stream, info, floor)

    async def _make_again(self, stream: str, info: ConsumerInfo, floor: int) -> None:
        # Paused while it is moved to its floor: it would start from the first message.
        until = datetime.now(UTC) + timedelta(minutes=5)
        await self.js.add_consumer(stream, replace(info.config, pause_until=until.isoformat()))
        await self._api("RESET", stream, info.name, {"seq": floor + 1})
        await self._api("PAUSE", stream, info.name, {})
        del self._unmade[stream]

    async def _api(self, verb: str, stream: str, consumer: str, body: dict[str, int]) -> None:
        if error := await consumer_request(
            self.nc, verb, stream, consumer, json.dumps(body).encode()
        ):
            raise APIError(code=error.get("code"), description=error.get("description"))


__all__ = ["Unstaller", "unstalled", "uplink_path"]
