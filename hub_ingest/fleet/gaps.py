"""The gaps' contract: what the refill (`fleet.refill`) records and delivers, read by
provision, the ingest's columns, `report` and `audit`.

- ``FLEET_REFILL``: one subject per ``(mirror, seq)``,
  ``refill.<aggregate>.<mirror>.<seq>.<device>.<subject>``; each aggregate sources it with the
  transform ``refill.<aggregate>.*.*.>`` → ``fleet.>``;
- a refilled message's ``Edge-Refill-Of: <mirror> <device seq> <subject> <device store time>``
  and ``Edge-Refill-Msg-Id`` (the app's ``Nats-Msg-Id``);
- the ``FLEET_GAPS`` bucket: per mirror, a `MirrorGaps` record.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
    SubjectTransform,
)
from nats.js.kv import KeyValue

from edge_agent.protocol.pack import PACK_HEADER, pack_range
from hub_ingest.core.buckets import GAPS, bucket_values
from hub_ingest.core.config import HubConfig
from hub_ingest.fleet.registry import Device, Incarnation, Registry
from hub_ingest.fleet.streams import DEFAULT_DEDUP_WINDOW, MANAGED_BY, dedup_window, mirror_name

REFILL_STREAM = "FLEET_REFILL"
REFILL_HEADER = "Edge-Refill-Of"  # <mirror> <device seq> <subject> <device store time>
# A row's ``Nats-Stream-Source`` (``<stream>[:<hash>] <seq> …``) when it came from FLEET_REFILL.
FROM_REFILL = f"^{REFILL_STREAM}[: ]"
MSG_ID_HEADER = "Edge-Refill-Msg-Id"
BUCKET = GAPS
LOST_REASONS = ("evicted", "reimaged", "deleted_on_device")


def refill_stream(config: HubConfig) -> StreamConfig:
    """``FLEET_REFILL``: refilled readings, one subject each, kept as long as the aggregates."""
    return StreamConfig(
        name=REFILL_STREAM,
        subjects=["refill.>"],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        duplicate_window=dedup_window(DEFAULT_DEDUP_WINDOW, config.aggregates.max_age),
        max_bytes=config.aggregates.max_bytes,
        max_age=config.aggregates.max_age,
        allow_direct=True,
        metadata=dict(MANAGED_BY),
        num_replicas=config.replicas,
    )


def refill_source(aggregate_stream: str) -> StreamSource:
    """How an aggregate takes its refilled readings, under the subjects it gives all others."""
    return StreamSource(
        name=REFILL_STREAM,
        subject_transforms=[
            SubjectTransform(src=f"refill.{aggregate_stream}.*.*.>", dest="fleet.>")
        ],
    )


def refill_of(headers: Mapping[str, str]) -> str | None:
    """``Edge-Refill-Of`` of a row its aggregate sourced from ``FLEET_REFILL``; None for any
    other row, whose header an app on its device set (the island and the mirror keep it)."""
    refilled = re.match(FROM_REFILL, headers.get("Nats-Stream-Source", ""))
    return headers.get(REFILL_HEADER) if refilled else None


def refill_subject(aggregate_stream: str, mirror: str, seq: int, device: str, subject: str) -> str:
    return f"refill.{aggregate_stream}.{mirror}.{seq}.{device}.{subject}"


# Reply headers of a direct get; the rest, but the conditions it was published under (a
# pack's ``Nats-Expected-Last-Sequence``), are the message's own.
_SERVER_HEADERS = frozenset(
    {
        "Nats-Stream",
        "Nats-Subject",
        "Nats-Sequence",
        "Nats-Time-Stamp",
        "Nats-Num-Pending",
        "Nats-Last-Sequence",
        "Nats-Msg-Id",
    }
)


def own_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """What a refilled message keeps of the headers its direct get answered with."""
    return {
        k: v
        for k, v in headers.items()
        if k not in _SERVER_HEADERS and not k.startswith("Nats-Expected-")
    }


Ranges = list[tuple[int, int]]


def to_ranges(seqs: Iterable[int]) -> Ranges:
    """Sorted sequences as inclusive ranges: [1, 2, 3, 7] → [(1, 3), (7, 7)]."""
    out: Ranges = []
    for seq in sorted(set(seqs)):
        if out and seq == out[-1][1] + 1:
            out[-1] = (out[-1][0], seq)
        else:
            out.append((seq, seq))
    return out


def expand(ranges: Iterable[tuple[int, int]]) -> set[int]:
    return {seq for first, last in ranges for seq in range(first, last + 1)}


@dataclass(frozen=True, slots=True)
class MirrorGaps:
    """What one hub mirror skipped, and what became of it (a value of ``FLEET_GAPS``)."""

    mirror: str
    device_id: str
    incarnation: str
    device_stream: str
    refilled: int = 0  # readings read again from the island into FLEET_REFILL
    kept: Ranges = field(default_factory=list)  # skipped by the mirror, kept by the aggregate
    lost: dict[str, Ranges] = field(default_factory=dict)  # reason → ranges
    pending: Ranges = field(default_factory=list)  # the island has not answered yet
    pending_since: str | None = None  # hub time the oldest pending gap was first seen
    checked_at: str = ""
    head: int = 0  # the mirror's first sequence when it was last compared with the aggregate

    @property
    def in_aggregate(self) -> int:
        return len(expand(self.kept))

    def lost_counts(self) -> dict[str, int]:
        return {reason: len(expand(r)) for reason, r in self.lost.items()}

    @property
    def pending_count(self) -> int:
        return len(expand(self.pending))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> MirrorGaps:
        raw = json.loads(data)
        raw["lost"] = {k: [tuple(r) for r in v] for k, v in raw.get("lost", {}).items()}
        raw["pending"] = [tuple(r) for r in raw.get("pending", [])]
        raw["kept"] = [tuple(r) for r in raw.get("kept", [])]
        return cls(**raw)


async def read_gaps(js: JetStreamContext) -> dict[str, MirrorGaps]:
    """Every mirror's record, by mirror name ({} before the first gap)."""
    stored = await bucket_values(js, BUCKET)
    return {mirror: MirrorGaps.from_json(value) for mirror, value in stored.items()}


@dataclass(frozen=True, slots=True)
class Healed:
    """What the hub refilled and counted lost of one incarnation of a device stream."""

    refilled: frozenset[int]
    lost: Mapping[str, Ranges]  # reason → ranges


async def healed(js: JetStreamContext) -> dict[tuple[str, str, str], Healed]:
    """(device, incarnation, device stream) → what the refill did, for `audit`, by reading
    sequence. A packed mirror's gaps are packs: its refilled packs count the readings they
    hold, and the packs it lost are not counted as readings (which readings they held is
    gone with them), so the audit shows the missing readings as unexplained."""
    records = await read_gaps(js)
    if not records:
        return {}
    packed = {
        mirror_name(d.device_id, i)
        for d in await (await Registry.open(js)).list()
        for i in d.incarnations
        if i.packed
    }
    found = {}
    for name, record in records.items():
        if not record.refilled and not record.lost:
            continue  # nothing healed: a record of its head alone (`hub_ingest.fleet.trim`)
        key = (record.device_id, record.incarnation, record.device_stream)
        if name in packed:
            found[key] = Healed(frozenset(await _refilled_readings(js, name)), {})
        else:
            found[key] = Healed(frozenset(await refilled_seqs(js, name)), record.lost)
    return found


async def _refilled_readings(js: JetStreamContext, mirror: str) -> set[int]:
    """The reading sequences in the packs of `mirror` that FLEET_REFILL holds."""
    readings: set[int] = set()
    for subject in await _refilled_subjects(js, mirror):
        msg = await js.get_last_msg(REFILL_STREAM, subject, direct=True)
        first, last = pack_range((msg.headers or {}).get(PACK_HEADER, ""))
        readings.update(range(first, last + 1))
    return readings


@dataclass(frozen=True, slots=True)
class Target:
    """A hub mirror and what it copies."""

    mirror: str
    device: Device
    incarnation: Incarnation
    aggregate: str  # the aggregate stream that sources it


async def read_record(kv: KeyValue, target: Target) -> MirrorGaps:
    """`target`'s mirror's record in ``FLEET_GAPS`` (`kv`), or an empty one."""
    try:
        entry = await kv.get(target.mirror)
    except nats.js.errors.KeyNotFoundError:
        entry = None
    if entry is not None and entry.value:
        return MirrorGaps.from_json(entry.value)
    return MirrorGaps(
        target.mirror, target.device.device_id, target.incarnation.id, target.incarnation.stream
    )


async def refilled_seqs(js: JetStreamContext, mirror: str) -> set[int]:
    """The sequences of `mirror` that FLEET_REFILL holds."""
    return {int(subject.split(".")[3]) for subject in await _refilled_subjects(js, mirror)}


async def _refilled_subjects(js: JetStreamContext, mirror: str) -> list[str]:
    try:
        info = await js.stream_info(REFILL_STREAM, subjects_filter=f"refill.*.{mirror}.*.>")
    except nats.js.errors.NotFoundError:
        return []
    return list(info.state.subjects or {})
