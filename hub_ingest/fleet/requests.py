"""The watcher's requests: to a device's island across the leaf (answered on the device's
own reply prefix, or through the devices' account on a random one, docs/security.md) and to
the hub's API for the state of its streams."""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from edge_agent.protocol.names import hub_reply_prefix
from edge_agent.protocol.units import parse_time
from hub_ingest.core.config import AggregatesConfig
from hub_ingest.fleet.registry import Device
from hub_ingest.fleet.streams import stream_list


def seq_of(msg: Msg) -> int:
    return int((msg.headers or {}).get("Nats-Sequence", 0))


async def ask(
    nc: Client,
    device: Device,
    subject: str,
    body: Mapping[str, Any],
    *,
    timeout: float,
    many: bool = False,
) -> list[Msg]:
    """A request to a device's island, answered on its own reply prefix; with `many`, every
    message up to the batch's end-of-batch status, and no more than the `batch` asked for."""
    inbox = f"{hub_reply_prefix(device.device_id)}.{secrets.token_hex(8)}"
    sub = await nc.subscribe(inbox)
    got: list[Msg] = []
    try:
        await nc.publish(subject, json.dumps(body).encode(), reply=inbox)
        while True:
            msg = await sub.next_msg(timeout=timeout)
            status = (msg.headers or {}).get("Status")
            if status is not None:
                if status in ("404", "408", "204"):
                    return got  # no (more) messages; end of batch
                raise ValueError(f"{subject}: status {status}")
            got.append(msg)
            if not many or len(got) >= body.get("batch", float("inf")):
                return got
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


async def read_range(
    nc: Client, device: Device, subject: str, lo: int, hi: int, *, timeout: float, max_bytes: int
) -> list[Msg]:
    """Messages `lo`..`hi` (those there are) of the direct get `subject` across `device`'s
    link, a batch of at most `max_bytes` at a time."""
    got: list[Msg] = []
    seq = lo
    while seq <= hi:
        body = {"seq": seq, "batch": hi - seq + 1, "max_bytes": max_bytes}
        msgs = await ask(nc, device, subject, body, timeout=timeout, many=True)
        # A batch holds the next messages there are, which may lie past `hi`; one before
        # `seq` is not what was asked (and would have this loop ask for ever).
        within = [m for m in msgs if seq <= seq_of(m) <= hi]
        got += within
        if len(within) < len(msgs) or not within:
            break
        seq = seq_of(within[-1]) + 1
    return got


async def ask_json(
    nc: Client,
    device: Device,
    subject: str,
    body: Mapping[str, Any] | None = None,
    *,
    timeout: float,
) -> dict[str, Any]:
    """A JetStream API request to a device's island; its JSON answer."""
    [reply] = await ask(nc, device, subject, body or {}, timeout=timeout)
    answer = json.loads(reply.data)
    if not isinstance(answer, dict):
        raise ValueError(f"not a JSON object: {reply.data[:80]!r}")
    return answer


async def island_stream(
    nc: Client, device: Device, stream: str, *, timeout: float
) -> dict[str, Any] | None:
    """A stream's info on a device's island; None when the island does not answer."""
    subject = f"{device.api_prefix}.STREAM.INFO.{stream}"
    try:
        info = await ask_json(nc, device, subject, timeout=timeout)
    except (nats.errors.Error, TimeoutError, ValueError):
        return None
    return info if "error" not in info else None


@dataclass(frozen=True, slots=True)
class Listed:
    """A stream's state as the stream list gives it."""

    first: int
    last: int
    deleted: int
    bytes: int
    first_time: datetime | None  # store time of its first message

    @property
    def range(self) -> tuple[int, int, int]:
        return self.first, self.last, self.deleted

    def near_limits(self, limits: AggregatesConfig) -> bool:
        """Whether a hub mirror's limits (the aggregates', which keep its rows at least as
        long) may have cut its head, rather than a loss."""
        if limits.max_bytes > 0 and self.bytes >= limits.max_bytes * 0.9:
            return True
        if limits.max_age > 0 and self.first_time is not None:
            return (datetime.now(UTC) - self.first_time).total_seconds() >= limits.max_age * 0.9
        return False


async def stream_states(js: JetStreamContext, names: set[str]) -> dict[str, Listed]:
    """The state of each of the streams `names` that exists (one paged ``STREAM.LIST``)."""
    return states_of(await stream_list(js), names)


def states_of(listed: list[dict[str, Any]], names: set[str]) -> dict[str, Listed]:
    """The state of each of the streams `names` in `listed` (``STREAM.LIST`` entries)."""
    states: dict[str, Listed] = {}
    for info in listed:
        name = (info.get("config") or {}).get("name", "")
        state = info.get("state") or {}
        if name in names:
            states[name] = Listed(
                int(state.get("first_seq", 0)),
                int(state.get("last_seq", 0)),
                int(state.get("num_deleted", 0)),
                int(state.get("bytes", 0)),
                parse_time(state.get("first_ts")),
            )
    return states


async def deleted_seqs(nc: Client, api: str, mirror: str) -> set[int]:
    """The sequences inside the mirror's range that it does not hold."""
    reply = await nc.request(
        f"{api}.STREAM.INFO.{mirror}", json.dumps({"deleted_details": True}).encode(), timeout=10
    )
    state = json.loads(reply.data).get("state") or {}
    first = int(state.get("first_seq", 0))
    return {int(s) for s in state.get("deleted") or [] if int(s) >= first}
