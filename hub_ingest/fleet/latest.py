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

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from edge_agent.protocol.release import update_subject
from hub_ingest.core.buckets import LATEST, bucket_stream, open_bucket
from hub_ingest.core.replies import Stored, last_messages
from hub_ingest.fleet.registry import Device
from hub_ingest.fleet.streams import AGGREGATES

_EVENTS = AGGREGATES[1]


def heartbeat_subject(device_id: str) -> str:
    """Where a device's heartbeats are in its events shard."""
    return f"{_EVENTS.subject_prefix(device_id)}.{device_id}.heartbeat"


def update_report_subject(device_id: str) -> str:
    """Where a device's update reports are in its events shard."""
    return f"fleet.{device_id}.{update_subject(device_id)}"


def _to_json(latest: Stored) -> bytes:
    return json.dumps(
        {"seq": latest.seq, "time": latest.time, "data": base64.b64encode(latest.data).decode()}
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
    found = await last_messages(js._nc, js._prefix, shard, subjects)
    kept = [m for m in found.values() if m.seq < below]
    if kept:
        kv = await open_bucket(js, LATEST, replicas=replicas, direct=True)
        for latest in kept:
            await kv.put(latest.subject, _to_json(latest))
    return len(kept)


async def latest(js: JetStreamContext, subjects: Sequence[str]) -> dict[str, Stored]:
    """The kept latest message on each of `subjects` that the bucket has, by subject (its
    sequence and time those of the events shard that held it)."""
    try:
        await js.stream_info(bucket_stream(LATEST))
    except NotFoundError:
        return {}  # nothing trimmed yet on this hub
    keys = [f"$KV.{LATEST}.{s}" for s in subjects]
    found = {}
    for key, msg in (await last_messages(js._nc, js._prefix, bucket_stream(LATEST), keys)).items():
        if not msg.data:
            continue  # a deleted key's marker
        raw = json.loads(msg.data)
        subject = key.removeprefix(f"$KV.{LATEST}.")
        found[subject] = Stored(
            int(raw["seq"]), subject, raw["time"], base64.b64decode(raw["data"])
        )
    return found
