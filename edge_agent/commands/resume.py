"""Fast resume: commands issued while the link was down start within a second of its return.

The island's ``COMMANDS`` mirror keeps the offline guarantee (commands keep arriving into
local storage and stay there), but after a cut of more than a few seconds nats-server 2.15
resumes a mirror only 10-40 s after the leaf link is back. So when the link comes up
(`LinkTracker`, from ``/leafz``) `FastResume` reads the mirror's origin, the hub's
``CMD_<id>``, itself through ``$JS.<hub-domain>.API`` direct gets, starting after the
mirror's last sequence, and hands each command to the `Executor`. It stops once
the mirror is live again (its last contact is recent, checked a few seconds after the link
came up) and holds everything read this way. The executor's ledger makes the mirror's later
copy of each command a no-op, so a command still runs at most once. After each catch-up,
and every 30 s while the link stays up, it checks that the origin is still the stream the
mirror copied (`edge_agent.commands.origin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import APIError, NotFoundError

from edge_agent.commands.executor import Executor
from edge_agent.commands.origin import rebuild_mirror, replaced_origin
from edge_agent.commands.parse import Incoming
from edge_agent.core.config import Config
from edge_agent.island.link import LinkTracker
from edge_agent.island.pace import ROUND_S
from edge_agent.protocol.names import COMMAND_MIRROR, command_stream

log = structlog.get_logger(__name__)

# A mirror that heard from the hub this recently is live (it gets heartbeats every second).
MIRROR_LIVE_S = 2.0
ORIGIN_CHECK_S = 30.0  # between checks that the origin was not replaced, while linked
POLL_S = 0.25  # between two reads of the origin that found nothing new
# A read of the origin goes up the link a backlog may fill: on a slow link it can queue behind
# a window of it (about `ROUND_S`, up to twice that: `edge_agent.island.pace`), so it waits
# READ_TIMEOUT_S for its answer (the reads' context's timeout), while the next ones are asked
# (`catch_up`). One lost in a cut holds a place in ASKS_IN_FLIGHT that long, not the reads.
# At most 4 a second of about 200 bytes: 6 kbit/s up the link while fast resume runs.
READ_TIMEOUT_S = 2 * ROUND_S + 1.0
ASKS_IN_FLIGHT = 8


@dataclass(frozen=True, slots=True)
class ResumeFigures:
    """What fast resume did after the link last came up (only the running agent knows)."""

    resumes: int
    last_duration_s: float | None
    last_commands: int
    mirror_rebuilds: int = 0  # the origin was replaced (`edge_agent.commands.origin`)


class FastResume:
    def __init__(
        self,
        config: Config,
        island: JetStreamContext,
        hub: JetStreamContext,
        link: LinkTracker,
        executor: Executor,
        *,
        poll_interval: float = POLL_S,
        settle: float = 3.0,
        reads: JetStreamContext | None = None,
    ) -> None:
        self._config = config
        self._origin = command_stream(config.device_id)
        self._island = island
        self._hub = hub
        self._reads = reads or hub  # the origin's reads: timeout `READ_TIMEOUT_S`
        self._link = link
        self._executor = executor
        self._poll_interval = poll_interval
        # Right after a short cut the mirror's last contact still looks recent although it
        # is stalled; only a contact seen this long after the link came back proves it live.
        self._settle = settle
        self.figures = ResumeFigures(0, None, 0)  # for the metrics file
        # The commands at or below the fence still to be read (see `catch_up`).
        self._fenced_unread = False

    async def run(self, *, island_was_fresh: bool) -> None:
        self._fenced_unread = island_was_fresh
        while not self._executor.stopping:
            await self._link.is_up.wait()
            await self.catch_up()
            # Checked after the catch-up, which it must not delay; and again every so often:
            # a hub node can lose the origin while this device's link (to another node) stays
            # up. A replaced origin is read again from its start.
            while not self._link.is_down.is_set() and not self._executor.stopping:
                if await self._origin_replaced():
                    await self.catch_up()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._link.is_down.wait(), ORIGIN_CHECK_S)

    async def catch_up(self) -> int:
        """Run what the hub has beyond the mirror, until the mirror is live; how many ran.

        The origin is read every `poll_interval`, a read not waiting for the one before to
        be answered (up to `ASKS_IN_FLIGHT` unanswered): on a slow link each may queue behind
        a window of the backlog, and a command that reaches the hub is then seen by the next
        read asked, not once the one in flight is back and another has gone up behind the
        next window (one read at a time, a command waited two windows: 4.7 s on the rural
        link, 5.8 s in CI with reads giving up after 2 s)."""
        started = time.monotonic()
        cursor = await self._start_cursor()
        ran = 0
        check_at = started + self._settle
        ask_at = started
        asks: set[asyncio.Task[tuple[int, RawStreamMsg | None]]] = set()
        try:
            while not self._link.is_down.is_set() and not self._executor.stopping:
                now = time.monotonic()
                if now >= ask_at and len(asks) < ASKS_IN_FLIGHT:
                    asks.add(asyncio.create_task(self._read(cursor)))
                    ask_at = now + self._poll_interval
                if not asks:
                    await asyncio.sleep(ask_at - now)
                    continue
                done, asks = await asyncio.wait(
                    asks, timeout=self._poll_interval, return_when=asyncio.FIRST_COMPLETED
                )
                nothing_new = False
                for asked_after, msg in _answers(done):
                    if msg is None:
                        nothing_new |= asked_after == cursor
                    elif msg.seq is not None and msg.seq > cursor:  # not one run already
                        if await self._executor.process(_incoming(msg)):
                            ran += 1
                        cursor = msg.seq
                        ask_at = time.monotonic()  # the next command at once
                if nothing_new and time.monotonic() - started >= self._settle:
                    live, check_at = await self._mirror_took_over(cursor, check_at)
                    if live:
                        break
        finally:
            for ask in asks:
                ask.cancel()
        if not self._link.is_down.is_set() and not self._executor.stopping:
            self._fenced_unread = False
        duration = round(time.monotonic() - started, 3)
        log.info("fast_resume_done", commands=ran, cursor=cursor, duration_s=duration)
        self.figures = ResumeFigures(
            self.figures.resumes + 1, duration, ran, self.figures.mirror_rebuilds
        )
        return ran

    async def _start_cursor(self) -> int:
        """The mirror's last command, after which the origin is read."""
        if self._fenced_unread and await self._executor.fence() > 0:
            # A re-imaged device's fresh mirror starts where its previous incarnation's
            # consumer had got to, so the commands at or below the fence may never reach it:
            # they are read here instead and answered "not run".
            return 0
        return await self._mirror_last_seq()

    async def _mirror_took_over(self, cursor: int, check_at: float) -> tuple[bool, float]:
        """Whether the mirror is live again; if not, and `check_at` is past, the origin is
        checked: (live, when to check the origin next)."""
        if await self._mirror_live(cursor):
            return True, check_at
        if time.monotonic() >= check_at:
            # A mirror bound to a consumer the origin does not have (a new island's, before it
            # learnt its own) is never live: checked once it is late, and again every so
            # often while it stays so.
            check_at = time.monotonic() + ORIGIN_CHECK_S
            await self._origin_replaced()
        return False, check_at

    async def _origin_replaced(self) -> bool:
        """Check that the origin is the one the mirror copied, and make the mirror again if
        it is not (`edge_agent.commands.origin`); whether it was made again."""
        try:
            replaced = await replaced_origin(self._island, self._hub, self._origin)
            if replaced is None:
                return False
            self._executor.mirror_remade()
            await rebuild_mirror(self._island, self._hub, self._config, replaced)
        except (nats.errors.Error, APIError, TimeoutError) as exc:
            log.debug("command_origin_unchecked", error=repr(exc))
            return False
        if not replaced.rebound:
            rebuilds = self.figures.mirror_rebuilds + 1
            self.figures = dataclasses.replace(self.figures, mirror_rebuilds=rebuilds)
        return True

    async def _read(self, cursor: int) -> tuple[int, RawStreamMsg | None]:
        """(`cursor`, the first command after it in the mirror's origin, if there is one)."""
        try:
            msg = await self._reads.get_msg(
                self._origin, cursor + 1, subject=">", next=True, direct=True
            )
        except NotFoundError:
            return cursor, None
        return cursor, msg

    async def _mirror_last_seq(self) -> int:
        try:
            return (await self._island.stream_info(COMMAND_MIRROR)).state.last_seq
        except (nats.errors.Error, APIError, TimeoutError):
            return 0

    async def _mirror_live(self, cursor: int) -> bool:
        try:
            info = await self._island.stream_info(COMMAND_MIRROR)
        except (nats.errors.Error, APIError, TimeoutError):
            return False
        active = info.mirror.active if info.mirror else None
        return (
            active is not None
            and 0 <= active < MIRROR_LIVE_S * 1e9
            and info.state.last_seq >= cursor
        )


def _answers(
    done: set[asyncio.Task[tuple[int, RawStreamMsg | None]]],
) -> list[tuple[int, RawStreamMsg | None]]:
    """The reads answered, in the order of the commands they found (none found: first); a
    read that failed is logged and left out (the next one is asked anyway)."""
    answers = []
    for ask in done:
        try:
            answers.append(ask.result())
        except (nats.errors.Error, APIError, TimeoutError) as exc:
            # The hub's API may not be reachable for a moment after the link comes up.
            log.debug("fast_resume_read_failed", error=repr(exc))
    return sorted(answers, key=lambda a: a[1].seq or 0 if a[1] else -1)


def _incoming(msg: RawStreamMsg) -> Incoming:
    assert msg.seq is not None and msg.subject is not None
    return Incoming(msg.seq, msg.subject, msg.data or b"", msg.headers or {}, "hub", msg.time)
