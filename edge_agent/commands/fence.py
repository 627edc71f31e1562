"""The command fence: which commands a re-imaged agent answers without running them.

At-most-once rests on the ledger. A device that is re-imaged (or whose agent state is lost)
starts with an empty ledger, while the hub still keeps commands the old incarnation ran (its
command mirror brings back those after the hub's consumer position, and fast resume,
`edge_agent.commands.resume`, reads the ones at or below the fence). So an agent with an
empty ledger runs no command until it knows its *fence*: commands at or below it in
``CMD_<id>`` are answered ``rejected`` ("issued before this incarnation, not run") and never
run.

- The hub sets the fence of each incarnation when it first sees it (`hub_ingest.fleet.watch`):
  0 for a device's first incarnation (a new device runs what was queued for it), else the
  last ``CMD_<id>`` sequence at that moment. It writes it into ``CMD_<id>``'s metadata
  (``fence.<incarnation>``), which the agent reads while the link is up.
- If the island's store survived (only the agent state was lost), everything already in the
  island's command mirror may have run too, and so may commands fast resume read from the hub
  before the mirror had them: the fence is at least that mirror's last sequence and the
  highest sequence answered in the island's ``EVENTS`` (no higher than ``CMD_<id>``'s last,
  so that a forged result cannot fence off commands not yet issued). A command that was
  running, or whose answer was still in the agent's outbox, when the state was lost, and that
  fast resume had read before the mirror, is not covered: it may run again.
- A ledger with history needs no fence (0): it knows what ran.

Once known, the fence is kept in the agent's SQLite file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import APIError

from edge_agent.core.errors import StateDBBusy
from edge_agent.core.statedb import FENCE_KEY, StateDB
from edge_agent.island.link import LinkTracker
from edge_agent.island.streams import incarnations
from edge_agent.protocol.names import (
    COMMAND_MIRROR,
    EVENTS,
    command_stream,
    fence_key,
    result_subject,
)

log = structlog.get_logger(__name__)

POLL_S = 1.0  # while the link is up and the hub has not set the fence yet
_BATCH = 500  # results read at a time from the island's EVENTS


class CommandFence:
    def __init__(self, db: StateDB, device_id: str) -> None:
        self._db = db
        self._origin = command_stream(device_id)
        self._results = result_subject(device_id)
        self._value: int | None = None
        self.known = asyncio.Event()

    @property
    def value(self) -> int:
        assert self._value is not None, "wait for `known` first"
        return self._value

    async def load(self) -> bool:
        """Take the stored fence, or 0 for a ledger with history; False if it must be learned."""
        rows = await self._db.fetchall("SELECT value FROM meta WHERE key = ?", (FENCE_KEY,))
        if rows:
            self._set(int(rows[0][0]))
        elif await self._db.fetchall("SELECT 1 FROM ledger LIMIT 1"):
            await self._store(0)
        return self.known.is_set()

    async def learn(
        self,
        island: JetStreamContext,
        hub: JetStreamContext,
        link: LinkTracker,
        island_was_fresh: bool,
    ) -> None:
        """Read this incarnation's fence from the hub (waiting for the link), and keep it."""
        mirrored = 0 if island_was_fresh else await _last_seq(island, COMMAND_MIRROR)
        answered = 0 if island_was_fresh else await _last_answered(island, self._results)
        incarnation = (await incarnations(island))[EVENTS]
        log.info(
            "command_fence_awaited",
            incarnation=incarnation,
            mirrored=mirrored,
            answered=answered,
        )
        while True:
            await link.is_up.wait()
            try:
                info = await hub.stream_info(self._origin)
            except (nats.errors.Error, APIError, TimeoutError) as exc:
                log.debug("command_fence_unreadable", error=repr(exc))
                await asyncio.sleep(POLL_S)
                continue
            metadata = info.config.metadata or {}
            hub_fence = metadata.get(fence_key(incarnation)) if incarnation else None
            if hub_fence is not None:
                local = max(mirrored, min(answered, info.state.last_seq))
                with contextlib.suppress(StateDBBusy):  # stored on the next poll
                    await self._store(max(int(hub_fence), local))
                    return
            await asyncio.sleep(POLL_S)

    async def _store(self, value: int) -> None:
        async with self._db.transaction() as conn:
            await conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (FENCE_KEY, str(value)))
        log.info("command_fence_set", fence=value)
        self._set(value)

    def _set(self, value: int) -> None:
        self._value = value
        self.known.set()


async def _last_seq(js: JetStreamContext, stream: str) -> int:
    return (await js.stream_info(stream)).state.last_seq


async def _last_answered(js: JetStreamContext, subject: str) -> int:
    """The highest command sequence answered on `subject` in the island's ``EVENTS``."""
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True, inactive_threshold=60.0)
    sub = await js.pull_subscribe(subject, stream=EVENTS, config=config)
    highest, name = 0, None
    try:
        info = await sub.consumer_info()
        name, pending = info.name, info.num_pending or 0
        while pending > 0:
            batch = await sub.fetch(min(pending, _BATCH), timeout=5.0)
            highest = max([highest, *(_answered_seq(m.data) for m in batch)])
            pending = batch[-1].metadata.num_pending or 0
    finally:
        await sub.unsubscribe()
        if name is not None:
            with contextlib.suppress(nats.errors.Error, APIError):
                await js.delete_consumer(EVENTS, name)
    return highest


def _answered_seq(data: bytes) -> int:
    with contextlib.suppress(ValueError, AttributeError):
        seq = json.loads(data).get("seq")
        if isinstance(seq, int):
            return seq
    return 0
