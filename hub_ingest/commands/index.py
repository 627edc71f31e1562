"""The command index: what ``report`` and ``command status`` need of the command history,
kept up to date a little at a time so that neither reads the whole history on each call.

A KV bucket on the hub (``FLEET_COMMAND_INDEX``), written by whichever of them runs:

- ``cursor.<stream>``: how far the index has read ``COMMANDS`` or a ``FLEET_EVENTS`` shard
  (with the stream's creation time: a stream made anew is read from its start);
- ``cmd.<id>``: the ``COMMANDS`` sequence and subject of the command whose ``Nats-Msg-Id``
  is ``<id>`` (the first one, if an id came twice);
- ``res.<id>.<device>``: the decisive result of command ``<id>`` from ``<device>`` (see
  `supersedes`), and every result message folded into it;
- ``forged.<id>.<sender>``: results naming command ``<id>`` that ``<sender>`` sent in
  another device's name (see `hub_ingest.commands.attribution`);
- ``dev.<device>``: the device's `Tally`: results counted, failures, the last failure,
  which ``CMD_<device>`` sequences have a result, and how far each shard was read for it.

Command ids become ``<id>`` base64url-encoded (an id may hold any character).

Each call first reads what was stored since the cursors (`catch_up`): the first call on a hub
reads its whole history once, later ones only what is new. A message is folded in exactly
once however often a fold is cut short or runs twice at the same time: a device's tally
carries its own read position and is replaced only if nobody changed it meanwhile, and a
result entry records each message folded into it with the effect it had.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import (
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from edge_agent.protocol.envelope import supersedes
from edge_agent.protocol.names import HUB_COMMANDS
from hub_ingest.commands.attribution import Attribution, attribute
from hub_ingest.core.buckets import COMMAND_INDEX, bucket_keys, bucket_stream, open_bucket
from hub_ingest.core.errors import ReportError

BUCKET = COMMAND_INDEX
RESULT_FILTER = "fleet.*.evt.*.result"
_BATCH = 256
_WRITE_ATTEMPTS = 10  # optimistic writes that lost a race are retried this often

Span = tuple[int, int]  # an inclusive range of CMD_<id> sequences


def json_object(data: bytes | None) -> dict[str, Any] | None:
    try:
        value = json.loads(data or b"")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _tally_key(device_id: str) -> str:
    return f"dev.{device_id}"


# The bucket's stream and where a device's tally is in it: the report reads every device's
# in batched direct gets of each subject's last value (a request per 256 devices, where
# `CommandIndex.tally` costs one each).
TALLY_STREAM = bucket_stream(BUCKET)


def tally_subject(device_id: str) -> str:
    return f"$KV.{BUCKET}.{_tally_key(device_id)}"


def _id_key(command_id: str) -> str:
    return base64.urlsafe_b64encode(command_id.encode()).decode().rstrip("=")


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True)
class LastError:
    command_id: str | None
    status: str
    error: str | None
    seq: int  # of the result message in its FLEET_EVENTS shard


@dataclass(frozen=True, slots=True)
class Tally:
    """One device's results as far as the index has read them.

    Which ``CMD_<id>`` sequences have a result is kept as `high` (the highest answered) and
    `gaps` (ranges below it still without one): small, however long the history, since a
    device answers its commands in order; a gap lasts only while a command is unanswered.
    """

    done: int = 0  # commands answered (results without a command id count one each)
    failed: int = 0  # decisive results with a status other than "ok"
    last_error: LastError | None = None
    high: int = 0
    gaps: tuple[Span, ...] = ()
    forged: int = 0  # results sent in another device's name
    forged_example: str | None = None
    read: Mapping[str, int] = field(default_factory=dict)  # "<shard>@<created>" -> last seq

    def answered(self, seq: int) -> Tally:
        """With ``CMD_<id>`` sequence `seq` answered."""
        if seq > self.high:
            gap = (self.high + 1, seq - 1)
            return replace(
                self, high=seq, gaps=(*self.gaps, gap) if gap[0] <= gap[1] else self.gaps
            )
        left: list[Span] = []
        for lo, hi in self.gaps:
            if lo <= seq <= hi:
                left += [s for s in ((lo, seq - 1), (seq + 1, hi)) if s[0] <= s[1]]
            else:
                left.append((lo, hi))
        return replace(self, gaps=tuple(left))

    def unanswered(self, first: int, last: int) -> list[Span]:
        """The sequences in ``first..last`` (what ``CMD_<id>`` holds) without a result."""
        spans = [*self.gaps, (self.high + 1, last)]
        clipped = [(max(lo, first), min(hi, last)) for lo, hi in spans]
        return [(lo, hi) for lo, hi in clipped if lo <= hi]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Tally:
        fields: dict[str, Any] = json.loads(data)
        last = fields.pop("last_error")
        gaps = tuple((lo, hi) for lo, hi in fields.pop("gaps"))
        return cls(**fields, gaps=gaps, last_error=LastError(**last) if last else None)


@dataclass(frozen=True, slots=True)
class IndexedCommand:
    seq: int  # in COMMANDS
    subject: str


@dataclass(frozen=True, slots=True)
class _Effect:
    """What one result message did to a command's answer from one device."""

    before: str | None  # the decisive status before it (None: it was the first answer)
    after: str  # the decisive status after it


async def read_range(
    js: JetStreamContext, stream: str, subject: str, first: int, last: int
) -> AsyncGenerator[list[Msg], None]:
    """The messages of `stream` on `subject` with sequences ``first..last``, in batches."""
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=first,
        mem_storage=True,
        # Removed by the server even if this process dies before deleting it.
        inactive_threshold=60.0,
    )
    try:
        sub = await js.pull_subscribe(subject, stream=stream, config=config)
    except NotFoundError:
        return
    info = await sub.consumer_info()
    try:
        pending = info.num_pending or 0
        while pending > 0:
            batch = await _fetch(sub, min(pending, _BATCH))
            keep = [m for m in batch if _seq(m) <= last]
            if keep:
                yield keep
            if len(keep) < len(batch):
                return
            pending = batch[-1].metadata.num_pending or 0
    finally:
        await sub.unsubscribe()
        if info.name is not None:
            await js.delete_consumer(stream, info.name)


@retry(
    retry=retry_if_exception_type(ServiceUnavailableError),
    stop=stop_after_attempt(5),
    wait=wait_exponential_jitter(multiplier=0.2, jitter=0.2, max=2.0),
    reraise=True,
)
async def _fetch(sub: JetStreamContext.PullSubscription, count: int) -> list[Msg]:
    # On a busy cluster a consumer just made answers 503 (no responders) until its leader
    # is up (seen on an R3 hub with 200 devices): asked again, a few times.
    return await sub.fetch(count, timeout=10)


_Fold = Callable[[str, list[Msg]], Awaitable[None]]


def _seq(msg: Msg) -> int:
    sequence = msg.metadata.sequence
    return sequence.stream if sequence else 0


class CommandIndex:
    def __init__(self, js: JetStreamContext, kv: KeyValue) -> None:
        self._js = js
        self._kv = kv

    @classmethod
    async def open(cls, js: JetStreamContext, replicas: int = 1) -> CommandIndex:
        """The index, made (with `replicas`: the hub's, see `HubConfig.replicas`) if missing."""
        return cls(js, await open_bucket(js, BUCKET, replicas=replicas, direct=True))

    async def catch_up(self, event_streams: Iterable[str], *, commands: bool = True) -> None:
        """Read what the `event_streams` (and ``COMMANDS``) stored since the last call."""
        if commands:
            await self._fold(HUB_COMMANDS, "cmd.>", self._fold_commands)
        for stream in event_streams:
            await self._fold(stream, RESULT_FILTER, self._fold_results)

    async def command(self, command_id: str) -> IndexedCommand | None:
        value = await self._get(f"cmd.{_id_key(command_id)}")
        return None if value is None else IndexedCommand(value["seq"], value["subject"])

    async def answers(self, command_id: str) -> dict[str, dict[str, Any]]:
        """The decisive result of `command_id` from each device that answered it."""
        found = await self._matching(f"res.{_id_key(command_id)}.*")
        return {key.rsplit(".", 1)[1]: value["result"] for key, value in found.items()}

    async def forgeries(self, command_id: str) -> list[str]:
        """``<sender>: <what it claimed>`` for each result naming `command_id` that a device
        sent in another's name."""
        found = await self._matching(f"forged.{_id_key(command_id)}.*")
        return [
            f"{key.rsplit('.', 1)[1]}: {claim}"
            for key, claims in found.items()
            for claim in claims.values()
        ]

    async def tally(self, device_id: str) -> Tally:
        entry = await self._entry(_tally_key(device_id))
        return Tally() if entry is None else Tally.from_json(entry[0])

    # Reading the streams.

    async def _fold(self, stream: str, subject: str, fold: _Fold) -> None:
        try:
            info = await self._js.stream_info(stream)
        except NotFoundError:
            return
        created = str(info.created)
        cursor = await self._get(f"cursor.{stream}") or {}
        start = cursor.get("seq", 0) + 1 if cursor.get("created") == created else 1
        if start > info.state.last_seq:
            return
        position = f"{stream}@{created}"
        async for batch in read_range(self._js, stream, subject, start, info.state.last_seq):
            await fold(position, batch)
            cursor = {"created": created, "seq": _seq(batch[-1])}
            await self._kv.put(f"cursor.{stream}", json.dumps(cursor).encode())

    async def _fold_commands(self, position: str, batch: list[Msg]) -> None:
        first: dict[str, Msg] = {}
        for msg in batch:
            command_id = (msg.headers or {}).get("Nats-Msg-Id")
            if command_id:  # `command status` finds commands by their Nats-Msg-Id only
                first.setdefault(command_id, msg)
        await asyncio.gather(*(self._index_command(c, msg) for c, msg in first.items()))

    async def _index_command(self, command_id: str, msg: Msg) -> None:
        value = {"seq": _seq(msg), "subject": msg.subject}
        # Indexed already (by an earlier, interrupted fold, or an older copy): the first stays.
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self._kv.create(f"cmd.{_id_key(command_id)}", json.dumps(value).encode())

    async def _fold_results(self, position: str, batch: list[Msg]) -> None:
        by_sender: dict[str, list[Msg]] = {}
        for msg in batch:
            by_sender.setdefault(msg.subject.split(".")[1], []).append(msg)
        for device_id, msgs in by_sender.items():
            await self._fold_device(device_id, position, msgs)

    async def _fold_device(self, device_id: str, position: str, msgs: list[Msg]) -> None:
        key = _tally_key(device_id)
        for _ in range(_WRITE_ATTEMPTS):
            entry = await self._entry(key)
            tally = Tally() if entry is None else Tally.from_json(entry[0])
            mark = tally.read.get(position, 0)
            todo = [msg for msg in msgs if _seq(msg) > mark]
            if not todo:
                return  # folded already, by a fold that ran at the same time
            effects = await self._effects(todo)
            for msg in todo:
                tally = _folded(tally, msg, effects.get(_seq(msg)))
            tally = replace(tally, read={**tally.read, position: _seq(todo[-1])})
            try:
                if entry is None:
                    await self._kv.create(key, tally.to_json())
                else:
                    await self._kv.update(key, tally.to_json(), last=entry[1])
            except KeyWrongLastSequenceError:
                continue  # another fold came first: read again, skip what it folded
            return
        raise ReportError(f"{BUCKET}: {key} kept changing under the update")

    async def _effects(self, msgs: list[Msg]) -> dict[int, _Effect]:
        """What each result with a command id did to that command's answer, by result
        sequence: one command's results in order, different commands at the same time."""
        by_command: dict[tuple[str, str], list[_Parsed]] = {}
        for msg in msgs:
            parsed = _Parsed.of(msg)
            if parsed.command_id is None:
                continue
            if parsed.sender.trusted:
                by_command.setdefault((parsed.command_id, parsed.device_id), []).append(parsed)
            else:
                await self._note_forgery(parsed.command_id, parsed.sender, parsed.seq)

        async def answer(results: list[_Parsed]) -> list[tuple[int, _Effect]]:
            return [(r.seq, await self._answer(r)) for r in results]

        done = await asyncio.gather(*(answer(results) for results in by_command.values()))
        return {seq: effect for effects in done for seq, effect in effects}

    async def _answer(self, result: _Parsed) -> _Effect:
        """Fold one result into its device's answer to its command (once per message)."""
        assert result.command_id is not None
        seq, status = result.seq, result.status
        key = f"res.{_id_key(result.command_id)}.{result.device_id}"
        for _ in range(_WRITE_ATTEMPTS):
            entry = await self._entry(key)
            answer = json_object(entry[0]) if entry else None
            steps: list[list[Any]] = (answer or {}).get("steps", [])
            done = next((s for s in steps if s[0] == seq), None)
            if done is not None:
                return _Effect(done[1], done[2])  # folded before, by an interrupted fold
            before = None if answer is None else str(answer["status"])
            after = status if before is None or supersedes(status, before) else before
            decisive = result.body if after != before else (answer or {}).get("result")
            value = {"status": after, "result": decisive, "steps": [*steps, [seq, before, after]]}
            try:
                if entry is None:
                    await self._kv.create(key, json.dumps(value).encode())
                else:
                    await self._kv.update(key, json.dumps(value).encode(), last=entry[1])
            except KeyWrongLastSequenceError:
                continue
            return _Effect(before, after)
        raise ReportError(f"{BUCKET}: {key} kept changing under the update")

    async def _note_forgery(self, command_id: str, sender: Attribution, seq: int) -> None:
        key = f"forged.{_id_key(command_id)}.{sender.device_id or '_'}"
        claims = await self._get(key) or {}
        claims[str(seq)] = sender.forgery
        await self._kv.put(key, json.dumps(claims).encode())

    # The bucket.

    async def _entry(self, key: str) -> tuple[bytes, int] | None:
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return None
        assert entry.value is not None and entry.revision is not None
        return entry.value, entry.revision

    async def _get(self, key: str) -> dict[str, Any] | None:
        entry = await self._entry(key)
        return None if entry is None else json_object(entry[0])

    async def _matching(self, pattern: str) -> dict[str, dict[str, Any]]:
        """Every key matching `pattern` and its value (keys as `bucket_keys` lists them: a
        KV watcher left answers out under load)."""
        found: dict[str, dict[str, Any]] = {}
        for key in await bucket_keys(self._js, BUCKET, pattern):
            try:
                entry = await self._kv.get(key)
            except KeyNotFoundError:  # deleted or purged since
                continue
            if (value := json_object(entry.value)) is not None:
                found[key] = value
        return found


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A result message as the index reads it."""

    seq: int  # in its FLEET_EVENTS shard
    body: dict[str, Any]
    sender: Attribution
    device_id: str  # the sender, from the subject
    command_id: str | None
    status: str

    @classmethod
    def of(cls, msg: Msg) -> _Parsed:
        body = json_object(msg.data) or {}
        command_id = body.get("command_id")
        return cls(
            seq=_seq(msg),
            body=body,
            sender=attribute(msg.subject, body, "result"),
            device_id=msg.subject.split(".")[1],
            command_id=command_id if isinstance(command_id, str) else None,
            status=str(body.get("status", "unknown")),
        )


def _folded(tally: Tally, msg: Msg, effect: _Effect | None) -> Tally:
    """`tally` with the result `msg` counted; `effect`: what it did to its command's answer
    (None: it has no command id, or is forged)."""
    result = _Parsed.of(msg)
    if not result.sender.trusted:
        example = tally.forged_example or result.sender.forgery
        return replace(tally, forged=tally.forged + 1, forged_example=example)
    if (command_seq := _count(result.body.get("seq"))) is not None and command_seq > 0:
        tally = tally.answered(command_seq)
    # A result without a command id has nothing to match: each one counts.
    effect = effect or _Effect(None, result.status)
    tally = _counted(tally, effect)
    if effect.after == result.status != "ok" and effect.before != result.status:
        error = result.body.get("error")
        last = LastError(
            result.command_id, result.status, None if error is None else str(error), result.seq
        )
        if tally.last_error is None or last.seq > tally.last_error.seq:
            tally = replace(tally, last_error=last)
    return tally


def _counted(tally: Tally, effect: _Effect) -> Tally:
    if effect.before is None:
        failed = tally.failed + (effect.after != "ok")
        return replace(tally, done=tally.done + 1, failed=failed)
    change = (effect.after != "ok") - (effect.before != "ok")
    return replace(tally, failed=tally.failed + change)
