"""Reading a stream's messages on a subject through a throwaway consumer, for checks that need
each message's metadata (its delivery's stream sequence, its headers)."""

from __future__ import annotations

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError, ServiceUnavailableError
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

_BATCH = 1000


# Read again from the start when a node answers 503: right after a cluster node restarts,
# a consumer on a stream it leads may not be ready for its first pull (seen once in CI after
# a rolling restart). The scan only reads, so a second one is the same scan.
@retry(
    retry=retry_if_exception_type(ServiceUnavailableError),
    stop=stop_after_attempt(5),
    wait=wait_exponential(multiplier=0.5, max=5.0),
    reraise=True,
)
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
