"""``jetstream``: a PySpark streaming data source over the hub's aggregate streams; the Spark
face (options, planning, offsets, partitions) and the assembly of each partition's rows, from
the wire reader (`hub_ingest.ingest.wire`) and the Arrow columns (`hub_ingest.archive.columns`).

Offsets are ``{stream: last sequence read}``, kept only in Spark's checkpoint: nothing is
acknowledged on the server, so the checkpoint is the single cursor (as with Spark's Kafka
source) and a batch re-run after a crash reads exactly the same sequence range again. Beside
them, ``"made"`` holds when each stream was made (`hub_ingest.fleet.streams.made_at`): a
stream made anew under the same name (deleted and provisioned again, or on a hub that lost
its store) numbers from 1 again, and is read from there, not from the old one's offset.
Partitions are sequence ranges of one stream. An executor reads its range through an
ephemeral pull consumer that starts at the range's first sequence and acks nothing (it is
deleted after the read, or expires if the task dies); deliveries carry each message's stream
sequence and store time in their ``$JS.ACK`` reply subject. The consumer delivers the next
*existing* messages, so deliveries are clipped to the range and deleted sequences are simply
absent.

Rows are attributed from the aggregate's conventions (see `hub_ingest.fleet.provision`): the subject
``fleet.<device>.<subject>`` names the device, and ``Nats-Stream-Source`` the stream it was
sourced from (the hub's mirror of the device stream), the sequence there (the device's own,
since a mirror keeps sequences) and the subject as published. Sourcing stamps the hub's
arrival time, so ``device_time`` is read from that mirror (batch direct gets,
``$JS.API.DIRECT.GET.<stream>`` with ``{"seq", "batch"}``), which keeps the device's store
times; the aggregate is sourced from the mirror, so the mirror always has the row already.
A row whose mirror copy retention has since removed gets a null ``device_time``.
A pack of readings (``Edge-Pack``, `edge_agent.protocol.pack`) becomes one row per reading,
with the reading's own sequence, subject, store time, headers and payload
(`hub_ingest.archive.columns.unpack`).

Options (keys arrive lower-cased): ``servers`` (comma-separated URLs), ``credentials``,
``streams`` (or ``stream``; comma-separated), ``domain``, ``maxMessagesPerTrigger``,
``messagesPerPartition``, ``minPartitions``, ``failOnDataLoss``, ``clockTolerance`` (seconds).

A batch is cut into ranges of at most ``messagesPerPartition`` sequences, and smaller ones
when that would leave fewer than ``minPartitions`` tasks (the job passes the cluster's
executor cores: a small batch still keeps every core reading). The ranges are interleaved
across streams, so that the tasks running at any moment read every aggregate stream (each
may be led by another hub node) rather than all the first one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import structlog
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from edge_agent.protocol.names import js_api
from hub_ingest.archive.columns import (
    Origin,
    ack_stamps,
    as_text,
    attribution,
    header_map,
    origin_of,
    store_times,
    suspect,
    unpack,
)
from hub_ingest.core import failpoints
from hub_ingest.core.errors import ConfigError, DataLossError, IngestError
from hub_ingest.fleet.latest import heartbeat_subject
from hub_ingest.fleet.streams import made_at
from hub_ingest.ingest.wire import FrameClient, connect, consume_range, get_headers

log = structlog.get_logger(__name__)

_STREAM_NOT_FOUND = 10059  # JetStream's error code

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


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """The parsed options; small and picklable, because the reader travels to every task."""

    servers: tuple[str, ...]
    streams: tuple[str, ...]
    credentials: str | None = None
    domain: str | None = None
    max_messages_per_trigger: int | None = None
    messages_per_partition: int = 50_000
    min_partitions: int = 1
    fail_on_data_loss: bool = True
    clock_tolerance: float = 120.0  # seconds; see `suspect`

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
            min_partitions=count("minpartitions") or 1,
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
    made: str  # `made_at`


_MADE = "made"  # the offsets' key for when each stream was made


def _remade(start: Mapping[str, Any], made: Mapping[str, str], name: str) -> bool:
    """Whether `name` was made anew since the offsets `start` (which then do not apply)."""
    then = (start.get(_MADE) or {}).get(name)
    return then is not None and then != made.get(name)


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

    def initialOffset(self) -> dict[str, Any]:
        states = self._states()
        return {name: _before(state) for name, state in states.items()} | _made_offsets(states)

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_messages_per_trigger
        return ReadAllAvailable() if limit is None else ReadMaxRows(limit)

    def prepareForTriggerAvailableNow(self) -> None:
        # Messages arriving after this call belong to the next run.
        self._target = {name: s.last_seq for name, s in self._states().items()}

    def reportLatestOffset(self) -> dict[str, Any]:
        states = self._states()
        return {name: s.last_seq for name, s in states.items()} | _made_offsets(states)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        states = self._states()
        made = {name: state.made for name, state in states.items()}
        end: dict[str, int] = {}
        available: dict[str, int] = {}
        for name, state in states.items():
            if name not in start:
                # A stream new to this query starts where it stands now; `partitions` reads
                # nothing of it in this batch, so the batch stays deterministic.
                end[name] = _before(state)
                continue
            begin = start[name]
            if _remade(start, made, name):
                log.warning("aggregate_made_anew", stream=name, read_to=begin, made=state.made)
                begin = 0
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
        # Never move backwards on the same stream (a purge keeps its last sequence).
        return {
            name: seq if _remade(start, made, name) else max(seq, start.get(name, seq))
            for name, seq in end.items()
        } | _made_offsets(states)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[SeqRange]:
        # A stream new to the query reads nothing in this batch (see `latestOffset`); one
        # made anew reads from its start.
        made = end.get(_MADE) or {}
        ranges = {
            name: ((0 if _remade(start, made, name) else start.get(name, seq)) + 1, seq)
            for name, seq in sorted(end.items())
            if name != _MADE
        }
        total = sum(max(last - first + 1, 0) for first, last in ranges.values())
        step = min(
            self.options.messages_per_partition, _ceil_div(total, self.options.min_partitions)
        )
        per_stream = [
            [SeqRange(name, lo, min(lo + step - 1, last)) for lo in range(first, last + 1, step)]
            for name, (first, last) in ranges.items()
        ]
        # Spark starts tasks in partition order: one range of each stream in turn.
        waves = itertools.zip_longest(*per_stream)
        return [part for wave in waves for part in wave if part is not None]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SeqRange)
        if partition.first > 1:
            failpoints.reach("mid_write")
        yield asyncio.run(_read_range(self.options, partition))

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: the checkpoint, not the server, remembers what was read."""


def _made_offsets(states: Mapping[str, StreamState]) -> dict[str, dict[str, str]]:
    return {_MADE: {name: state.made for name, state in states.items()}}


def _before(state: StreamState) -> int:
    """The offset just before the oldest message still in the stream."""
    return max(state.first_seq - 1, 0) if state.messages else state.last_seq


def _ceil_div(total: int, parts: int) -> int:
    return max(-(-total // parts), 1)


def _share(available: dict[str, int], budget: int | None) -> dict[str, int]:
    """How many sequences to take from each stream, at most `budget` in all."""
    total = sum(available.values())
    if budget is None or total <= budget:
        return available
    shares = {name: budget * n // total for name, n in available.items()}
    # Rounding down can leave a stream at zero for ever; give each at least one.
    return {name: max(share, min(available[name], 1)) for name, share in shares.items()}


async def _stream_states(options: SourceOptions) -> dict[str, StreamState]:
    nc = await connect(options.servers, options.credentials)
    try:
        js = nc.jetstream(domain=options.domain)
        states = {}
        for name in options.streams:
            info = await js.stream_info(name)
            s = info.state
            states[name] = StreamState(s.first_seq, s.last_seq, s.messages, made_at(info))
        return states
    finally:
        await nc.close()


async def _read_range(options: SourceOptions, part: SeqRange) -> pa.RecordBatch:
    nc = await connect(options.servers, options.credentials)
    try:
        got = await consume_range(
            nc,
            options.api,
            domain=options.domain,
            stream=part.stream,
            first=part.first,
            last=part.last,
        )
        headers = header_map(pa.array(got.headers, pa.binary()))
        origin = origin_of(headers)
        device_time = pc.coalesce(origin.time, await _device_times(nc, options.api, origin))
        incarnation = await _incarnations(nc, options.api, origin)
        device_id, subject = attribution(
            as_text(pa.array(got.subjects, pa.binary())), origin.subject
        )
        offset = await _clock_offsets(nc, options.api, part.stream, device_id)
    finally:
        await nc.close()
    hub = ack_stamps(got.acks)
    columns: dict[str, pa.Array] = {
        "device_id": device_id,
        "incarnation": incarnation,
        "subject": subject,
        "device_seq": origin.seq,
        "hub_stream": pa.array([part.stream] * len(got.acks), pa.string()),
        "hub_seq": hub.seq,
        "device_time": device_time,
        "hub_time": hub.time,
        "device_clock_offset_s": offset,
        "headers": headers,
        "payload": pa.array(got.data, pa.binary()),
    }
    columns = unpack(columns, ARROW_SCHEMA)
    columns["device_time_suspect"] = suspect(
        columns["device_time"],
        columns["hub_time"],
        columns["device_clock_offset_s"],
        options.clock_tolerance,
    )
    return pa.RecordBatch.from_pydict(columns, schema=ARROW_SCHEMA)


async def _device_times(nc: FrameClient, api: str, origin: Origin) -> pa.Array:
    """Each row's store time on the device, read from the hub mirror it was sourced from."""
    times = pa.nulls(len(origin.seq), ARROW_SCHEMA.field("device_time").type)
    for mirror in pc.unique(origin.mirror.drop_null()).to_pylist():
        rows = pc.fill_null(pc.equal(origin.mirror, mirror), False)
        lo, hi = pc.min_max(pc.filter(origin.seq, rows)).values()
        got = store_times(await get_headers(nc, api, mirror, lo.as_py(), hi.as_py()))
        found = pc.take(got.time, pc.index_in(origin.seq, value_set=got.seq))
        times = pc.if_else(rows, found, times)
    return times


async def _incarnations(nc: FrameClient, api: str, origin: Origin) -> pa.Array:
    """Each row's device incarnation, from the metadata of the hub mirror it came from (one
    mirror per incarnation, see `hub_ingest.fleet.provision`); null for a mirror without one,
    or one deleted since (by hand: the product keeps them), whose rows are archived still."""
    names = pc.unique(origin.mirror.drop_null()).to_pylist()
    ids: list[str | None] = []
    for mirror in names:
        reply = await nc.request(f"{api}.STREAM.INFO.{mirror}", b"", timeout=10)
        info = json.loads(reply.data)
        if (info.get("error") or {}).get("err_code") == _STREAM_NOT_FOUND:
            rows = pc.sum(pc.fill_null(pc.equal(origin.mirror, mirror), False)).as_py()
            log.warning("origin_mirror_missing", mirror=mirror, rows=rows)
            ids.append(None)
            continue
        if "error" in info:
            raise IngestError(f"stream info {mirror}: {info['error'].get('description')}")
        ids.append(((info.get("config") or {}).get("metadata") or {}).get("incarnation"))
    return pc.take(
        pa.array(ids, pa.string()),
        pc.index_in(origin.mirror, value_set=pa.array(names, pa.string())),
    )


async def _clock_offsets(nc: FrameClient, api: str, stream: str, device_id: pa.Array) -> pa.Array:
    """Each row's device clock offset (hub minus device, seconds) as the device's newest
    heartbeat reported it when the batch ran; null when unknown."""
    events = stream.replace("FLEET_TELEMETRY", "FLEET_EVENTS", 1)
    devices = pc.unique(device_id.drop_null()).to_pylist()
    offsets: list[float | None] = []
    for device in devices:
        request = {"last_by_subj": heartbeat_subject(device)}
        reply = await nc.request(f"{api}.DIRECT.GET.{events}", json.dumps(request).encode())
        try:
            beat = json.loads(reply.data) if reply.data else {}
        except ValueError:
            beat = {}
        # Only the device's own word on itself (see `hub_ingest.commands.send.attribute`).
        mine = isinstance(beat, dict) and beat.get("device_id") in (None, device)
        value = beat.get("clock_offset_s") if mine else None
        offsets.append(float(value) if isinstance(value, int | float) else None)
    at = pc.index_in(device_id, value_set=pa.array(devices, pa.string()))
    return pc.take(pa.array(offsets, pa.float64()), at)
