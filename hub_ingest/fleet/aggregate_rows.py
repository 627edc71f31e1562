"""Where a hub mirror's rows are in its aggregate: direct gets filtered on the device's
subjects, each row's origin read from its headers. A mirror's rows reach the aggregate in
order (refilled rows, which carry `Edge-Refill-Of`, come later and out of order), so a binary
search over the aggregate's sequences finds where a range of the mirror is or would be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext

from hub_ingest.core.replies import direct_get
from hub_ingest.fleet.gaps import Target, refill_of, to_ranges

_BATCH = 256  # rows per direct get from the hub's own aggregate


async def in_aggregate(
    js: JetStreamContext, nc: Client, api: str, target: Target, todo: list[int]
) -> set[int]:
    """Which of `todo` the aggregate holds already, sourced from the mirror before it lost
    them."""
    held: set[int] = set()
    for span in to_ranges(todo):
        held |= await _in_aggregate_range(js, nc, api, target, span)
    return held


async def _in_aggregate_range(
    js: JetStreamContext, nc: Client, api: str, target: Target, span: tuple[int, int]
) -> set[int]:
    """The sequences of the mirror in `span` the aggregate holds: from where the range would
    be, a short read forward says."""
    lo_seq, hi_seq = span
    filter_subject = f"fleet.{target.device.device_id}.>"
    seq, last = await _first_at_or_after(js, nc, api, target, lo_seq)
    held: set[int] = set()
    while seq <= last:
        msgs = await _direct(nc, api, target.aggregate, seq, subject=filter_subject, batch=_BATCH)
        if not msgs:
            break
        for msg in msgs:
            origin = _source(msg)
            if origin is not None and origin[0] == target.mirror:
                if origin[1] > hi_seq:
                    return held
                if origin[1] >= lo_seq:
                    held.add(origin[1])
        seq = msgs[-1].seq + 1
    return held


async def _first_at_or_after(
    js: JetStreamContext, nc: Client, api: str, target: Target, lo_seq: int
) -> tuple[int, int]:
    """(the first aggregate seq whose row from the mirror has a device seq at or above
    `lo_seq`, the aggregate's last seq): the device's rows in the aggregate are in device
    order, so a binary search on the aggregate's sequences finds it."""
    filter_subject = f"fleet.{target.device.device_id}.>"

    async def device_seq_at(agg_seq: int) -> tuple[int, int] | None:
        """(aggregate seq, device seq) of the mirror's first row at or after `agg_seq`."""
        for msg in await _direct(
            nc, api, target.aggregate, agg_seq, subject=filter_subject, batch=64
        ):
            origin = _source(msg)
            if origin is not None and origin[0] == target.mirror:
                return msg.seq, origin[1]
        return None

    info = await js.stream_info(target.aggregate)
    low, high = info.state.first_seq, info.state.last_seq + 1
    while low < high:
        mid = (low + high) // 2
        found = await device_seq_at(mid)
        if found is None or found[1] >= lo_seq:
            high = mid
        else:
            low = found[0] + 1
    return low, info.state.last_seq


async def sourced_below(
    js: JetStreamContext, nc: Client, api: str, target: Target, seq: int
) -> int | None:
    """The highest mirror sequence below `seq` the aggregate sourced from the mirror (None:
    none it still holds)."""
    at, _ = await _first_at_or_after(js, nc, api, target, seq)
    return await sourced_row(nc, api, target, at, before=True)


async def sourced_row(
    nc: Client, api: str, target: Target, agg_seq: int, *, before: bool = False
) -> int | None:
    """The mirror sequence of the first row the aggregate sourced from `target`'s mirror at
    or after aggregate sequence `agg_seq`; with `before`, of the last one before it (a binary
    search: the mirror's rows are in order in the aggregate). Refilled rows, out of order,
    are passed over."""
    if not before:
        found = await _next_sourced(nc, api, target, agg_seq, until=None)
        return found[1] if found else None
    low, high, best = 1, agg_seq - 1, None
    while low <= high:
        mid = (low + high) // 2
        found = await _next_sourced(nc, api, target, mid, until=agg_seq)
        if found is None:
            high = mid - 1
        else:
            best, low = found[1], found[0] + 1
    return best


async def _next_sourced(
    nc: Client, api: str, target: Target, agg_seq: int, *, until: int | None
) -> tuple[int, int] | None:
    """(aggregate seq, mirror seq) of the first row sourced from the mirror at or after
    `agg_seq` (and before `until`)."""
    seq = agg_seq
    subject = f"fleet.{target.device.device_id}.>"
    while msgs := await _direct(nc, api, target.aggregate, seq, subject=subject, batch=_BATCH):
        for msg in msgs:
            if until is not None and msg.seq >= until:
                return None
            origin = _source(msg, refilled=False)
            if origin is not None and origin[0] == target.mirror:
                return msg.seq, origin[1]
        seq = msgs[-1].seq + 1
    return None


async def source_lags(nc: Client, api: str, aggregate: str) -> dict[str, int | None]:
    """How far behind each of `aggregate`'s sources it is, by name (None: in error)."""
    reply = await nc.request(f"{api}.STREAM.INFO.{aggregate}", b"", timeout=10)
    return {
        str(source["name"]): None if source.get("error") else int(source.get("lag", 0))
        for source in json.loads(reply.data).get("sources") or []
    }


async def sourced_all(nc: Client, api: str, target: Target) -> bool:
    """Whether the aggregate has sourced everything the mirror holds (no lag)."""
    return (await source_lags(nc, api, target.aggregate)).get(target.mirror) == 0


@dataclass(frozen=True, slots=True)
class _Stored:
    seq: int
    headers: dict[str, str]


async def _direct(
    nc: Client, api: str, stream: str, seq: int, *, subject: str, batch: int
) -> list[_Stored]:
    """Up to `batch` messages on `subject` from `seq` on (only their headers are used)."""
    request = {"seq": seq, "next_by_subj": subject, "batch": batch}
    msgs = await direct_get(nc, api, stream, request, timeout=10)
    stored = [dict(m.headers or {}) for m in msgs]
    return [_Stored(int(headers["Nats-Sequence"]), headers) for headers in stored]


def _source(msg: _Stored, *, refilled: bool = True) -> tuple[str, int] | None:
    """(mirror, device seq) a row of the aggregate came from; refilled rows say so (without
    `refilled`, they count as from nowhere)."""
    raw = (refilled and refill_of(msg.headers)) or msg.headers.get("Nats-Stream-Source")
    if not raw:
        return None
    fields = raw.split()
    return fields[0].split(":", 1)[0], int(fields[1])
