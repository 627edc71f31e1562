"""Who sent an event the hub stores: what its own subject transform wrote, never the payload.

A device can publish anything on its own island, but only under its own id at the hub: the
aggregates' transform writes ``fleet.<id>.`` in front of what it published. An event whose
subject or payload claims another device is a *forgery*: ignored, and reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Attribution:
    device_id: str | None  # from the hub's subject; None: not an aggregate event subject
    forgery: str | None  # what the event claims that its subject does not; None: consistent

    @property
    def trusted(self) -> bool:
        return self.device_id is not None and self.forgery is None


def attribute(subject: str, body: Mapping[str, Any] | None, kind: str) -> Attribution:
    """Who sent the `kind` event (``result``, ``heartbeat``) stored on `subject` in an aggregate:
    the device the hub's transform named, if the device's own subject and payload agree."""
    tokens = subject.split(".")
    if len(tokens) < 5 or tokens[0] != "fleet" or tokens[2] != "evt":
        return Attribution(None, f"{subject} is not an aggregate event subject")
    device = tokens[1]
    published = ".".join(tokens[2:])
    if tokens[3] != device or tokens[4:] != [kind]:
        return Attribution(device, f"published {published}")
    claimed = (body or {}).get("device_id")
    if claimed is not None and claimed != device:
        return Attribution(device, f"{published} naming device {claimed!r}")
    return Attribution(device, None)
