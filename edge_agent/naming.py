"""Names both sides of the leaf link must agree on, and the hub's permissions are built from.

Every name is per device, so the hub can grant a device its own and nothing else: a device
reads commands only from its own ``CMD_<id>`` stream, and the deliveries of each mirror
travel on a subject prefix that only that device may use.
"""

from __future__ import annotations


def command_stream(device_id: str) -> str:
    """The hub stream holding this device's commands and the broadcasts (mirrored by it)."""
    return f"CMD_{device_id}"


def command_filters(device_id: str) -> tuple[str, str]:
    """The ``COMMANDS`` subjects that concern this device."""
    return (f"cmd.{device_id}.>", "cmd.all.>")


def to_device_prefix(device_id: str) -> str:
    """Deliver prefix of the device's mirror of ``CMD_<id>`` (hub → device)."""
    return f"devin.{device_id}"


def to_hub_prefix(device_id: str) -> str:
    """Deliver prefix of the hub's mirrors of the device's streams (device → hub)."""
    return f"hubin.{device_id}"


def inbox_prefix(device_id: str) -> str:
    """Reply subjects of the agent's own requests that cross the link (fast resume)."""
    return f"_INBOX_{device_id}"
