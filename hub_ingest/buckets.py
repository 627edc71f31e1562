"""The hub's key-value buckets (the registry, the command index) as the server stores them."""

from __future__ import annotations

from nats.js import JetStreamContext


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
