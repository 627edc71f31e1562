"""The outbox's drainer: publishes rows to the island in batches with ``Nats-Msg-Id`` =
``<file instance>-<row id>`` and deletes a row only after its PubAck; a row the island refuses
for a reason waiting cannot fix goes to the dead letters (`edge_agent.outbox.store`)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential_jitter

from edge_agent.core.errors import DrainBlocked, StateDBBusy, is_retriable
from edge_agent.outbox.store import Outbox, Row

log = structlog.get_logger(__name__)

# JetStream's "message size exceeds maximum allowed": waiting never fixes it.
_PERMANENT_CODES = frozenset({10054})

_Batch = tuple[list[Row], list["asyncio.Future[PubAck]"]]


def _permanent(error: BaseException) -> bool:
    """A refusal that waiting cannot fix: the row goes to the dead letters."""
    if isinstance(error, nats.errors.MaxPayloadError):
        return True
    return isinstance(error, APIError) and error.err_code in _PERMANENT_CODES


class Drainer:
    """Publishes outbox rows to the island and deletes them once acknowledged."""

    def __init__(
        self,
        outbox: Outbox,
        js: JetStreamContext,
        *,
        batch: int = 1024,
        ack_timeout: float = 5.0,
        poll_interval: float = 0.2,
    ) -> None:
        self.outbox = outbox
        self._js = js
        self._batch = batch
        self._ack_timeout = ack_timeout
        # Other processes (``edge-agent publish``) append without telling us: poll for them.
        self._poll_interval = poll_interval
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        """Drain forever: at once after an append, else every poll interval."""
        while True:
            self.outbox.added.clear()  # before draining: an append during the drain counts
            retrying = AsyncRetrying(
                retry=retry_if_exception(is_retriable),
                wait=wait_exponential_jitter(multiplier=0.1, max=5.0, jitter=0.2),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    try:
                        await self.drain()
                    except DrainBlocked as exc:
                        log.warning("outbox_drain_blocked", reason=str(exc))
                        raise
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.outbox.added.wait(), self._poll_interval)

    async def drain(self, deadline: float | None = None) -> int:
        """Send batches until the outbox is empty (or, with a monotonic `deadline`, until it
        passes: rows keep coming while scripts publish); returns how many rows went out.

        Pipelined: the next batch is published while the previous one's PubAcks arrive and
        its rows are deleted. On any failure the unsettled batch's rows simply stay; sent
        again later, the island drops the copies it already has by their Nats-Msg-Id.
        """
        sent = 0
        async with self._lock:
            after = 0
            inflight: _Batch | None = None
            published: _Batch | None = None
            try:
                while True:
                    late = deadline is not None and time.monotonic() >= deadline
                    rows = [] if late else await self.outbox.batch(self._batch, after)
                    published = None
                    if rows:
                        after = rows[-1].id
                        published = await self._publish(rows)
                    if inflight is not None:
                        sent += await self._settle(*inflight)
                    inflight = published
                    if inflight is None:
                        break
            finally:
                for batch in (inflight, published):
                    for future in batch[1] if batch else []:
                        future.cancel()  # no-op once settled
        if sent:
            log.info("outbox_drained", rows=sent)
        return sent

    async def flush(self, timeout: float) -> bool:
        """Drain until empty or `timeout`; True when nothing is left (shutdown uses this)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self.drain(deadline)
            except (DrainBlocked, StateDBBusy) as exc:
                if time.monotonic() >= deadline:
                    log.warning("outbox_not_flushed", reason=str(exc))
                    return False
                await asyncio.sleep(0.1)
                continue
            left = (await self.outbox.stats()).depth
            if left == 0 or time.monotonic() >= deadline:
                if left:
                    log.warning("outbox_not_flushed", reason=f"{left} rows left at the deadline")
                return left == 0

    async def _publish(self, rows: list[Row]) -> _Batch:
        """Publish `rows`; the ones handed to the island and their PubAck futures."""
        sent: list[Row] = []
        futures: list[asyncio.Future[PubAck]] = []
        try:
            for row in rows:
                headers = {**row.headers, "Nats-Msg-Id": self.outbox.msg_id(row.id)}
                try:
                    future = await self._js.publish_async(row.subject, row.data, headers=headers)
                except nats.errors.MaxPayloadError as exc:
                    await self.outbox.dead_letter(row, f"larger than the island takes: {exc}")
                    continue
                sent.append(row)
                futures.append(future)
        except (nats.errors.Error, OSError) as exc:
            for future in futures:
                future.cancel()
            raise DrainBlocked(
                f"cannot publish to the island: {exc or type(exc).__name__}"
            ) from exc
        return sent, futures

    async def _settle(self, rows: list[Row], futures: list[asyncio.Future[PubAck]]) -> int:
        """Wait for the PubAcks of `rows`, delete the acknowledged ones; how many."""
        if not futures:
            return 0  # every row of the batch went to the dead letters
        _, pending = await asyncio.wait(futures, timeout=self._ack_timeout)
        for future in pending:
            future.cancel()
        acked = []
        dead = 0
        failure: BaseException | None = None
        for row, future in zip(rows, futures, strict=True):
            if future.cancelled():
                # Ask again, until one row fails: a down island would make every probe wait.
                error = TimeoutError("no PubAck in time") if failure else await self._probe(row)
            else:
                error = future.exception()
            if error is None:
                acked.append(row.id)
            elif _permanent(error):
                await self.outbox.dead_letter(row, f"refused by the island: {error}")
                dead += 1
            else:
                failure = failure or error
        if acked:
            await self.outbox.remove(acked)
        if failure is not None:
            reason = str(failure) or type(failure).__name__
            raise DrainBlocked(
                f"{len(rows) - len(acked) - dead} of {len(rows)} rows not stored by the island: "
                f"{reason}"
            )
        return len(acked)

    async def _probe(self, row: Row) -> BaseException | None:
        """Send one row whose PubAck did not come, and wait for its answer; the error if any.

        nats-py 2.16 never completes a `publish_async` future whose PubAck is an error (its
        reply handler raises instead), so a refused row would look like a slow island forever.
        The island drops the copy of a row it did store, by its Nats-Msg-Id.
        """
        headers = {**row.headers, "Nats-Msg-Id": self.outbox.msg_id(row.id)}
        try:
            await self._js.publish(
                row.subject, row.data, timeout=self._ack_timeout, headers=headers
            )
        except (nats.errors.Error, APIError, TimeoutError) as exc:
            return exc
        return None
