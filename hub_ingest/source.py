"""``jetstream``: a PySpark streaming data source over the hub's aggregate streams.

Offsets are ``{stream: last sequence read}``, kept only in Spark's checkpoint: nothing is
acknowledged on the server, so the checkpoint is the single cursor (as with Spark's Kafka
source) and a batch re-run after a crash reads exactly the same sequence range again.
Partitions are sequence ranges of one stream; executors read them with batch direct gets
(``$JS.API.DIRECT.GET.<stream>`` with ``{"seq", "batch"}``), which return the next *existing*
messages, so replies are clipped to the range and deleted sequences are simply absent.

Rows are attributed from the aggregate's conventions (see `hub_ingest.provision`): the subject
``fleet.<device>.<subject>`` names the device, and ``Nats-Stream-Source`` the stream it was
sourced from (the hub's mirror of the device stream), the sequence there (the device's own,
since a mirror keeps sequences) and the subject as published. Sourcing stamps the hub's
arrival time, so ``device_time`` is read from that mirror, which keeps the device's store
times; the aggregate is sourced from the mirror, so the mirror always has the row already.
A row whose mirror copy retention has since removed gets a null ``device_time``.

Options (keys arrive lower-cased): ``servers`` (comma-separated URLs), ``credentials``,
``streams`` (or ``stream``; comma-separated), ``domain``, ``maxMessagesPerTrigger``,
``messagesPerPartition``, ``failOnDataLoss``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import structlog
from nats.aio.client import Client
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from hub_ingest.errors import ConfigError, DataLossError, IngestError

log = structlog.get_logger(__name__)

FORMAT = "jetstream"
SCHEMA = (
    "device_id STRING, subject STRING, device_seq BIGINT, hub_stream STRING, hub_seq BIGINT, "
    "device_time TIMESTAMP, hub_time TIMESTAMP, headers MAP<STRING, STRING>, payload BINARY"
)
ARROW_SCHEMA = pa.schema(
    [
        ("device_id", pa.string()),
        ("subject", pa.string()),
        ("device_seq", pa.int64()),
        ("hub_stream", pa.string()),
        ("hub_seq", pa.int64()),
        ("device_time", pa.timestamp("us", tz="UTC")),
        ("hub_time", pa.timestamp("us", tz="UTC")),
        ("headers", pa.map_(pa.string(), pa.string())),
        ("payload", pa.binary()),
    ]
)
_NO_TEXT = pa.scalar(None, pa.string())
_GET_BATCH = 10_000  # messages per direct-get request; replies stream back without acks


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """The parsed options; small and picklable, because the reader travels to every task."""

    servers: tuple[str, ...]
    streams: tuple[str, ...]
    credentials: str | None = None
    domain: str | None = None
    max_messages_per_trigger: int | None = None
    messages_per_partition: int = 50_000
    fail_on_data_loss: bool = True

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        def items(key: str) -> tuple[str, ...]:
            return tuple(v.strip() for v in options.get(key, "").split(",") if v.strip())

        def count(key: str) -> int | None:
            raw = options.get(key)
            if raw is None:
                return None
            if not raw.isdigit() or int(raw) <= 0:
                raise ConfigError(
                    f"jetstream option {key}: expected a positive number, got {raw!r}"
                )
            return int(raw)

        streams = items("streams") or items("stream")
        if not streams:
            raise ConfigError("jetstream option streams: name at least one stream")
        fail = options.get("failondataloss", "true").lower()
        if fail not in ("true", "false"):
            raise ConfigError(f"jetstream option failOnDataLoss: expected true/false, got {fail!r}")
        return cls(
            servers=items("servers") or ("nats://127.0.0.1:4222",),
            streams=streams,
            credentials=options.get("credentials") or None,
            domain=options.get("domain") or None,
            max_messages_per_trigger=count("maxmessagespertrigger"),
            messages_per_partition=count("messagesperpartition") or 50_000,
            fail_on_data_loss=fail == "true",
        )

    @property
    def api(self) -> str:
        return f"$JS.{self.domain}.API" if self.domain else "$JS.API"


@dataclass(frozen=True, slots=True)
class SeqRange(InputPartition):
    """Sequences `first`..`last` (inclusive) of `stream`: one Spark task."""

    stream: str
    first: int
    last: int


@dataclass(frozen=True, slots=True)
class StreamState:
    first_seq: int
    last_seq: int
    messages: int


class JetStreamDataSource(DataSource):
    """Register with ``spark.dataSource.register(JetStreamDataSource)``; format ``jetstream``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema: Any) -> JetStreamReader:
        return JetStreamReader(SourceOptions.parse(self.options))


class JetStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans sequence ranges on the driver; `read` runs on executors with its own connection."""

    def __init__(self, options: SourceOptions) -> None:
        # Built on the driver and pickled into every task: no connections here.
        self.options = options
        self._target: dict[str, int] | None = None

    def _states(self) -> dict[str, StreamState]:
        return asyncio.run(_stream_states(self.options))

    def initialOffset(self) -> dict[str, int]:
        return {name: _before(state) for name, state in self._states().items()}

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_messages_per_trigger
        return ReadAllAvailable() if limit is None else ReadMaxRows(limit)

    def prepareForTriggerAvailableNow(self) -> None:
        # Messages arriving after this call belong to the next run.
        self._target = {name: s.last_seq for name, s in self._states().items()}

    def reportLatestOffset(self) -> dict[str, int]:
        return {name: s.last_seq for name, s in self._states().items()}

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        states = self._states()
        end: dict[str, int] = {}
        available: dict[str, int] = {}
        for name, state in states.items():
            if name not in start:
                # A stream new to this query starts where it stands now; `partitions` reads
                # nothing of it in this batch, so the batch stays deterministic.
                end[name] = _before(state)
                continue
            begin = start[name]
            if state.first_seq > begin + 1:  # also when retention emptied the stream
                lost = DataLossError(name, begin + 1, state.first_seq - 1)
                if self.options.fail_on_data_loss:
                    raise lost
                log.warning("data_loss_skipped", stream=name, first=lost.first, last=lost.last)
                begin = state.first_seq - 1
            last = state.last_seq
            if self._target is not None:
                last = min(last, self._target.get(name, last))
            end[name] = begin
            available[name] = max(last - begin, 0)
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        for name, take in _share(available, budget).items():
            end[name] += take
        # Never move backwards, even if a stream was purged and recreated behind our back.
        return {name: max(seq, start.get(name, seq)) for name, seq in end.items()}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[SeqRange]:
        step = self.options.messages_per_partition
        parts = []
        for name in sorted(end):
            first = start.get(name, end[name]) + 1
            for lo in range(first, end[name] + 1, step):
                parts.append(SeqRange(name, lo, min(lo + step - 1, end[name])))
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SeqRange)
        yield asyncio.run(_read_range(self.options, partition))

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to do: the checkpoint, not the server, remembers what was read."""


def _before(state: StreamState) -> int:
    """The offset just before the oldest message still in the stream."""
    return max(state.first_seq - 1, 0) if state.messages else state.last_seq


def _share(available: dict[str, int], budget: int | None) -> dict[str, int]:
    """How many sequences to take from each stream, at most `budget` in all."""
    total = sum(available.values())
    if budget is None or total <= budget:
        return available
    shares = {name: budget * n // total for name, n in available.items()}
    # Rounding down can leave a stream at zero for ever; give each at least one.
    return {name: max(share, min(available[name], 1)) for name, share in shares.items()}


async def _connect(options: SourceOptions) -> _FrameClient:
    creds = options.credentials
    # A JWT ``.creds`` file, or the bare NKey seed the hub's operators use.
    jwt = creds if creds and creds.endswith(".creds") else None
    nc = _FrameClient()
    await nc.connect(
        list(options.servers),
        user_credentials=jwt,
        nkeys_seed=None if jwt else creds,
        connect_timeout=5,
        max_reconnect_attempts=3,
    )
    return nc


async def _stream_states(options: SourceOptions) -> dict[str, StreamState]:
    nc = await _connect(options)
    try:
        js = nc.jetstream(domain=options.domain)
        states = {}
        for name in options.streams:
            s = (await js.stream_info(name)).state
            states[name] = StreamState(s.first_seq, s.last_seq, s.messages)
        return states
    finally:
        await nc.close()


class _FrameClient(Client):
    """A nats-py client that hands chosen subscriptions' frames over raw, through `sinks`.

    nats-py matches two regular expressions, copies a header block into a dict and awaits a
    coroutine for every message; on batch direct gets that was most of the read's CPU.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sinks: dict[int, Callable[[bytes, bytes], None]] = {}
        self._ps = _FrameParser(self)

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        sink = self.sinks.get(sid)
        if sink is None:
            await super()._process_msg(sid, subject, reply, data, headers)
        else:
            sink(headers, data)


class _FrameParser(Parser):
    """nats-py's protocol parser with a fast path: whole ``HMSG`` frames for a sink are cut out
    of the buffer here; anything else (and a frame not complete yet) is left to nats-py."""

    def __init__(self, nc: _FrameClient) -> None:
        super().__init__(nc)
        self.sinks = nc.sinks

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        pos = 0
        while self.state == AWAITING_CONTROL_LINE and buf.startswith(b"HMSG ", pos):
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break  # the rest of the line is still on its way
            args = buf[pos + 5 : eol].split()  # subject sid [reply] header-size total-size
            sink = self.sinks.get(int(args[1]))
            if sink is None:
                break
            start, end = eol + 2, eol + 2 + int(args[-1])
            if len(buf) < end + 2:
                del buf[:pos]
                return  # the rest of the frame is still on its way
            split = start + int(args[-2])
            sink(bytes(buf[start:split]), bytes(buf[split:end]))
            pos = end + 2
        del buf[:pos]
        if buf:
            await super().parse()


@dataclass(slots=True)
class _Frames:
    """Direct-get replies of one stream range, in sequence order, as they came off the wire."""

    headers: list[bytes] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)


def _last_sequence(frames: _Frames) -> int:
    raw = frames.headers[-1]  # the server's Nats-Sequence follows any stored one
    start = raw.rindex(b"\r\nNats-Sequence: ") + 17
    return int(raw[start : raw.index(b"\r\n", start)])


async def _get_range(nc: _FrameClient, api: str, stream: str, first: int, last: int) -> _Frames:
    """Every message of `stream` in `first`..`last`, in order."""
    frames = _Frames()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def sink(raw: bytes, data: bytes) -> None:
        if raw[8:9] != b" ":
            frames.headers.append(raw)
            frames.data.append(data)
        elif not done.done():  # a status ("NATS/1.0 204 EOB") ends the batch
            done.set_result(None)

    nc.sinks[sub._id] = sink
    seq = first
    try:
        while seq <= last:
            done = loop.create_future()
            before = len(frames.headers)
            request = {"seq": seq, "batch": min(last - seq + 1, _GET_BATCH)}
            await nc.publish(f"{api}.DIRECT.GET.{stream}", json.dumps(request).encode(), inbox)
            await asyncio.wait_for(done, 30)
            if len(frames.headers) == before:
                break  # nothing at or after `seq` (404), or no such stream (503)
            seq = _last_sequence(frames) + 1
    finally:
        del nc.sinks[sub._id]
        await sub.unsubscribe()
    # A batch returns the next *existing* messages, which may lie past `last`.
    while frames.headers and _last_sequence(frames) > last:
        frames.headers.pop()
        frames.data.pop()
    return frames


@dataclass(frozen=True, slots=True)
class _Replies:
    """The parsed header blocks of direct-get replies, one array element per message."""

    stored: pa.Array  # the message's own header lines (binary)
    subject: pa.Array
    seq: pa.Array
    time: pa.Array


def _replies(frames: _Frames) -> _Replies:
    """Split every header block into the stored headers and the server's reply headers.

    A block is the line ``NATS/1.0``, the stored header lines, then the server's own lines
    ``Nats-Stream``, ``Nats-Subject``, ``Nats-Sequence``, ``Nats-Time-Stamp`` (in this order)
    and more. Parsed a column at a time: a Python loop per message was the read's largest cost.
    """
    raw = pa.array(frames.headers, pa.binary())
    halves = pc.split_pattern(raw, "\r\nNats-Stream: ", max_splits=1, reverse=True)
    reply = pc.split_pattern(pc.list_element(halves, 1), "\r\n")
    fields = {}
    for index, name in enumerate(("Nats-Subject: ", "Nats-Sequence: ", "Nats-Time-Stamp: "), 1):
        line = pc.list_element(reply, index)
        if not pc.all(pc.starts_with(line, name), min_count=0).as_py():
            raise IngestError(f"unexpected direct get reply: {name.strip()} is not header {index}")
        fields[name] = pc.utf8_slice_codeunits(pc.cast(line, pa.string()), len(name))
    return _Replies(
        # An explicit stop: pyarrow 26 sizes binary_slice's output wrongly without one.
        stored=pc.binary_slice(pc.list_element(halves, 0), len(b"NATS/1.0\r\n"), 1 << 30),
        subject=fields["Nats-Subject: "],
        seq=pc.cast(fields["Nats-Sequence: "], pa.int64()),
        time=_timestamps(fields["Nats-Time-Stamp: "]),
    )


async def _read_range(options: SourceOptions, part: SeqRange) -> pa.RecordBatch:
    nc = await _connect(options)
    try:
        frames = await _get_range(nc, options.api, part.stream, part.first, part.last)
        replies = _replies(frames)
        headers = _headers(replies.stored)
        origin = _origin(headers)
        device_time = await _device_times(nc, options.api, origin)
    finally:
        await nc.close()
    device_id, subject = _attribution(replies.subject, origin.subject)
    columns = {
        "device_id": device_id,
        "subject": subject,
        "device_seq": origin.seq,
        "hub_stream": pa.array([part.stream] * len(frames.headers), pa.string()),
        "hub_seq": replies.seq,
        "device_time": device_time,
        "hub_time": replies.time,
        "headers": headers,
        "payload": pa.array(frames.data, pa.binary()),
    }
    return pa.RecordBatch.from_pydict(columns, schema=ARROW_SCHEMA)


def _headers(stored: pa.Array) -> pa.MapArray:
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
        _text(pc.list_element(pairs, 0)),
        pc.utf8_trim_whitespace(_text(pc.list_element(pairs, 1))),
    )


@dataclass(frozen=True, slots=True)
class _Origin:
    """Per row, from ``Nats-Stream-Source``: the hub mirror it was sourced from, the sequence
    there (the device's own: a mirror keeps sequences) and the subject as published; null
    for a row that has no such header."""

    mirror: pa.Array
    seq: pa.Array
    subject: pa.Array


def _origin(headers: pa.MapArray) -> _Origin:
    rows = len(headers)
    is_source = pc.equal(headers.keys, "Nats-Stream-Source")
    # "<stream>[:<hash>] <seq> <filter> <transform> <subject> …"
    fields = pc.split_pattern(pc.filter(headers.items, is_source), " ")
    entries = np.diff(headers.offsets.to_numpy())
    owner = np.repeat(np.arange(rows), entries)[is_source.to_numpy(zero_copy_only=False)]
    index = np.full(rows, -1)
    index[owner] = np.arange(len(owner))
    at = pa.array(index, mask=index < 0)  # null: the row has no source header
    stream = pc.list_element(pc.split_pattern(pc.list_element(fields, 0), ":", max_splits=1), 0)
    subject = _element_or_null(fields, 4)
    return _Origin(
        mirror=pc.take(stream, at),
        seq=pc.take(pc.cast(pc.list_element(fields, 1), pa.int64()), at),
        subject=pc.take(subject, at),
    )


async def _device_times(nc: _FrameClient, api: str, origin: _Origin) -> pa.Array:
    """Each row's store time on the device, read from the hub mirror it was sourced from."""
    times = pa.nulls(len(origin.seq), ARROW_SCHEMA.field("device_time").type)
    for mirror in pc.unique(origin.mirror.drop_null()).to_pylist():
        rows = pc.fill_null(pc.equal(origin.mirror, mirror), False)
        lo, hi = pc.min_max(pc.filter(origin.seq, rows)).values()
        got = _replies(await _get_range(nc, api, mirror, lo.as_py(), hi.as_py()))
        found = pc.take(got.time, pc.index_in(origin.seq, value_set=got.seq))
        times = pc.if_else(rows, found, times)
    return times


def _attribution(hub_subject: pa.Array, published: pa.Array) -> tuple[pa.Array, pa.Array]:
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


def _text(values: pa.Array) -> pa.Array:
    """Binary header text as UTF-8, invalid bytes replaced (headers are meant to be ASCII)."""
    try:
        return pc.cast(values, pa.string())
    except pa.ArrowInvalid:
        return pa.array([v.decode("utf-8", "replace") for v in values.to_pylist()], pa.string())


def _timestamps(values: pa.Array) -> pa.Array:
    """RFC 3339 nanosecond times as UTC microseconds (Spark's precision)."""
    parsed = pc.cast(values, pa.timestamp("ns", tz="UTC"))
    return pc.cast(parsed, pa.timestamp("us", tz="UTC"), safe=False)
