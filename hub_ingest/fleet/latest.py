"""Each device's latest heartbeat and update report, kept when the trim takes them from
``FLEET_EVENTS``: `report` and the rollouts read a device's latest word there however old it
is (a device silent for a week is "silent since", not "never seen").

Before `hub_ingest.fleet.trim` purges an events shard below a sequence, the latest message on
each such subject below it is copied into the ``FLEET_LATEST`` bucket, keyed by its subject;
readers ask the shard first and the bucket for what it no longer holds.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from edge_agent.protocol.release import update_subject
from hub_ingest.core.buckets import LATEST, bucket_stream, open_bucket
from hub_ingest.core.replies import direct_get
from hub_ingest.fleet.registry import Device
from hub_ingest.fleet.streams import AGGREGATES

_EVENTS = AGGREGATES[1]
_BATCH = 256  # subjects a batched direct get asks for


def heartbeat_subject(device_id: str) -> str:
    """Where a device's heartbeats are in its events shard."""
    return f"{_EVENTS.subject_prefix(device_id)}.{device_id}.heartbeat"


def update_report_subject(device_id: str) -> str:
    """Where a device's update reports are in its events shard."""
    return f"fleet.{device_id}.{update_subject(device_id)}"


@dataclass(frozen=True, slots=True)
class Latest:
    """A device's latest message on a subject, as its events shard stored it."""

    seq: int  # in the shard
    subject: str
    time: str  # when the shard stored it (RFC 3339)
    data: bytes

    def to_json(self) -> bytes:
        return json.dumps(
            {"seq": self.seq, "time": self.time, "data": base64.b64encode(self.data).decode()}
        ).encode()


async def keep_latest(
    js: JetStreamContext, shard: str, *, below: int, devices: Iterable[Device], replicas: int
) -> int:
    """Copy into the bucket the latest heartbeat and update report of `devices` that `shard`
    holds below sequence `below` (those a purge below it would take); how many."""
    subjects = [
        s
        for d in devices
        for s in (heartbeat_subject(d.device_id), update_report_subject(d.device_id))
    ]
    kept = [m for m in await _last_messages(js, shard, subjects) if m.seq < below]
    if kept:
        kv = await open_bucket(js, LATEST, replicas=replicas, direct=True)
        for latest in kept:
            await kv.put(latest.subject, latest.to_json())
    return len(kept)


async def latest(js: JetStreamContext, subjects: Sequence[str]) -> dict[str, Latest]:
    """The kept latest message on each of `subjects` that the bucket has, by subject."""
    try:
        await js.stream_info(bucket_stream(LATEST))
    except NotFoundError:
        return {}  # nothing trimmed yet on this hub
    keys = [f"$KV.{LATEST}.{s}" for s in subjects]
    found = {}
    for msg in await _last_messages(js, bucket_stream(LATEST), keys):
        if not msg.data:
            continue  # a deleted key's marker
        raw = json.loads(msg.data)
        subject = msg.subject.removeprefix(f"$KV.{LATEST}.")
        found[subject] = Latest(
            int(raw["seq"]), subject, raw["time"], base64.b64decode(raw["data"])
        )
    return found


async def _last_messages(
    js: JetStreamContext, stream: str, subjects: Sequence[str]
) -> list[Latest]:
    """The last message on each of `subjects` in `stream` that has one: batched direct gets
    in the domain `js` speaks to."""
    found = []
    for first in range(0, len(subjects), _BATCH):
        chunk = list(subjects[first : first + _BATCH])
        request = {"multi_last": chunk, "batch": len(chunk)}
        for msg in await direct_get(js._nc, js._prefix, stream, request, timeout=10):
            headers = msg.headers or {}
            found.append(
                Latest(
                    int(headers["Nats-Sequence"]),
                    headers["Nats-Subject"],
                    headers.get("Nats-Time-Stamp", ""),
                    msg.data,
                )
            )
    return found
