"""Idempotent reconciliation of the island's streams.

- ``TELEMETRY`` (``tele.>``) and ``EVENTS`` (``evt.>``): outbound, file storage, each with its
  own byte budget. JetStream reserves a stream's ``max_bytes`` in the store, so telemetry
  pressure can never evict events or results: it only drops the oldest telemetry.
- ``COMMANDS``: a mirror of the hub's ``CMD_<device_id>`` (the device's slice of the hub's
  ``COMMANDS``: ``cmd.<device_id>.>`` and ``cmd.all.>``) through ``$JS.<hub-domain>.API``, so
  commands keep arriving into local storage and stay readable while the link is down. The
  device is allowed to read that stream and no other (see docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import structlog
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    ExternalStream,
    StorageType,
    StreamConfig,
    StreamSource,
)
from nats.js.errors import APIError, NotFoundError

from edge_agent.config import Config, StreamBudget
from edge_agent.errors import StreamError
from edge_agent.naming import command_stream, to_device_prefix

log = structlog.get_logger(__name__)

TELEMETRY = "TELEMETRY"
EVENTS = "EVENTS"
COMMANDS = "COMMANDS"
MANAGED_BY = {"managed-by": "edge-agent"}

Change = Literal["created", "updated", "recreated", "unchanged"]


@dataclass(frozen=True, slots=True)
class Reconciled:
    name: str
    change: Change
    fields: tuple[str, ...] = ()


def _outbound(name: str, subject: str, budget: StreamBudget) -> StreamConfig:
    return StreamConfig(
        name=name,
        subjects=[subject],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_bytes=budget.max_bytes,
        max_age=budget.max_age,
        duplicate_window=120.0,
        allow_direct=True,
        metadata=MANAGED_BY,
    )


def desired_streams(config: Config) -> list[StreamConfig]:
    """The streams the island must have, as configured."""
    mirror = StreamSource(
        name=command_stream(config.device_id),
        external=ExternalStream(
            api=config.hub.api_prefix, deliver=to_device_prefix(config.device_id)
        ),
    )
    return [
        _outbound(TELEMETRY, "tele.>", config.streams.telemetry),
        _outbound(EVENTS, "evt.>", config.streams.events),
        StreamConfig(
            name=COMMANDS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_bytes=config.streams.commands.max_bytes,
            max_age=config.streams.commands.max_age,
            mirror=mirror,
            allow_direct=True,
            metadata=MANAGED_BY,
        ),
    ]


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


async def reconcile_stream(js: JetStreamContext, want: StreamConfig) -> Reconciled:
    """Create `want`, or bring the existing stream of that name in line with it."""
    assert want.name is not None
    try:
        try:
            have = (await js.stream_info(want.name)).config
        except NotFoundError:
            await js.add_stream(want)
            return Reconciled(want.name, "created")
        changed = _differs(want, have)
        if not changed:
            return Reconciled(want.name, "unchanged")
        if "mirror" in changed:
            # A mirror's origin cannot be edited; the copy is rebuilt from its origin.
            await js.delete_stream(want.name)
            await js.add_stream(want)
            return Reconciled(want.name, "recreated", tuple(changed))
        await js.update_stream(want)
        return Reconciled(want.name, "updated", tuple(changed))
    except APIError as exc:
        raise StreamError(f"stream {want.name}: {exc.description} (code {exc.err_code})") from exc


async def reconcile(js: JetStreamContext, config: Config) -> list[Reconciled]:
    """Bring every island stream in line with `config`; safe to call any number of times."""
    results = [await reconcile_stream(js, want) for want in desired_streams(config)]
    for result in results:
        if result.change != "unchanged":
            log.info(
                "stream_reconciled",
                stream=result.name,
                change=result.change,
                fields=list(result.fields),
            )
    return results
