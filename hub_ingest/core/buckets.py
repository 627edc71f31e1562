"""The hub's key-value buckets (the registry, the command index, the gaps) as the server
stores them: one definition of their names and of how each is made."""

from __future__ import annotations

import contextlib
import secrets

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

COMMAND_INDEX = "FLEET_COMMAND_INDEX"  # hub_ingest.commands.index
GAPS = "FLEET_GAPS"  # hub_ingest.fleet.refill


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


_ENTRIES_AT_ONCE = 1024  # messages per pull while reading a bucket's values


async def bucket_values(
    js: JetStreamContext, bucket: str, pattern: str = ">", *, timeout: float = 10.0
) -> dict[str, bytes]:
    """The value of every key of `bucket` matching `pattern`, in one pass: an ephemeral
    consumer that delivers the last message of each key's subject, read until it has
    delivered as many as it had pending when made (deleted and purged keys left out). One
    request and a few pulls instead of a get per key: a registry of 500 devices is read in
    milliseconds instead of a quarter of a second, and every change to the fleet reads it."""
    prefix = f"$KV.{bucket}."
    config = ConsumerConfig(
        name=f"values_{secrets.token_hex(8)}",
        filter_subject=prefix + pattern,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,  # gone on its own if this task dies before it deletes it
        mem_storage=True,
        num_replicas=1,
    )
    stream = bucket_stream(bucket)
    info = await js.add_consumer(stream, config=config)
    assert config.name is not None
    sub = await js.pull_subscribe_bind(name=config.name, stream=stream)
    values: dict[str, bytes] = {}
    try:
        left = info.num_pending or 0
        while left > 0:
            # nats-py raises its TimeoutError if the rest does not come: a failed read, as a
            # get that got no answer would be.
            for msg in await sub.fetch(min(left, _ENTRIES_AT_ONCE), timeout=timeout):
                left -= 1
                key = msg.subject.removeprefix(prefix)
                if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
                    values.pop(key, None)
                else:
                    values[key] = msg.data
    finally:
        with contextlib.suppress(NatsError):
            await sub.unsubscribe()
            await js.delete_consumer(stream, config.name)
    return values
