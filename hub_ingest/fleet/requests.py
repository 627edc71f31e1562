"""The watcher's requests: to a device's island across the leaf (answered on the device's
own reply prefix, the only one its leaf may answer on) and to the hub's API for the state of
its streams."""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Mapping
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from edge_agent.protocol.names import hub_reply_prefix
from hub_ingest.fleet.registry import Device


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
    message up to the batch's end-of-batch status."""
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
            if not many:
                return got
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


async def ask_json(nc: Client, device: Device, subject: str, *, timeout: float) -> dict[str, Any]:
    """A JetStream API request to a device's island; its JSON answer."""
    [reply] = await ask(nc, device, subject, {}, timeout=timeout)
    answer = json.loads(reply.data)
    if not isinstance(answer, dict):
        raise ValueError(f"not a JSON object: {reply.data[:80]!r}")
    return answer


async def deleted_states(js: JetStreamContext, names: set[str]) -> dict[str, tuple[int, int, int]]:
    """(first, last, deleted) of each of the streams `names` that has deleted sequences."""
    states: dict[str, tuple[int, int, int]] = {}
    offset = 0
    while page := await js.streams_info(offset=offset):
        offset += len(page)
        for info in page:
            name = info.config.name or ""
            deleted = info.state.num_deleted or 0
            if name in names and deleted:
                states[name] = (info.state.first_seq, info.state.last_seq, deleted)
    return states


async def deleted_seqs(nc: Client, api: str, mirror: str) -> set[int]:
    """The sequences inside the mirror's range that it does not hold."""
    reply = await nc.request(
        f"{api}.STREAM.INFO.{mirror}", json.dumps({"deleted_details": True}).encode(), timeout=10
    )
    state = json.loads(reply.data).get("state") or {}
    first = int(state.get("first_seq", 0))
    return {int(s) for s in state.get("deleted") or [] if int(s) >= first}
