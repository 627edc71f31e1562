"""Reading a stream's messages on a subject through a throwaway consumer, for checks that need
each message's metadata (its delivery's stream sequence, its headers)."""

from __future__ import annotations

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

_BATCH = 1000


async def scan(js: JetStreamContext, stream: str, subject: str) -> list[Msg]:
    """Every message of `stream` on `subject` (wildcards allowed), oldest first."""
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL,
        mem_storage=True,
        # Removed by the server even if this process dies before deleting it.
        inactive_threshold=60.0,
    )
    try:
        sub = await js.pull_subscribe(subject, stream=stream, config=config)
    except NotFoundError:
        return []
    info = await sub.consumer_info()
    assert info.name is not None
    msgs: list[Msg] = []
    try:
        pending = info.num_pending or 0
        while pending > 0:
            batch = await sub.fetch(min(pending, _BATCH), timeout=10)
            msgs.extend(batch)
            pending = batch[-1].metadata.num_pending or 0
    finally:
        await sub.unsubscribe()
        await js.delete_consumer(stream, info.name)
    return msgs
