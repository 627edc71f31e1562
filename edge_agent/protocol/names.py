"""Names both sides of the leaf link must agree on, and the hub's permissions are built from.

Subjects: devices publish telemetry on ``tele.>`` and the agent's events on ``evt.>`` (their
island streams `TELEMETRY` and `EVENTS`); commands are ``cmd.<device_id>.<type>`` and
``cmd.all.<type>`` in the hub's `HUB_COMMANDS`; the hub's aggregates hold
``fleet.<device_id>.<subject as published>``.

Every name is per device, so the hub can grant a device its own and nothing else: a device
reads commands only from its own ``CMD_<id>`` stream, and the deliveries of each mirror
travel on a subject prefix that only that device may use.
"""

from __future__ import annotations

import re

TELEMETRY = "TELEMETRY"  # island stream of tele.>
EVENTS = "EVENTS"  # island stream of evt.>: results, heartbeats, events
OUTBOUND = (TELEMETRY, EVENTS)  # the island streams the hub mirrors
COMMAND_MIRROR = "COMMANDS"  # the island's mirror of its CMD_<id>
HUB_COMMANDS = "COMMANDS"  # the hub stream every command is published to (cmd.>)
INCARNATION = "incarnation"  # stream metadata key: the life of a device stream
# What an incarnation id may be (the agent makes 12 hex digits): it names hub streams
# (``EDGE_TELEMETRY_<id>_<incarnation>``), so the hub takes no other from an island.
INCARNATION_ID = re.compile(r"[A-Za-z0-9-]{1,32}")
# The largest message (headers and payload) the hub takes across a leaf link, nats-server's
# default. An island that took larger would store a message its link can never carry: the hub
# closes the link on it ("Maximum Payload Violation"), and the uplink stalls behind it.
LINK_MAX_PAYLOAD = 1024**2
# The durable consumer on the hub's CMD_<id> that the island's COMMANDS mirror binds to: this
# name for devices enrolled before 2026-11-29 (and an island that has not asked yet), else
# the one `CMD_<id>`'s metadata names under `ISLAND_CONSUMER_KEY` (its shard's,
# `island_consumer`): its flow control then crosses under one import a shard, not one a device.
ISLAND_CONSUMER = "ISLAND"
ISLAND_CONSUMER_KEY = "island-consumer"


def island_consumer(shard: int) -> str:
    """The name of the consumer the islands of a shard's devices bind to (``ISLAND_1``…)."""
    return f"{ISLAND_CONSUMER}_{shard + 1}"


def is_island_consumer(name: str) -> bool:
    """Whether `name` is one an island's command mirror binds to (either kind)."""
    prefix, _, shard = name.partition("_")
    return prefix == ISLAND_CONSUMER and (shard == "" or shard.isdigit())


def js_api(domain: str) -> str:
    """The JetStream API prefix of a domain (``$JS.<domain>.API``)."""
    return f"$JS.{domain}.API"


def island_name(device_id: str) -> str:
    """The island's default JetStream domain and server name: ``edge-<device_id>``."""
    return f"edge-{device_id}"


def result_subject(device_id: str) -> str:
    """Where the agent answers each command (into its island's `EVENTS`)."""
    return f"evt.{device_id}.result"


def command_stream(device_id: str) -> str:
    """The hub stream holding this device's commands and the broadcasts (mirrored by it)."""
    return f"CMD_{device_id}"


def command_filters(device_id: str) -> tuple[str, str]:
    """The ``COMMANDS`` subjects that concern this device."""
    return (f"cmd.{device_id}.>", "cmd.all.>")


def to_device_prefix(device_id: str) -> str:
    """Deliver prefix of the device's mirror of ``CMD_<id>`` (hub → device)."""
    return f"devin.{device_id}"


def island_deliver_subject(device_id: str) -> str:
    """Where `ISLAND_CONSUMER` delivers: under the device's own to-device prefix."""
    return f"{to_device_prefix(device_id)}.{COMMAND_MIRROR}"


def to_hub_prefix(device_id: str) -> str:
    """Deliver prefix of the hub's mirrors of the device's streams (device → hub)."""
    return f"hubin.{device_id}"


def inbox_prefix(device_id: str) -> str:
    """Reply subjects of the agent's own requests that cross the link (fast resume)."""
    return f"_INBOX_{device_id}"


def hub_reply_prefix(device_id: str) -> str:
    """Reply subjects of the hub's own requests to this device's island. A device linked to
    the devices' account answers on the random subject that account hands it instead; one
    still linked as releases before 2026-11-28 bound it answers here, on no other device's."""
    return f"_HUBINBOX.{device_id}"


def hub_consumer(incarnation: str) -> str:
    """The durable consumer on a device stream that the hub's mirror of it reads through.

    It lives in the device's store, so a re-imaged device (empty store) has none of the old
    incarnation's: the hub's old mirror finds nothing to resume and can never take the new
    incarnation's messages under the old one's sequence numbers.
    """
    return f"{_HUB_CONSUMER}{incarnation}"


_HUB_CONSUMER = "HUB_"


def incarnation_of_consumer(name: str) -> str | None:
    """The incarnation whose `hub_consumer` is `name`, if it is one."""
    incarnation = name.removeprefix(_HUB_CONSUMER)
    return incarnation if name != incarnation and INCARNATION_ID.fullmatch(incarnation) else None


def hub_deliver_subject(device_id: str, incarnation: str, device_stream: str) -> str:
    """Where that consumer delivers: under the device's own to-hub prefix (see auth)."""
    return f"{to_hub_prefix(device_id)}.{incarnation}.{device_stream}"


def fence_key(incarnation: str) -> str:
    """``CMD_<id>`` metadata key of an incarnation's command fence (`edge_agent.commands.fence`)."""
    return f"fence.{incarnation}"
