"""Gaps heal themselves: what a hub mirror skipped is read again from the island, once.

nats-server lets a hub mirror skip a range of a device's sequences for good: a mirror that
binds takes the island consumer's acknowledgement floor as what it holds, so a hub that lost
a tail to a power cut, or a cluster's new mirror leader below that floor, records the range
as *deleted* and never asks for it again. The island still holds it, so the hub refills it:

- **detect**: `Refiller.tick` lists every mirror's state (one paged ``STREAM.LIST``); a
  mirror whose deleted count or range changed, or that has a pending gap and whose device is
  linked now, is looked at (``STREAM.INFO`` with ``deleted_details``);
- **refill**: each deleted sequence that is neither refilled nor lost yet is read from the
  island across the leaf (batched direct gets through ``$JS.<device-domain>.API``, a bounded
  batch at a time, answered on the device's own reply prefix) and published into
  ``FLEET_REFILL`` on ``refill.<aggregate>.<mirror>.<seq>.<device>.<subject>`` with
  ``Nats-Expected-Last-Subject-Sequence: 0``: one subject per ``(mirror, seq)``, which the
  server accepts once, however many watchers (one per cluster node) or restarts try.
  Each aggregate sources ``FLEET_REFILL`` with the transform ``refill.<aggregate>.*.*.>`` →
  ``fleet.>``, so a refilled reading reaches the aggregate as ``fleet.<device>.<subject>``
  like every other, for the ingest and any other hub consumer;
- **a mirror made again** (its node lost its store) starts, empty, at the island consumer's
  floor: what the aggregate lacks below it is refilled too (its ``head`` in ``FLEET_GAPS``);
- **rows deleted from an aggregate by hand** (its sources have moved past them) are found
  through the mirrors that still hold them and put back through ``FLEET_REFILL`` the same way;
- **never twice**: a sequence the mirror lost but the aggregate still holds (a hub power cut
  takes each stream's unsynced tail separately) is found in the aggregate and not refilled;
- **count the rest**: a sequence the island no longer holds is lost, with its reason
  (``evicted``: below the island's first sequence, its budget or age took it;
  ``reimaged``: the island runs another incarnation; ``deleted_on_device``: inside the
  island's range but gone). A gap whose island does not answer is *pending*, with the time it
  was first seen. Per mirror, the figures live in the ``FLEET_GAPS`` bucket, which `report`
  reads.

A refilled message carries ``Edge-Refill-Of: <mirror> <device seq> <subject> <device store
time>``; the app's ``Nats-Msg-Id`` travels as ``Edge-Refill-Msg-Id`` (the hub's streams would
otherwise de-duplicate it against another device's message with the same id).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import APIError
from nats.js.kv import KeyValue

from edge_agent.protocol.names import INCARNATION, hub_consumer, js_api
from edge_agent.protocol.units import utc_now_iso
from hub_ingest.core.buckets import open_bucket
from hub_ingest.core.config import HubConfig
from hub_ingest.core.gather import gather_bounded
from hub_ingest.fleet.aggregate_rows import in_aggregate, sourced_all, sourced_below, sourced_row
from hub_ingest.fleet.gaps import (
    BUCKET,
    MSG_ID_HEADER,
    REFILL_HEADER,
    MirrorGaps,
    Target,
    expand,
    own_headers,
    read_record,
    refill_subject,
    refilled_seqs,
    to_ranges,
)
from hub_ingest.fleet.requests import (
    Listed,
    ask_json,
    deleted_seqs,
    island_stream,
    read_range,
    stream_states,
)

log = structlog.get_logger(__name__)


# Messages per direct get from an island, and gets in flight: on a 2 Mbit/s, 100 ms link two
# batches of 256 readings keep the link busy while the round trips overlap, and leave gaps
# in which live traffic and commands get through.
BATCH = 256
WINDOW = 2
BATCH_BYTES = 1 << 20
ASK_TIMEOUT = 2.0  # for the island's stream info: an offline island costs this
READ_TIMEOUT = 10.0  # between two messages of a batch, on the slowest links
TAIL_S = 30.0  # a linked device's mirror tail is compared with its island's floor this often
RETRY_S = 30.0  # a pending gap is tried again this often even if its device is not linked here
CONCURRENT = 8  # mirrors healed at once (an offline island costs a timeout)
_WRONG_LAST_SEQUENCE = 10071  # the subject has a message: this sequence was refilled before


@dataclass
class Refiller:
    """Finds what hub mirrors skipped and refills it from the islands; `watch` runs it."""

    js: JetStreamContext
    nc: Client
    config: HubConfig
    interval: float = 2.0
    # mirror → (first, last, deleted) when last looked at: an unchanged mirror is not asked
    seen: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    # mirrors whose island did not answer → when it was last asked (monotonic)
    pending: dict[str, float] = field(default_factory=dict)
    # aggregate → its deleted sequences whose rows were put back (or were nobody's)
    aggregate_done: dict[str, set[int]] = field(default_factory=dict)
    # mirror → when its tail was last compared with the island consumer's floor (monotonic)
    tail_checked: dict[str, float] = field(default_factory=dict)
    # mirror → its first sequence when its head was last checked
    heads: dict[str, int] = field(default_factory=dict)
    _linked: set[str] = field(default_factory=set)
    _kv: KeyValue | None = None
    _next: float = 0.0

    @property
    def api(self) -> str:
        return js_api(self.config.nats.domain)

    async def tick(self, mirrors: Mapping[str, Target], linked: set[str]) -> None:
        """Look at every mirror whose skipped range changed, and at those with a gap pending
        whose device has linked here (`linked`: device ids) or that were last tried over
        `RETRY_S` ago (the device may be linked to another node); at most every `interval`
        seconds."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        if self._kv is None:
            self._kv = await open_bucket(self.js, BUCKET, replicas=self.config.replicas)
        aggregates = {t.aggregate for t in mirrors.values()}
        listed = await stream_states(self.js, set(mirrors) | aggregates)
        states = {name: s.range for name, s in listed.items() if s.deleted}
        await self._heal_aggregates(
            {name: s for name, s in states.items() if name in aggregates}, mirrors
        )
        await self._check_heads({n: s for n, s in listed.items() if n in mirrors}, mirrors)
        due = []
        for name, target in mirrors.items():
            state = states.get(name)
            tried = self.pending.get(name)
            retry = tried is not None and (
                target.device.device_id in linked or now - tried >= RETRY_S
            )
            if (state is not None and self.seen.get(name) != state) or retry:
                due.append((name, state))

        async def heal(name: str, state: tuple[int, int, int] | None) -> None:
            await self.heal(mirrors[name])
            if state is not None:
                self.seen[name] = state

        await gather_bounded((heal(name, state) for name, state in due), CONCURRENT)
        await self._check_tails(mirrors, linked, now)

    async def _check_heads(
        self, listed: Mapping[str, Listed], mirrors: Mapping[str, Target]
    ) -> None:
        """A mirror made again (its node lost its store, or it was deleted and provisioned
        anew) binds at the island consumer's floor and starts there, empty: what the old one
        held but the aggregate had not sourced yet shows nowhere as deleted. Each time a
        mirror's first sequence moves other than by its own limits, the rows the aggregate
        has from below it are compared with it, and what lies between is refilled."""
        due = [
            (mirrors[name], state.first)
            for name, state in listed.items()
            if state.first > max(self.heads.get(name, 1), 1)
            and not state.near_limits(self.config.aggregates)
        ]

        async def check(target: Target, first: int) -> None:
            record = await self._record(target)
            if record.head != first:
                await self._check_head(target, first)
            self.heads[target.mirror] = first

        await gather_bounded((check(target, first) for target, first in due), CONCURRENT)

    async def _check_head(self, target: Target, first: int) -> None:
        below = await sourced_below(self.js, self.nc, self.api, target, first)
        aggregate_first = (await self.js.stream_info(target.aggregate)).state.first_seq
        if below is None and aggregate_first > 1:
            # The mirror's earlier rows may have aged out of the aggregate; only the
            # archive could tell them from skipped ones.
            log.warning("mirror_head_unknown", mirror=target.mirror, first=first)
            skipped: set[int] = set()
        else:
            skipped = set(range((below or 0) + 1, first))
        if skipped:
            log.warning(
                "mirror_head_skipped", mirror=target.mirror, first=min(skipped), last=first - 1
            )
        await self.heal(target, skipped, head=first)

    async def _check_tails(
        self, mirrors: Mapping[str, Target], linked: set[str], now: float
    ) -> None:
        """A skip at a mirror's tail shows no deleted sequence until the device publishes
        again: compare the tail of each linked device's mirrors with its island consumer's
        floor, when the device links and every `TAIL_S` after."""
        for name, target in mirrors.items():
            if target.device.device_id in linked - self._linked:
                self.tail_checked.pop(name, None)
        self._linked = set(linked)
        due = [
            target
            for name, target in mirrors.items()
            if target.device.device_id in linked
            and now - self.tail_checked.get(name, now - TAIL_S) >= TAIL_S
        ]

        async def check(target: Target) -> None:
            await self._check_tail(target)
            self.tail_checked[target.mirror] = time.monotonic()

        await gather_bounded((check(target) for target in due), CONCURRENT)

    async def _check_tail(self, target: Target) -> None:
        """Refill what lies between the mirror's last sequence and the island consumer's
        acknowledgement floor. The floor moves only on the hub's acknowledgement, sent once the
        hub has stored a message, so a floor above the mirror's last sequence (read after the
        floor) is a range the mirror will never be sent.

        A consumer that delivers again what the mirror holds (below its last sequence, read
        before the consumer) is moved past it. Made again from its first message (its agent
        killed while it had it deleted to be bound afresh), or its floor lost, it would stick
        for good: the mirror ignores what it holds, and answers each window with its own last
        sequence, which the consumer takes as its floor once and then ignores as old."""
        api = f"{target.device.api_prefix}.CONSUMER.%s.{target.incarnation.stream}."
        api += hub_consumer(target.incarnation.id)
        island = functools.partial(ask_json, self.nc, target.device, timeout=ASK_TIMEOUT)
        before = (await self.js.stream_info(target.mirror)).state.last_seq
        try:
            info = await island(api % "INFO")
            delivered = int(((info.get("delivered") or {}).get("stream_seq")) or 0)
            if delivered < before and "error" not in info:  # not one being made again
                moved = await island(api % "RESET", {"seq": before + 1})
                what = {"delivered": delivered, "to": before + 1, "error": moved.get("error")}
                log.warning("island_consumer_advanced", mirror=target.mirror, **what)
        except (nats.errors.Error, TimeoutError, ValueError):
            return  # the island did not answer: tried again later
        floor = int(((info.get("ack_floor") or {}).get("stream_seq")) or 0)
        last = (await self.js.stream_info(target.mirror)).state.last_seq
        record = await self._record(target)
        known = expand(record.kept).union(*(expand(r) for r in record.lost.values()))
        tail = set(range(last + 1, floor + 1)) - known
        tail -= await refilled_seqs(self.js, target.mirror)
        if tail:
            log.warning("mirror_tail_skipped", mirror=target.mirror, first=min(tail), last=floor)
            await self.heal(target, tail)

    async def heal(
        self, target: Target, tail: set[int] | None = None, *, head: int | None = None
    ) -> MirrorGaps:
        """Refill what `target`'s mirror skipped, what is still pending, and the sequences
        of a skipped `tail` or head; record (with the mirror's `head` when it was checked)
        and return what became of it."""
        assert self._kv is not None
        before = await self._record(target)
        deleted = await deleted_seqs(self.nc, self.api, target.mirror) | (tail or set())
        deleted |= expand(before.pending)
        done = await refilled_seqs(self.js, target.mirror)
        lost = {reason: expand(r) for reason, r in before.lost.items()}
        kept = expand(before.kept)
        todo = sorted(deleted - done - kept - set().union(set(), *lost.values()))
        pending: list[int] = []
        if todo:
            kept |= await in_aggregate(self.js, self.nc, self.api, target, todo)
            todo = [s for s in todo if s not in kept]
        if todo:
            stream = target.incarnation.stream
            island = await island_stream(self.nc, target.device, stream, timeout=ASK_TIMEOUT)
            if island is None:
                pending = todo
            else:
                try:
                    refilled, gone = await self._refill(target, todo, island)
                except (nats.errors.Error, TimeoutError, ValueError, KeyError) as exc:
                    # Its stream's info came, a read did not (the link dropped, a status, an
                    # answer without a direct get's headers): pending, tried again like an
                    # island that did not answer, and no other mirror's heal waits for it.
                    log.warning("island_read_failed", mirror=target.mirror, error=repr(exc))
                    pending = todo
                else:
                    done |= refilled
                    for reason, seqs in gone.items():
                        lost.setdefault(reason, set()).update(seqs)
        gaps = MirrorGaps(
            mirror=target.mirror,
            device_id=target.device.device_id,
            incarnation=target.incarnation.id,
            device_stream=target.incarnation.stream,
            refilled=len(done),
            kept=to_ranges(kept),
            lost={reason: to_ranges(seqs) for reason, seqs in sorted(lost.items()) if seqs},
            pending=to_ranges(pending),
            pending_since=(before.pending_since or utc_now_iso()) if pending else None,
            checked_at=utc_now_iso(),
            head=before.head if head is None else head,
        )
        if pending:
            self.pending[target.mirror] = time.monotonic()
        else:
            self.pending.pop(target.mirror, None)
        if dataclasses.replace(gaps, checked_at=before.checked_at) != before:
            await self._kv.put(target.mirror, gaps.to_json())
            log.info(
                "mirror_gap_checked",
                mirror=target.mirror,
                device_id=target.device.device_id,
                refilled=gaps.refilled,
                in_aggregate=gaps.in_aggregate,
                lost=gaps.lost_counts(),
                pending=gaps.pending_count,
            )
        return gaps

    async def _heal_aggregates(
        self, states: Mapping[str, tuple[int, int, int]], mirrors: Mapping[str, Target]
    ) -> None:
        """Put back what was deleted from an aggregate by hand while its mirrors still hold it
        (the aggregate's sources have moved past it and would never bring it again)."""
        for aggregate, (first, _, count) in states.items():
            done = self.aggregate_done.get(aggregate, set())
            if count == len({s for s in done if s >= first}):
                continue
            deleted = await deleted_seqs(self.nc, self.api, aggregate)
            settled = True
            for target in (t for t in mirrors.values() if t.aggregate == aggregate):
                for span in to_ranges(deleted - done):
                    settled &= await self._reroute(target, span, first)
            if settled:
                self.aggregate_done[aggregate] = deleted

    async def _reroute(self, target: Target, span: tuple[int, int], aggregate_first: int) -> bool:
        """Publish into FLEET_REFILL, from the hub's mirror, the rows of `target` that were in
        the aggregate's deleted `span`; False when that cannot be told yet (the mirror's rows
        after the span have not reached the aggregate)."""
        first, last = span
        before = await sourced_row(self.nc, self.api, target, first, before=True)
        after = await sourced_row(self.nc, self.api, target, last + 1)
        mirror = await self.js.stream_info(target.mirror)
        if before is None and aggregate_first > 1:
            # The mirror's rows before the span may have aged out of the aggregate, and would
            # be told from the deleted ones only by the archive: put nothing back.
            log.warning("aggregate_rows_unknown", aggregate=target.aggregate, mirror=target.mirror)
            return True
        low = before + 1 if before is not None else mirror.state.first_seq
        if after is None:
            if low > mirror.state.last_seq:
                return True  # nothing of this mirror came after the rows before the span
            if not await sourced_all(self.nc, self.api, target):
                return False
            high = mirror.state.last_seq
        else:
            high = after - 1
        if low > high:
            return True
        skipped = await deleted_seqs(self.nc, self.api, target.mirror)
        todo = set(range(low, high + 1)) - skipped - await refilled_seqs(self.js, target.mirror)
        todo -= await in_aggregate(self.js, self.nc, self.api, target, sorted(todo))
        source = f"{self.api}.DIRECT.GET.{target.mirror}"
        for lo, hi in to_ranges(todo):
            for msg in await self._read(target, lo, hi, source):
                await self._publish(target, msg)
        if todo:
            log.warning(
                "aggregate_rows_put_back",
                aggregate=target.aggregate,
                mirror=target.mirror,
                device_id=target.device.device_id,
                rows=len(todo),
            )
            await self.heal(target)  # records the new refilled count
        return True

    async def _record(self, target: Target) -> MirrorGaps:
        assert self._kv is not None
        return await read_record(self._kv, target)

    async def _refill(
        self, target: Target, todo: list[int], island: Mapping[str, Any]
    ) -> tuple[set[int], dict[str, set[int]]]:
        """Read `todo` from the island and publish it into FLEET_REFILL; (refilled, lost)."""
        metadata = (island.get("config") or {}).get("metadata") or {}
        if metadata.get(INCARNATION) != target.incarnation.id:
            return set(), {"reimaged": set(todo)}
        first = int((island.get("state") or {}).get("first_seq", 0))
        lost: dict[str, set[int]] = {"evicted": {s for s in todo if s < first}}
        wanted = [s for s in todo if s >= first]
        chunks = [
            (seq, min(seq + BATCH - 1, hi))
            for lo, hi in to_ranges(wanted)
            for seq in range(lo, hi + 1, BATCH)
        ]
        refilled: set[int] = set()
        for at in range(0, len(chunks), WINDOW):
            window = chunks[at : at + WINDOW]
            read = await asyncio.gather(*(self._read(target, lo, hi) for lo, hi in window))
            msgs = [m for batch in read for m in batch]
            refilled.update(await asyncio.gather(*(self._publish(target, m) for m in msgs)))
        lost["deleted_on_device"] = set(wanted) - refilled
        return refilled, lost

    async def _read(self, target: Target, lo: int, hi: int, source: str = "") -> list[Msg]:
        """The island's messages `lo`..`hi` (those it still has), a bounded batch at a time;
        or those of another stream's direct get subject, `source`."""
        source = source or f"{target.device.api_prefix}.DIRECT.GET.{target.incarnation.stream}"
        return await read_range(
            self.nc, target.device, source, lo, hi, timeout=READ_TIMEOUT, max_bytes=BATCH_BYTES
        )

    async def _publish(self, target: Target, msg: Msg) -> int:
        headers = dict(msg.headers or {})
        seq = int(headers["Nats-Sequence"])
        subject = headers["Nats-Subject"]
        stored = own_headers(headers)
        if "Nats-Msg-Id" in headers:
            stored[MSG_ID_HEADER] = headers["Nats-Msg-Id"]
        stored[REFILL_HEADER] = f"{target.mirror} {seq} {subject} {headers['Nats-Time-Stamp']}"
        stored["Nats-Expected-Last-Subject-Sequence"] = "0"
        to = refill_subject(target.aggregate, target.mirror, seq, target.device.device_id, subject)
        try:
            await self.js.publish(to, msg.data, headers=stored)
        except APIError as exc:
            if exc.err_code != _WRONG_LAST_SEQUENCE:
                raise
        return seq
