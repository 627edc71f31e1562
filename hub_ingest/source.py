"""``jetstream``: a PySpark streaming data source over the hub's aggregate streams.

Offsets are ``{stream: last sequence read}``, kept only in Spark's checkpoint: nothing is
acknowledged on the server, so the checkpoint is the single cursor (as with Spark's Kafka
source) and a batch re-run after a crash reads exactly the same sequence range again.
Partitions are sequence ranges of one stream. An executor reads its range through an
ephemeral pull consumer that starts at the range's first sequence and acks nothing (it is
deleted after the read, or expires if the task dies); deliveries carry each message's stream
sequence and store time in their ``$JS.ACK`` reply subject. The consumer delivers the next
*existing* messages, so deliveries are clipped to the range and deleted sequences are simply
absent.

Rows are attributed from the aggregate's conventions (see `hub_ingest.provision`): the subject
``fleet.<device>.<subject>`` names the device, and ``Nats-Stream-Source`` the stream it was
sourced from (the hub's mirror of the device stream), the sequence there (the device's own,
since a mirror keeps sequences) and the subject as published. Sourcing stamps the hub's
arrival time, so ``device_time`` is read from that mirror (batch direct gets,
``$JS.API.DIRECT.GET.<stream>`` with ``{"seq", "batch"}``), which keeps the device's store
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
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from edge_agent.protocol.names import js_api
from hub_ingest.errors import ConfigError, DataLossError, IngestError

log = structlog.get_logger(__name__)

FORMAT = "jetstream"
SCHEMA = (
    "device_id STRING, incarnation STRING, subject STRING, device_seq BIGINT, "
    "hub_stream STRING, hub_seq BIGINT, device_time TIMESTAMP, hub_time TIMESTAMP, "
    "device_clock_offset_s DOUBLE, device_time_suspect BOOLEAN, "
    "headers MAP<STRING, STRING>, payload BINARY"
)
ARROW_SCHEMA = pa.schema(
    [
        ("device_id", pa.string()),
        ("incarnation", pa.string()),
        ("subject", pa.string()),
        ("device_seq", pa.int64()),
        ("hub_stream", pa.string()),
        ("hub_seq", pa.int64()),
        ("device_time", pa.timestamp("us", tz="UTC")),
        ("hub_time", pa.timestamp("us", tz="UTC")),
        ("device_clock_offset_s", pa.float64()),
        ("device_time_suspect", pa.bool_()),
        ("headers", pa.map_(pa.string(), pa.string())),
        ("payload", pa.binary()),
    ]
)
_NO_TEXT = pa.scalar(None, pa.string())
_PULL_BATCH = 10_000  # messages per pull or direct-get request
_PULL_BYTES = 16 << 20  # per pull: well under the 64 MiB a server lets a client fall behind
_MAX_BYTES = "409 Message Size Exceeds MaxBytes"
_CONSUMER_IDLE_S = 30.0  # a consumer left behind by a dead task goes after this


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
    clock_tolerance: float = 120.0  # seconds; see `_suspect`

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
            clock_tolerance=_seconds(options.get("clocktolerance", "120")),
        )

    @property
    def api(self) -> str:
        return js_api(self.domain) if self.domain else "$JS.API"


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ConfigError(f"jetstream option clockTolerance: expected seconds, got {raw!r}")
    return value


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
    """A nats-py client that hands chosen subscriptions' messages over raw, through `sinks`.

    nats-py matches two regular expressions, copies a header block into a dict and awaits a
    coroutine for every message; on bulk reads that was most of the read's CPU.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sinks: dict[int, _Sink] = {}
        self._ps = _FrameParser(self)

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        sink = self.sinks.get(sid)
        if sink is None:
            await super()._process_msg(sid, subject, reply, data, headers)
        else:
            sink(subject, reply, headers or b"", data)


_Sink = Callable[[bytes, bytes, bytes, bytes], None]  # subject, reply, headers, data


class _FrameParser(Parser):
    """nats-py's protocol parser with a fast path: whole ``MSG`` and ``HMSG`` frames for a sink
    are cut out of the buffer here; anything else (and a frame not complete yet) is left to
    nats-py."""

    def __init__(self, nc: _FrameClient) -> None:
        super().__init__(nc)
        self.sinks = nc.sinks

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        pos = 0
        while self.state == AWAITING_CONTROL_LINE:
            if buf.startswith(b"HMSG ", pos):
                op, sizes = 5, 2  # HMSG subject sid [reply] header-size total-size
            elif buf.startswith(b"MSG ", pos):
                op, sizes = 4, 1  # MSG subject sid [reply] size
            else:
                break
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break  # the rest of the line is still on its way
            args = buf[pos + op : eol].split()
            sink = self.sinks.get(int(args[1]))
            if sink is None:
                break
            start, end = eol + 2, eol + 2 + int(args[-1])
            if len(buf) < end + 2:
                del buf[:pos]
                return  # the rest of the frame is still on its way
            split = start + int(args[-2]) if sizes == 2 else start
            reply = bytes(args[2]) if len(args) > 2 + sizes else b""
            sink(bytes(args[0]), reply, bytes(buf[start:split]), bytes(buf[split:end]))
            pos = end + 2
        del buf[:pos]
        if buf:
            await super().parse()


def _status(headers: bytes) -> str | None:
    """The status of a control message (``NATS/1.0 404 No Messages``), else None."""
    if headers[8:9] != b" ":
        return None
    return headers[9 : headers.find(b"\r\n")].decode(errors="replace")


@dataclass(slots=True)
class _Deliveries:
    """Messages of one stream range as a consumer delivered them, in sequence order."""

    subjects: list[bytes] = field(default_factory=list)
    acks: list[bytes] = field(default_factory=list)  # reply subjects: $JS.ACK.<stream>…
    headers: list[bytes] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)

    def pop(self) -> None:
        for column in (self.subjects, self.acks, self.headers, self.data):
            column.pop()


def _ack_fields(tokens: int) -> tuple[int, int]:
    """Where the stream sequence and store time sit in a ``$JS.ACK`` subject of `tokens` tokens:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<seq>.<consumer seq>.<time>.<pending>``, or that
    with domain and account hash after ``ACK`` (and a token at the end)."""
    return (5, 7) if tokens == 9 else (7, 9)


def _ack_sequence(ack: bytes) -> int:
    tokens = ack.split(b".")
    return int(tokens[_ack_fields(len(tokens))[0]])


async def _consume_range(nc: _FrameClient, options: SourceOptions, part: SeqRange) -> _Deliveries:
    """Every message of the range, in order, through a short-lived pull consumer.

    A direct get stamps its reply headers into each message, and into a message that has
    stored headers (every sourced one) by rewriting them: measured on nats-server 2.15.1 that
    cost the server 3.5x a consumer delivery. The consumer acks nothing (the checkpoint
    stays the only cursor) and is deleted afterwards, or expires should this task die.
    """
    js = nc.jetstream(domain=options.domain)
    consumer = await js.add_consumer(
        part.stream,
        ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=part.first,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=_CONSUMER_IDLE_S,
            mem_storage=True,
            num_replicas=1,
        ),
    )
    got = _Deliveries()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bytes | None] = loop.create_future()
    # Bounds each pull's bytes, so a batch of large messages cannot make us a slow consumer.
    max_bytes = max(_PULL_BYTES, 2 * nc.max_payload)
    due, budget = 0, 0

    def sink(subject: bytes, reply: bytes, headers: bytes, data: bytes) -> None:
        nonlocal due, budget
        if not reply:  # a status: "404 No Messages" when the stream has no more
            if not done.done():
                done.set_result(headers)
            return
        got.subjects.append(subject)
        got.acks.append(reply)
        got.headers.append(headers)
        got.data.append(data)
        due -= 1
        budget -= len(subject) + len(reply) + len(headers) + len(data)  # as the server counts
        if (due == 0 or budget == 0) and not done.done():  # a pull that ends without a status
            done.set_result(None)

    nc.sinks[sub._id] = sink
    pull = f"{options.api}.CONSUMER.MSG.NEXT.{part.stream}.{consumer.name}"
    seq = part.first
    try:
        while seq <= part.last:
            done, before = loop.create_future(), len(got.acks)
            due, budget = min(part.last - seq + 1, _PULL_BATCH), max_bytes
            request = {"batch": due, "max_bytes": budget, "no_wait": True}
            await nc.publish(pull, json.dumps(request).encode(), inbox)
            ended = await asyncio.wait_for(done, 30)
            status = None if ended is None else _status(ended)
            if status is not None and status.startswith("404"):
                break  # nothing at or after `seq`
            # Max bytes ends this pull only; any other status would lose messages.
            if len(got.acks) == before or status not in (None, _MAX_BYTES):
                raise IngestError(f"pulling {part.stream} from seq {seq}: {status}")
            seq = _ack_sequence(got.acks[-1]) + 1
    finally:
        del nc.sinks[sub._id]
        await sub.unsubscribe()
        await _delete_consumer(js, part.stream, consumer.name)
    # A pull returns the next *existing* messages, which may lie past `last`.
    while got.acks and _ack_sequence(got.acks[-1]) > part.last:
        got.pop()
    return got


async def _delete_consumer(js: JetStreamContext, stream: str, name: str) -> None:
    try:
        await js.delete_consumer(stream, name)
    except (TimeoutError, NatsError) as exc:  # it expires on its own
        log.warning("consumer_not_deleted", stream=stream, consumer=name, error=str(exc))


def _last_sequence(headers: list[bytes]) -> int:
    raw = headers[-1]  # the server's Nats-Sequence follows any stored one
    start = raw.rindex(b"\r\nNats-Sequence: ") + 17
    return int(raw[start : raw.index(b"\r\n", start)])


async def _get_headers(
    nc: _FrameClient, api: str, stream: str, first: int, last: int
) -> list[bytes]:
    """The direct-get header blocks of every message of `stream` in `first`..`last`, in order."""
    got: list[bytes] = []
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def sink(subject: bytes, reply: bytes, headers: bytes, data: bytes) -> None:
        if _status(headers) is None:
            got.append(headers)
        elif not done.done():  # a status ("NATS/1.0 204 EOB") ends the batch
            done.set_result(None)

    nc.sinks[sub._id] = sink
    seq = first
    try:
        while seq <= last:
            done = loop.create_future()
            before = len(got)
            request = {"seq": seq, "batch": min(last - seq + 1, _PULL_BATCH)}
            await nc.publish(f"{api}.DIRECT.GET.{stream}", json.dumps(request).encode(), inbox)
            await asyncio.wait_for(done, 30)
            if len(got) == before:
                break  # nothing at or after `seq` (404), or no such stream (503)
            seq = _last_sequence(got) + 1
    finally:
        del nc.sinks[sub._id]
        await sub.unsubscribe()
    # A batch returns the next *existing* messages, which may lie past `last`.
    while got and _last_sequence(got) > last:
        got.pop()
    return got


@dataclass(frozen=True, slots=True)
class _Stamps:
    """Per message: its sequence in the stream it was read from, and its store time there."""

    seq: pa.Array
    time: pa.Array


def _store_times(headers: list[bytes]) -> _Stamps:
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
    return _Stamps(
        seq=pc.cast(fields["Nats-Sequence: "], pa.int64()),
        time=_timestamps(fields["Nats-Time-Stamp: "]),
    )


def _ack_stamps(acks: list[bytes]) -> _Stamps:
    """Stream sequence and store time of each delivery, from its ``$JS.ACK`` subject."""
    tokens = pc.split_pattern(pa.array(acks, pa.binary()), ".")
    count = pc.list_value_length(tokens)
    width = count[0].as_py() if acks else 9
    if not pc.all(pc.equal(count, width), min_count=0).as_py():
        raise IngestError("unexpected deliveries: $JS.ACK subjects of different layouts")
    seq, time = (pc.cast(pc.list_element(tokens, i), pa.string()) for i in _ack_fields(width))
    return _Stamps(seq=pc.cast(seq, pa.int64()), time=_timestamps(pc.cast(time, pa.int64())))


async def _read_range(options: SourceOptions, part: SeqRange) -> pa.RecordBatch:
    nc = await _connect(options)
    try:
        got = await _consume_range(nc, options, part)
        headers = _headers(pa.array(got.headers, pa.binary()))
        origin = _origin(headers)
        device_time = await _device_times(nc, options.api, origin)
        incarnation = await _incarnations(nc, options.api, origin)
        device_id, subject = _attribution(
            _text(pa.array(got.subjects, pa.binary())), origin.subject
        )
        offset = await _clock_offsets(nc, options.api, part.stream, device_id)
    finally:
        await nc.close()
    hub = _ack_stamps(got.acks)
    columns = {
        "device_id": device_id,
        "incarnation": incarnation,
        "subject": subject,
        "device_seq": origin.seq,
        "hub_stream": pa.array([part.stream] * len(got.acks), pa.string()),
        "hub_seq": hub.seq,
        "device_time": device_time,
        "hub_time": hub.time,
        "device_clock_offset_s": offset,
        "device_time_suspect": _suspect(device_time, hub.time, offset, options.clock_tolerance),
        "headers": headers,
        "payload": pa.array(got.data, pa.binary()),
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
        got = _store_times(await _get_headers(nc, api, mirror, lo.as_py(), hi.as_py()))
        found = pc.take(got.time, pc.index_in(origin.seq, value_set=got.seq))
        times = pc.if_else(rows, found, times)
    return times


async def _incarnations(nc: _FrameClient, api: str, origin: _Origin) -> pa.Array:
    """Each row's device incarnation, from the metadata of the hub mirror it came from (one
    mirror per incarnation, see `hub_ingest.provision`); null for a mirror without one."""
    names = pc.unique(origin.mirror.drop_null()).to_pylist()
    ids = []
    for mirror in names:
        reply = await nc.request(f"{api}.STREAM.INFO.{mirror}", b"", timeout=10)
        info = json.loads(reply.data)
        if "error" in info:
            raise IngestError(f"stream info {mirror}: {info['error'].get('description')}")
        ids.append(((info.get("config") or {}).get("metadata") or {}).get("incarnation"))
    return pc.take(
        pa.array(ids, pa.string()),
        pc.index_in(origin.mirror, value_set=pa.array(names, pa.string())),
    )


async def _clock_offsets(nc: _FrameClient, api: str, stream: str, device_id: pa.Array) -> pa.Array:
    """Each row's device clock offset (hub minus device, seconds) as the device's newest
    heartbeat reported it when the batch ran; null when unknown."""
    events = stream.replace("FLEET_TELEMETRY", "FLEET_EVENTS", 1)
    devices = pc.unique(device_id.drop_null()).to_pylist()
    offsets: list[float | None] = []
    for device in devices:
        request = {"last_by_subj": f"fleet.{device}.evt.{device}.heartbeat"}
        reply = await nc.request(f"{api}.DIRECT.GET.{events}", json.dumps(request).encode())
        try:
            beat = json.loads(reply.data) if reply.data else {}
        except ValueError:
            beat = {}
        # Only the device's own word on itself (see `hub_ingest.commands.attribute`).
        mine = isinstance(beat, dict) and beat.get("device_id") in (None, device)
        value = beat.get("clock_offset_s") if mine else None
        offsets.append(float(value) if isinstance(value, int | float) else None)
    at = pc.index_in(device_id, value_set=pa.array(devices, pa.string()))
    return pc.take(pa.array(offsets, pa.float64()), at)


def _suspect(
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
    """RFC 3339 times, or nanoseconds since the epoch, as UTC microseconds (Spark's precision)."""
    parsed = pc.cast(values, pa.timestamp("ns", tz="UTC"))
    return pc.cast(parsed, pa.timestamp("us", tz="UTC"), safe=False)
