"""Idempotent reconciliation of a JetStream stream (create it, or bring it in line), and the
durable consumer a mirror across the leaf link binds to, on either side of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from edge_agent.protocol.errors import StoreTrouble, StreamError

Change = Literal["created", "updated", "recreated", "unchanged"]

# Deliveries a mirror may have in flight before its origin waits for a flow-control reply. A
# consumer acking by flow control stops at max_ack_pending (server default 1,000), so a link
# carried at most 1,000 messages per round trip plus the hub's fsyncs: 1,850 readings/s over
# a compressed 2 Mbit/s, 100 ms link. 10,000 covers the bandwidth-delay product of a
# compressed 10 Mbit/s LTE or 1 Mbit/s GEO link (3,300/s on the same link; 50,000 gained
# nothing); the flow-control byte window (2-32 MiB) still bounds what is buffered. An
# uncompressed link gets less (`edge_agent.island.streams.uplink_window`).
MIRROR_WINDOW = 10_000


class Unread:
    """A stream config not read yet (`reconcile_stream` reads it)."""


UNREAD = Unread()


@dataclass(frozen=True, slots=True)
class Reconciled:
    name: str
    change: Change
    fields: tuple[str, ...] = ()


def mirror_consumer(
    name: str, deliver_subject: str, metadata: dict[str, str], window: int = MIRROR_WINDOW
) -> ConsumerConfig:
    """The durable push consumer a mirror binds to (ADR-60 sourcing): the hub's mirrors of
    device streams and the island's mirror of ``CMD_<id>`` read through one of these, with
    `window` deliveries in flight at most."""
    return ConsumerConfig(
        durable_name=name,
        deliver_subject=deliver_subject,
        deliver_policy=DeliverPolicy.ALL,
        # The mirror drives acknowledgements through flow control; nothing else acks.
        ack_policy=AckPolicy.FLOW_CONTROL,
        flow_control=True,
        # What a mirror expects of its origin; nats-server sets 1 s on every consumer that
        # acknowledges by flow control, whatever is asked (checked: 5 s came back as 1 s).
        idle_heartbeat=1.0,
        max_ack_pending=window,
        metadata=metadata,
    )


def _clean(value: object) -> object:
    """Drop empty values, so a config we send compares equal to the one the server echoes."""
    if isinstance(value, dict):
        cleaned = {k: _clean(v) for k, v in value.items()}
        return {k: v for k, v in cleaned.items() if v not in (None, "", [], {})}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _differs(want: StreamConfig, have: StreamConfig) -> list[str]:
    """Names of the fields of `want` that the existing stream does not match."""
    wanted = _clean(want.as_dict())
    existing = _clean(have.as_dict())
    assert isinstance(wanted, dict) and isinstance(existing, dict)
    changed = []
    # Absent from `want` means "none" for these; for the rest, absent means "server default".
    for key in sorted(wanted.keys() | {"subjects", "sources", "mirror"}):
        value = wanted.get(key)
        current = existing.get(key)
        if key == "metadata" and isinstance(current, dict) and isinstance(value, dict):
            current = {k: current.get(k) for k in value}  # the server adds its own _nats.* keys
        if current != value:
            changed.append(key)
    return changed


async def reconcile_stream(
    js: JetStreamContext, want: StreamConfig, have: StreamConfig | Unread | None = UNREAD
) -> Reconciled:
    """Create `want`, or bring the existing stream of that name in line with it; `have` is
    its config as the caller just read it (None: there is none), to spare a request."""
    assert want.name is not None
    try:
        return await _reconcile(js, want, want.name, have)
    except APIError as exc:
        raise stream_error(f"stream {want.name}", exc) from exc


# nats-server's codes for a store out of room, and the OS's words for a write that failed
# under a generic code ("stream update: {err}", "consumer create: {err}").
_STORE_CODES = frozenset({10023, 10028, 10047, 10077})
_WRITE_FAILURES = ("no space left on device", "input/output error", "read-only file system")


def stream_error(what: str, exc: APIError) -> StreamError:
    """`exc` as the StreamError it is: `StoreTrouble` when the server could not write."""
    problem = f"{what}: {exc.description} (code {exc.err_code})"
    description = (exc.description or "").lower()
    if exc.err_code in _STORE_CODES or any(words in description for words in _WRITE_FAILURES):
        return StoreTrouble(problem, err_code=exc.err_code)
    return StreamError(problem, err_code=exc.err_code)


# On a busy cluster a stream made a moment ago (by another provisioner, or by the step
# before) has no leader yet, and a request about it times out or gets no responders (seen on a
# 3-node hub under load): an idempotent step is simply asked again, a few times.
settling = retry(
    retry=retry_if_exception_type((NatsTimeoutError, ServiceUnavailableError)),
    stop=stop_after_attempt(4),
    wait=wait_exponential_jitter(multiplier=0.5, jitter=0.5, max=4.0),
    reraise=True,
)


@settling
async def _reconcile(
    js: JetStreamContext, want: StreamConfig, name: str, have: StreamConfig | Unread | None
) -> Reconciled:
    if isinstance(have, Unread):
        try:
            have = (await js.stream_info(name)).config
        except NotFoundError:
            have = None
    if have is None:
        await js.add_stream(want)
        return Reconciled(name, "created")
    changed = _differs(want, have)
    if not changed:
        return Reconciled(name, "unchanged")
    if "mirror" in changed:
        # A mirror's origin cannot be edited; the copy is rebuilt from its origin.
        await js.delete_stream(name)
        await js.add_stream(want)
        return Reconciled(name, "recreated", tuple(changed))
    await js.update_stream(want)
    return Reconciled(name, "updated", tuple(changed))
