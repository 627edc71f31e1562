"""The wire reader: JetStream deliveries cut straight off the wire, on nats-py internals.

Every dependency on nats-py's private parts is in this one file (`Client._process_msg`,
`Client._ps`, `nats.protocol.parser.Parser` and its `buf`, `state`, `AWAITING_CONTROL_LINE`),
pinned to the tested nats-py minor in pyproject.toml; `tests/test_wire.py` fails loudly when
they move. nats-py matches two regular expressions, copies a header block into a dict and
awaits a coroutine for every message: on bulk reads that was most of the read's CPU.

A range is read through an ephemeral pull consumer that starts at the range's first sequence
and acks nothing (deleted afterwards, or expiring 30 s after a dead task); deliveries carry
each message's stream sequence and store time in their ``$JS.ACK`` reply subject.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

from hub_ingest.archive.columns import ack_fields
from hub_ingest.core.errors import IngestError

log = structlog.get_logger(__name__)

PULL_BATCH = 10_000  # messages per pull or direct-get request
_PULL_BYTES = 16 << 20  # per pull: well under the 64 MiB a server lets a client fall behind
_MAX_BYTES = "409 Message Size Exceeds MaxBytes"
_CONSUMER_IDLE_S = 30.0  # a consumer left behind by a dead task goes after this


async def connect(servers: tuple[str, ...], creds: str | None) -> FrameClient:
    """A connection for one task: a few attempts, then the task fails (Spark retries it)."""
    # A JWT ``.creds`` file, or the bare NKey seed the hub's operators use.
    jwt = creds if creds and creds.endswith(".creds") else None
    nc = FrameClient()
    await nc.connect(
        list(servers),
        user_credentials=jwt,
        nkeys_seed=None if jwt else creds,
        connect_timeout=5,
        max_reconnect_attempts=3,
    )
    return nc


class FrameClient(Client):
    """A nats-py client that hands chosen subscriptions' messages over raw, through `sinks`.

    nats-py matches two regular expressions, copies a header block into a dict and awaits a
    coroutine for every message; on bulk reads that was most of the read's CPU.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sinks: dict[int, Sink] = {}
        self._ps = FrameParser(self)

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        sink = self.sinks.get(sid)
        if sink is None:
            await super()._process_msg(sid, subject, reply, data, headers)
        else:
            sink(subject, reply, headers or b"", data)


Sink = Callable[[bytes, bytes, bytes, bytes], None]  # subject, reply, headers, data


class FrameParser(Parser):
    """nats-py's protocol parser with a fast path: whole ``MSG`` and ``HMSG`` frames for a sink
    are cut out of the buffer here; anything else (and a frame not complete yet) is left to
    nats-py."""

    def __init__(self, nc: FrameClient) -> None:
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
class Deliveries:
    """Messages of one stream range as a consumer delivered them, in sequence order."""

    subjects: list[bytes] = field(default_factory=list)
    acks: list[bytes] = field(default_factory=list)  # reply subjects: $JS.ACK.<stream>…
    headers: list[bytes] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)

    def pop(self) -> None:
        for column in (self.subjects, self.acks, self.headers, self.data):
            column.pop()


def _ack_sequence(ack: bytes) -> int:
    tokens = ack.split(b".")
    return int(tokens[ack_fields(len(tokens))[0]])


async def consume_range(
    nc: FrameClient, api: str, *, domain: str | None, stream: str, first: int, last: int
) -> Deliveries:
    """Every message of the range, in order, through a short-lived pull consumer.

    A direct get stamps its reply headers into each message, and into a message that has
    stored headers (every sourced one) by rewriting them: measured on nats-server 2.15.1 that
    cost the server 3.5x a consumer delivery. The consumer acks nothing (the checkpoint
    stays the only cursor) and is deleted afterwards, or expires should this task die.
    """
    js = nc.jetstream(domain=domain)
    consumer = await js.add_consumer(
        stream,
        ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=first,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=_CONSUMER_IDLE_S,
            mem_storage=True,
            num_replicas=1,
        ),
    )
    got = Deliveries()
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
    pull = f"{api}.CONSUMER.MSG.NEXT.{stream}.{consumer.name}"
    seq = first
    try:
        while seq <= last:
            done, before = loop.create_future(), len(got.acks)
            due, budget = min(last - seq + 1, PULL_BATCH), max_bytes
            request = {"batch": due, "max_bytes": budget, "no_wait": True}
            await nc.publish(pull, json.dumps(request).encode(), inbox)
            ended = await asyncio.wait_for(done, 30)
            status = None if ended is None else _status(ended)
            if status is not None and status.startswith("404"):
                break  # nothing at or after `seq`
            # Max bytes ends this pull only; any other status would lose messages.
            if len(got.acks) == before or status not in (None, _MAX_BYTES):
                raise IngestError(f"pulling {stream} from seq {seq}: {status}")
            seq = _ack_sequence(got.acks[-1]) + 1
    finally:
        del nc.sinks[sub._id]
        await sub.unsubscribe()
        await _delete_consumer(js, stream, consumer.name)
    # A pull returns the next *existing* messages, which may lie past `last`.
    while got.acks and _ack_sequence(got.acks[-1]) > last:
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


async def get_headers(nc: FrameClient, api: str, stream: str, first: int, last: int) -> list[bytes]:
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
            request = {"seq": seq, "batch": min(last - seq + 1, PULL_BATCH)}
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
