"""The command envelope and the result schema: one definition, used by the hub that sends
commands and reads results, and by the agent that parses commands and writes results.

Envelope: JSON ``{id, type, args, issued_at, expires_at, device_id}`` on
``cmd.<device_id>.<type>`` (``device_id`` is the target: a device id or ``all``). Result: JSON
``{command_id, device_id, status, output, error, started_at, finished_at, type, seq}`` on
``evt.<device_id>.result``, ``status`` one of ``ok|error|rejected|expired``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from edge_agent.protocol.units import format_time

BROADCAST = "all"  # the target of a command for every device
ResultStatus = Literal["ok", "error", "rejected", "expired"]


@dataclass(frozen=True, slots=True)
class Envelope:
    id: str
    type: str
    args: dict[str, Any]
    issued_at: str
    expires_at: str
    device_id: str  # the target: a device id, or "all"

    @property
    def subject(self) -> str:
        return f"cmd.{self.device_id}.{self.type}"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()


def new_envelope(target: str, type_: str, args: Mapping[str, Any], ttl: float) -> Envelope:
    now = datetime.now(UTC)
    return Envelope(
        id=uuid.uuid4().hex,
        type=type_,
        args=dict(args),
        issued_at=format_time(now),
        expires_at=format_time(now + timedelta(seconds=ttl)),
        device_id=target,
    )


@dataclass(frozen=True, slots=True)
class Result:
    """The answer to one command, sent as an event on ``evt.<device_id>.result``."""

    command_id: str | None
    device_id: str
    status: ResultStatus
    output: Any
    error: str | None
    started_at: str
    finished_at: str
    type: str | None = None
    seq: int | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), default=str).encode()


RAN = ("ok", "error")  # result statuses of a command that ran; the others did not run it


def supersedes(new_status: object, old_status: object) -> bool:
    """Whether a later result of a command on a device replaces the one already seen: only an
    answer from a run replaces an answer that it did not run. A re-imaged device answers the
    commands its previous incarnation may have run "rejected" (see `edge_agent.commands.fence`), and
    that must not hide the real result."""
    return new_status in RAN and old_status not in RAN
