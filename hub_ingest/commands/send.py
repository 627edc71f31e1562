"""Commands from the hub: envelopes, publishing to ``COMMANDS``, and results from the fleet.

A command is published on ``cmd.<device_id>.<type>`` (or ``cmd.all.<type>``) with
``Nats-Msg-Id`` = its id, so a retried send is stored once. Devices answer with events on
``evt.<device_id>.result``, which reach the hub through the ``FLEET_EVENTS`` aggregates as
``fleet.<device_id>.evt.<device_id>.result``. Results are read with short-lived ephemeral
consumers; ``command status`` looks a command and its results up in the command index
(`hub_ingest.commands.index`) instead of reading the history.

Who sent an event is what the hub's own subject transform wrote (``fleet.<id>.…``), never what
the payload says (`attribute`): a device can publish anything on its own island, but only under
its own id at the hub. An event that claims another device is ignored and reported.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from edge_agent.protocol.envelope import BROADCAST, Envelope, new_envelope, supersedes
from edge_agent.protocol.names import HUB_COMMANDS
from hub_ingest.commands.attribution import Attribution, attribute
from hub_ingest.commands.index import RESULT_FILTER, CommandIndex, IndexedCommand
from hub_ingest.core.errors import HubIngestError
from hub_ingest.fleet.registry import Device
from hub_ingest.fleet.streams import AGGREGATES

# Re-exported: the hub's command API in one import.
__all__ = [
    "BROADCAST",
    "Attribution",
    "CommandStatus",
    "Envelope",
    "ResultReader",
    "attribute",
    "command_status",
    "describe",
    "event_streams",
    "new_envelope",
    "send",
    "supersedes",
]

_EVENTS = next(a for a in AGGREGATES if a.device_stream == "EVENTS")


async def send(js: JetStreamContext, envelope: Envelope) -> int:
    """Publish `envelope` to ``COMMANDS``; its stream sequence."""
    ack = await js.publish(
        envelope.subject, envelope.to_json(), headers={"Nats-Msg-Id": envelope.id}
    )
    return ack.seq


def event_streams(devices: Iterable[Device]) -> list[str]:
    """The ``FLEET_EVENTS`` shards that source `devices`."""
    return sorted({_EVENTS.stream_name(d.shard) for d in devices} or {_EVENTS.stream_name(0)})


@dataclass
class CommandStatus:
    envelope: dict[str, Any] | None
    subject: str | None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    expected: list[str] = field(default_factory=list)
    # Results ignored because they claim another device: "<sender>: <what it claimed>".
    forged: list[str] = field(default_factory=list)

    def per_device(self) -> dict[str, str]:
        """pending / ok / error / rejected / expired for every device concerned."""
        out = {d: "pending" for d in self.expected}
        out.update({d: str(r.get("status")) for d, r in self.results.items()})
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": self.envelope,
            "subject": self.subject,
            "devices": {
                d: {"status": s, "result": self.results.get(d)}
                for d, s in self.per_device().items()
            },
            "forged": self.forged,
        }


class ResultReader:
    """Result events from the ``FLEET_EVENTS`` shards, through ephemeral pull consumers."""

    def __init__(self, subs: list[JetStreamContext.PullSubscription]) -> None:
        self._subs = subs

    @classmethod
    @asynccontextmanager
    async def open(
        cls, js: JetStreamContext, streams: Iterable[str], since: datetime | None
    ) -> AsyncIterator[ResultReader]:
        """Read results stored from `since` on, or only new ones when `since` is None."""
        subs = []
        try:
            for stream in streams:
                config = ConsumerConfig(
                    ack_policy=AckPolicy.NONE,
                    deliver_policy=DeliverPolicy.NEW
                    if since is None
                    else DeliverPolicy.BY_START_TIME,
                    opt_start_time=since,
                    inactive_threshold=30.0,
                    mem_storage=True,
                )
                subs.append(await js.pull_subscribe(RESULT_FILTER, stream=stream, config=config))
            yield cls(subs)
        finally:
            for sub in subs:
                await sub.unsubscribe()

    async def read(self, timeout: float) -> list[tuple[Attribution, dict[str, Any]]]:
        """Whatever results arrived, with who sent each, waiting up to `timeout` per shard for
        the first one."""
        results: list[tuple[Attribution, dict[str, Any]]] = []
        for sub in self._subs:
            try:
                msgs = await sub.fetch(256, timeout=timeout)
            except TimeoutError:
                continue  # nats-py raises when nothing came
            results.extend(r for r in map(_result, msgs) if r is not None)
        return results

    async def pending(self) -> int:
        total = 0
        for sub in self._subs:
            total += (await sub.consumer_info()).num_pending or 0
        return total


def _result(msg: Msg) -> tuple[Attribution, dict[str, Any]] | None:
    try:
        body = json.loads(msg.data)
    except ValueError:
        return None
    if not isinstance(body, dict) or "command_id" not in body:
        return None
    return attribute(msg.subject, body, "result"), body


async def _stored_command(
    js: JetStreamContext, command_id: str, found: IndexedCommand | None
) -> tuple[str, dict[str, Any]] | None:
    """Subject and envelope of the indexed command, if ``COMMANDS`` still has it."""
    if found is None:
        return None
    try:
        msg = await js.get_msg(HUB_COMMANDS, found.seq)
    except NotFoundError:
        return None  # gone (max_age), or COMMANDS was made anew
    if (msg.headers or {}).get("Nats-Msg-Id") != command_id or msg.data is None:
        return None
    return found.subject, json.loads(msg.data)


async def command_status(
    js: JetStreamContext, command_id: str, devices: list[Device], *, replicas: int = 1
) -> CommandStatus:
    """Per device concerned, the result of `command_id` so far: looked up in the command
    index (`hub_ingest.commands.index`, made with `replicas` if missing), not by reading the
    command history."""
    index = await CommandIndex.open(js, replicas)
    await index.catch_up(event_streams(devices))
    found = await _stored_command(js, command_id, await index.command(command_id))
    if found is None:
        # Gone from HUB_COMMANDS (max_age) or never sent: report whatever results exist.
        status = CommandStatus(None, None)
    else:
        subject, envelope = found
        target = subject.split(".")[1]
        expected = [d.device_id for d in devices] if target == BROADCAST else [target]
        status = CommandStatus(envelope, subject, expected=expected)
    status.results.update(await index.answers(command_id))
    status.forged.extend(await index.forgeries(command_id))
    if found is None and not status.results:
        raise HubIngestError(f"command {command_id!r} not found in {HUB_COMMANDS} or in any result")
    return status


def describe(result: Mapping[str, Any]) -> str:
    """One line for a result: the error, or the output."""
    if result.get("error"):
        return str(result["error"])
    output = result.get("output")
    return output if isinstance(output, str) else json.dumps(output)
