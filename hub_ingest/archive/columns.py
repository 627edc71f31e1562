"""Arrow columns of archive rows, parsed a column at a time from what the wire reader cut:
a Python loop per message was the read's largest cost."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import structlog

from edge_agent.protocol.pack import PACK_HEADER, PackError, decode
from hub_ingest.core.errors import IngestError
from hub_ingest.fleet.gaps import FROM_REFILL, REFILL_HEADER

log = structlog.get_logger(__name__)

_NO_TEXT = pa.scalar(None, pa.string())


def ack_fields(tokens: int) -> tuple[int, int]:
    """Where the stream sequence and store time sit in a ``$JS.ACK`` subject of `tokens` tokens:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<seq>.<consumer seq>.<time>.<pending>``, or that
    with domain and account hash after ``ACK`` (and a token at the end)."""
    return (5, 7) if tokens == 9 else (7, 9)


@dataclass(frozen=True, slots=True)
class Stamps:
    """Per message: its sequence in the stream it was read from, and its store time there."""

    seq: pa.Array
    time: pa.Array


def store_times(headers: list[bytes]) -> Stamps:
    """Sequence and store time from direct-get header blocks.

    A block is the line ``NATS/1.0``, the stored header lines, then the server's own lines
    ``Nats-Stream``, ``Nats-Subject``, ``Nats-Sequence``, ``Nats-Time-Stamp`` (in this order)
    and more. Parsed a column at a time: a Python loop per message was the read's largest cost.
    """
    raw = pa.array(headers, pa.binary())
    halves = pc.split_pattern(raw, "\r\nNats-Stream: ", max_splits=1, reverse=True)
    reply = pc.split_pattern(pc.list_element(halves, 1), "\r\n")
    fields = {}
    for index, name in ((2, "Nats-Sequence: "), (3, "Nats-Time-Stamp: ")):
        line = pc.list_element(reply, index)
        if not pc.all(pc.starts_with(line, name), min_count=0).as_py():
            raise IngestError(f"unexpected direct get reply: {name.strip()} is not header {index}")
        fields[name] = pc.utf8_slice_codeunits(pc.cast(line, pa.string()), len(name))
    return Stamps(
        seq=pc.cast(fields["Nats-Sequence: "], pa.int64()),
        time=timestamps(fields["Nats-Time-Stamp: "]),
    )


def ack_stamps(acks: list[bytes]) -> Stamps:
    """Stream sequence and store time of each delivery, from its ``$JS.ACK`` subject."""
    tokens = pc.split_pattern(pa.array(acks, pa.binary()), ".")
    count = pc.list_value_length(tokens)
    width = count[0].as_py() if acks else 9
    if not pc.all(pc.equal(count, width), min_count=0).as_py():
        raise IngestError("unexpected deliveries: $JS.ACK subjects of different layouts")
    seq, time = (pc.cast(pc.list_element(tokens, i), pa.string()) for i in ack_fields(width))
    return Stamps(seq=pc.cast(seq, pa.int64()), time=timestamps(pc.cast(time, pa.int64())))


def header_map(stored: pa.Array) -> pa.MapArray:
    """Each message's stored header lines ``Name: value`` as a map."""
    lines = pc.split_pattern(stored, "\r\n")
    pairs = pc.split_pattern(pc.list_flatten(lines), ":", max_splits=1)
    named = pc.equal(pc.list_value_length(pairs), 2)
    pairs = pc.filter(pairs, named)
    owner = pc.filter(pc.list_parent_indices(lines), named).to_numpy()
    offsets = np.zeros(len(stored) + 1, np.int32)
    np.cumsum(np.bincount(owner, minlength=len(stored)), out=offsets[1:])
    return pa.MapArray.from_arrays(
        offsets,
        as_text(pc.list_element(pairs, 0)),
        pc.utf8_trim_whitespace(as_text(pc.list_element(pairs, 1))),
    )


@dataclass(frozen=True, slots=True)
class Origin:
    """Per row, from ``Nats-Stream-Source`` (or, for a refilled row, ``Edge-Refill-Of``): the
    hub mirror it came from, the sequence there (the device's own: a mirror keeps sequences),
    the subject as published, and for a refilled row the device's store time (its mirror
    never held it); null for a row that has no such header."""

    mirror: pa.Array
    seq: pa.Array
    subject: pa.Array
    time: pa.Array


def origin_of(headers: pa.MapArray) -> Origin:
    source = header_values(headers, "Nats-Stream-Source")
    # Only a row sourced from FLEET_REFILL is refilled: an app may set the header itself.
    from_refill = pc.fill_null(pc.match_substring_regex(source, FROM_REFILL), False)
    refill = pc.if_else(from_refill, header_values(headers, REFILL_HEADER), _NO_TEXT)
    refilled = pc.is_valid(refill)
    # "<stream>[:<hash>] <seq> <filter> <transform> <subject> …", or "<mirror> <seq> <subject>
    # <time>" for a refilled row.
    fields = pc.split_pattern(pc.coalesce(refill, source), " ")
    stream = pc.list_element(pc.split_pattern(pc.list_element(fields, 0), ":", max_splits=1), 0)
    subject = pc.if_else(refilled, _element_or_null(fields, 2), _element_or_null(fields, 4))
    time = pc.if_else(refilled, _element_or_null(fields, 3), _NO_TEXT)
    return Origin(
        mirror=stream,
        seq=pc.cast(pc.list_element(fields, 1), pa.int64()),
        subject=subject,
        time=timestamps(time),
    )


# Per reading, from its pack; the other columns are the pack's own.
_READING_COLUMNS = ("subject", "device_seq", "device_time", "headers", "payload")


def unpack(columns: dict[str, pa.Array], schema: pa.Schema) -> dict[str, pa.Array]:
    """Rows with each pack (``Edge-Pack``) replaced by one row per reading in it: its own
    sequence, subject, store time, headers and payload. A pack that cannot be read stays one
    row, as it came (and is logged): nothing is dropped."""
    packed = header_values(columns["headers"], PACK_HEADER)
    if packed.null_count == len(packed):
        return columns
    rows: list[int] = []
    readings: dict[str, list[object]] = {name: [] for name in _READING_COLUMNS}
    own = {name: columns[name].to_pylist() for name in _READING_COLUMNS}
    own["device_time"] = pc.cast(columns["device_time"], pa.int64()).to_pylist()  # µs
    for i, (header, body) in enumerate(zip(packed.to_pylist(), own["payload"], strict=True)):
        try:
            inside = decode(body) if header is not None else None
        except PackError as exc:
            log.error("pack_unreadable", hub_seq=columns["hub_seq"][i].as_py(), error=str(exc))
            inside = None
        if inside is None:
            rows.append(i)
            for name in _READING_COLUMNS:
                readings[name].append(own[name][i])
            continue
        for r in inside:
            rows.append(i)
            readings["subject"].append(r.subject)
            readings["device_seq"].append(r.seq)
            readings["device_time"].append(r.time_ns // 1000)
            readings["headers"].append(list(r.headers.items()))
            readings["payload"].append(r.data)
    taken = pa.array(rows, pa.int64())
    # Only the pack's own columns are repeated per reading: taking its payload too copied the
    # whole pack once per reading it held (a batch of 128 KiB packs overflowed Arrow's 2 GiB).
    out = {
        name: pc.take(array, taken)
        for name, array in columns.items()
        if name not in _READING_COLUMNS
    }
    for name, values in readings.items():
        kind = schema.field(name).type
        raw = pa.int64() if name == "device_time" else kind
        out[name] = pa.array(values, raw).cast(kind)
    return {name: out[name] for name in columns}


def header_values(headers: pa.MapArray, name: str) -> pa.Array:
    """Each row's value of header `name` (its last one), null where the row has none."""
    rows = len(headers)
    is_name = pc.equal(headers.keys, name)
    entries = np.diff(headers.offsets.to_numpy())
    owner = np.repeat(np.arange(rows), entries)[is_name.to_numpy(zero_copy_only=False)]
    index = np.full(rows, -1)
    index[owner] = np.arange(len(owner))
    return pc.take(pc.filter(headers.items, is_name), pa.array(index, mask=index < 0))


def suspect(
    device_time: pa.Array, hub_time: pa.Array, offset: pa.Array, tolerance: float
) -> pa.Array:
    """A device time is implausible when it is later than the hub's store time (a message
    reaches the hub after the device stored it), or when the device's clock was off by more
    than `tolerance` at its last report."""
    late = pc.greater(
        device_time, pc.add(hub_time, pa.scalar(int(tolerance * 1e6), pa.duration("us")))
    )
    off = pc.greater(pc.abs(offset), tolerance)
    return pc.or_(pc.fill_null(late, False), pc.fill_null(off, False))


def attribution(hub_subject: pa.Array, published: pa.Array) -> tuple[pa.Array, pa.Array]:
    """(device_id, subject as published) from the aggregate subject ``fleet.<device>.<rest>``;
    a subject not of that form keeps itself as `subject` and has no device."""
    local = pc.if_else(
        pc.starts_with(hub_subject, "fleet."),
        pc.utf8_slice_codeunits(hub_subject, len("fleet.")),
        hub_subject,
    )
    parts = pc.split_pattern(local, ".", max_splits=1)
    rest = _non_empty(_element_or_null(parts, 1))
    device_id = pc.if_else(pc.is_null(rest), _NO_TEXT, pc.list_element(parts, 0))
    return device_id, pc.coalesce(_non_empty(published), rest, hub_subject)


def _element_or_null(lists: pa.Array, index: int) -> pa.Array:
    """Element `index` of each list, null where a list is shorter (`list_element` fails)."""
    return pc.list_element(pc.list_slice(lists, index, index + 1, return_fixed_size_list=True), 0)


def _non_empty(text: pa.Array) -> pa.Array:
    return pc.if_else(pc.equal(text, ""), _NO_TEXT, text)


def as_text(values: pa.Array) -> pa.Array:
    """Binary header text as UTF-8, invalid bytes replaced (headers are meant to be ASCII)."""
    try:
        return pc.cast(values, pa.string())
    except pa.ArrowInvalid:
        return pa.array([v.decode("utf-8", "replace") for v in values.to_pylist()], pa.string())


def timestamps(values: pa.Array) -> pa.Array:
    """RFC 3339 times, or nanoseconds since the epoch, as UTC microseconds (Spark's precision)."""
    parsed = pc.cast(values, pa.timestamp("ns", tz="UTC"))
    return pc.cast(parsed, pa.timestamp("us", tz="UTC"), safe=False)
