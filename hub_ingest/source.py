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
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import structlog
from nats.aio.client import Client
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from hub_ingest.errors import ConfigError, DataLossError

log = structlog.get_logger(__name__)
T = TypeVar("T")

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
    """A nats-py client that hands chosen subscriptions' frames over unparsed.

    nats-py parses every header block into a dict before a callback sees it; on sourced
    messages that was most of the read path's CPU. Direct-get replies are parsed here
    instead, once, into exactly what a row needs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sinks: dict[int, Callable[[bytes, bytes], None]] = {}

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        sink = self.sinks.get(sid)
        if sink is None:
            await super()._process_msg(sid, subject, reply, data, headers)
        else:
            sink(headers, data)


@dataclass(slots=True)
class _Message:
    seq: int
    subject: str
    time: str
    headers: dict[str, str]
    data: bytes


def _status(raw: bytes) -> int:
    """The status of a frame that ends a batch ("NATS/1.0 204 EOB"), or 0 for a message."""
    return int(raw[9:12]) if raw[8:9] == b" " else 0


def _reply_header(raw: bytes, name: bytes) -> bytes:
    # The server appends its reply headers after the stored ones: search from the end.
    start = raw.rindex(b"\r\n" + name + b": ") + len(name) + 4
    return raw[start : raw.index(b"\r\n", start)]


def _parse(raw: bytes, data: bytes) -> tuple[int, _Message] | int:
    """A direct-get reply as (seq, message), or the status code that ends a batch."""
    status = _status(raw)
    if status:
        return status
    # Stored headers come first ("NATS/1.0\r\n" before them); the server's reply headers
    # start at its Nats-Stream line.
    headers = {}
    for line in raw[10 : raw.rindex(b"\r\nNats-Stream: ")].decode("utf-8", "replace").split("\r\n"):
        name, sep, value = line.partition(":")
        if sep:
            headers[name] = value.strip()
    seq = int(_reply_header(raw, b"Nats-Sequence"))
    subject = _reply_header(raw, b"Nats-Subject").decode()
    return seq, _Message(
        seq, subject, _reply_header(raw, b"Nats-Time-Stamp").decode(), headers, data
    )


def _parse_time(raw: bytes, data: bytes) -> tuple[int, tuple[int, str]] | int:
    """Only (seq, (seq, store time)) of a direct-get reply: all a mirror is read for."""
    status = _status(raw)
    if status:
        return status
    seq = int(_reply_header(raw, b"Nats-Sequence"))
    return seq, (seq, _reply_header(raw, b"Nats-Time-Stamp").decode())


async def _get_range(
    nc: _FrameClient,
    api: str,
    stream: str,
    first: int,
    last: int,
    *,
    parse: Callable[[bytes, bytes], tuple[int, T] | int],
) -> list[T]:
    """What `parse` makes of every message of `stream` in `first`..`last`, in order."""
    out: list[T] = []
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    seq = first

    def sink(raw: bytes, data: bytes) -> None:
        nonlocal seq
        parsed = parse(raw, data)
        if isinstance(parsed, int):
            if not done.done():
                done.set_result(parsed)
        elif parsed[0] <= last:
            seq = parsed[0] + 1
            out.append(parsed[1])

    nc.sinks[sub._id] = sink
    try:
        while seq <= last:
            done = loop.create_future()
            before = len(out)
            request = {"seq": seq, "batch": min(last - seq + 1, _GET_BATCH)}
            await nc.publish(f"{api}.DIRECT.GET.{stream}", json.dumps(request).encode(), inbox)
            await asyncio.wait_for(done, 30)
            if len(out) == before:
                break  # nothing at or after `seq` (404), only beyond `last`, or no stream (503)
    finally:
        del nc.sinks[sub._id]
        await sub.unsubscribe()
    return out


async def _read_range(options: SourceOptions, part: SeqRange) -> pa.RecordBatch:
    nc = await _connect(options)
    try:
        msgs = await _get_range(nc, options.api, part.stream, part.first, part.last, parse=_parse)
        origins = [_origin(m) for m in msgs]
        device_times = await _device_times(nc, options, origins)
    finally:
        await nc.close()
    columns: dict[str, list[Any]] = {name: [] for name in ARROW_SCHEMA.names}
    for msg, origin in zip(msgs, origins, strict=True):
        device_id, _, rest = msg.subject.removeprefix("fleet.").partition(".")
        stream, device_seq, subject = origin if origin else ("", None, rest)
        columns["device_id"].append(device_id if rest else None)
        columns["subject"].append(subject or rest or msg.subject)
        columns["device_seq"].append(device_seq)
        columns["hub_stream"].append(part.stream)
        columns["hub_seq"].append(msg.seq)
        columns["device_time"].append(device_times.get((stream, device_seq or 0)))
        columns["hub_time"].append(msg.time)
        columns["headers"].append(list(msg.headers.items()))
        columns["payload"].append(msg.data)
    for name in ("device_time", "hub_time"):
        columns[name] = _timestamps(columns[name])
    return pa.RecordBatch.from_pydict(columns, schema=ARROW_SCHEMA)


_Origin = tuple[str, int, str]


def _origin(msg: _Message) -> _Origin | None:
    """(origin stream, its sequence, subject there) from ``Nats-Stream-Source``."""
    source = msg.headers.get("Nats-Stream-Source")
    if not source:
        return None
    fields = source.split(" ")
    subject = fields[4] if len(fields) > 4 else ""
    return fields[0].partition(":")[0], int(fields[1]), subject


async def _device_times(
    nc: _FrameClient, options: SourceOptions, origins: list[_Origin | None]
) -> dict[tuple[str, int], str]:
    """(mirror, seq) → store time on the device, read from the hub's mirrors of its streams."""
    wanted: dict[str, set[int]] = {}
    for origin in origins:
        if origin is not None:
            wanted.setdefault(origin[0], set()).add(origin[1])
    times: dict[tuple[str, int], str] = {}
    for mirror, seqs in wanted.items():
        got = await _get_range(nc, options.api, mirror, min(seqs), max(seqs), parse=_parse_time)
        times.update(((mirror, seq), time) for seq, time in got if seq in seqs)
    return times


def _timestamps(values: list[str | None]) -> pa.Array:
    """RFC 3339 nanosecond times as UTC microseconds (Spark's precision)."""
    parsed = pc.cast(pa.array(values, pa.string()), pa.timestamp("ns", tz="UTC"))
    return pc.cast(parsed, pa.timestamp("us", tz="UTC"), safe=False)
