"""The hub's key-value buckets (the registry, the command index, the gaps, the admission
figures, the admitted links, the devices' latest events) as the server stores them: one
definition of their names and of how each is made."""

from __future__ import annotations

import contextlib

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue

COMMAND_INDEX = "FLEET_COMMAND_INDEX"  # hub_ingest.commands.index
GAPS = "FLEET_GAPS"  # hub_ingest.fleet.refill
ADMISSION = "FLEET_ADMISSION"  # hub_ingest.fleet.admission_figures
LINKS = "FLEET_LINKS"  # hub_ingest.fleet.cutoff
LATEST = "FLEET_LATEST"  # hub_ingest.fleet.latest
# The buckets `provision` makes, with every node up, and whether each answers direct gets
# (the registry is made by whoever opens it first, `hub_ingest.fleet.registry`).
PROVISIONED = {COMMAND_INDEX: True, GAPS: False, ADMISSION: False, LINKS: False, LATEST: True}


async def open_bucket(
    js: JetStreamContext, bucket: str, *, replicas: int = 1, direct: bool = False
) -> KeyValue:
    """`bucket` (one value per key, on disk), made with `replicas` if missing."""
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        return await js.create_key_value(
            KeyValueConfig(
                bucket=bucket,
                history=1,
                storage=StorageType.FILE,
                direct=direct,
                replicas=replicas,
            )
        )


def bucket_stream(bucket: str) -> str:
    """The stream that holds `bucket`."""
    return f"KV_{bucket}"


async def bucket_keys(js: JetStreamContext, bucket: str, pattern: str = ">") -> list[str]:
    """The keys of `bucket` matching `pattern`, sorted, from the server's own count of the
    bucket's subjects. A key deleted or purged keeps its subject for the marker, so a caller
    that reads the values skips those. nats-py's ``keys()`` and ``watch()`` are watchers that
    can say they are done before delivering every key (a short listing under load) or
    deliver one twice on a cluster."""
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(bucket_stream(bucket), subjects_filter=prefix + pattern)
    return [subject.removeprefix(prefix) for subject in sorted(info.state.subjects or {})]


async def bucket_values(js: JetStreamContext, bucket: str) -> dict[str, bytes]:
    """Every key's value in `bucket`, by key, sorted ({} before the bucket is made); a key
    deleted or purged is left out."""
    try:
        kv = await js.key_value(bucket)
    except BucketNotFoundError:
        return {}
    found = {}
    for key in await bucket_keys(js, bucket):
        with contextlib.suppress(KeyNotFoundError):
            entry = await kv.get(key)
            if entry.value:
                found[key] = entry.value
    return found
