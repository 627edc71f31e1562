"""A command as it arrives: the message from the ``COMMANDS`` mirror (`Incoming`), its
ledger key (`command_id`) and the envelope checks (`parse_command`) that turn it into a
`Command` or a refusal naming the field."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from edge_agent.core.errors import CommandRefused
from edge_agent.protocol.envelope import BROADCAST

_ID_RE = re.compile(r"^[^@\s][^\s]{0,127}$")


@dataclass(frozen=True, slots=True)
class Incoming:
    """A command message as read from the mirror or straight from the hub."""

    seq: int  # the sequence in the hub's CMD_<id>: the mirror keeps its origin's numbers
    subject: str
    data: bytes
    headers: Mapping[str, str]
    via: Literal["mirror", "hub"]
    stored_at: datetime | None = None  # the hub's store time (a mirror keeps it too)


@dataclass(frozen=True, slots=True)
class Command:
    id: str
    type: str
    args: dict[str, Any]
    issued_at: datetime
    expires_at: datetime | None
    device_id: str  # the target: this device's id, or BROADCAST


def subject_type(item: Incoming) -> str | None:
    return [*item.subject.split(".", 2), "", ""][2] or None


def _time(field: str, value: object) -> datetime:
    if not isinstance(value, str):
        raise CommandRefused(field, f"expected an ISO-8601 time string, got {value!r}")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise CommandRefused(field, f"expected an ISO-8601 time, got {value!r}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _envelope(item: Incoming, max_payload: int) -> dict[str, Any]:
    if len(item.data) > max_payload:
        raise CommandRefused(
            "payload", f"{len(item.data)} bytes, more than commands.max_payload ({max_payload})"
        )
    try:
        body = json.loads(item.data)
    except ValueError as exc:
        raise CommandRefused("payload", f"not JSON ({exc})") from None
    except RecursionError:  # e.g. 4,000 nested "[": fits max_payload, too deep for json
        raise CommandRefused("payload", "JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise CommandRefused("payload", f"expected a JSON object, got {type(body).__name__}")
    return body


def command_id(item: Incoming, max_payload: int) -> str | None:
    """The command's id if one can be found, even in an envelope that is otherwise wrong."""
    with contextlib.suppress(CommandRefused):
        value = _envelope(item, max_payload).get("id")
        if isinstance(value, str) and _ID_RE.match(value):
            return value
    header = item.headers.get("Nats-Msg-Id")
    return header if header and _ID_RE.match(header) else None


def parse_command(
    item: Incoming,
    device_id: str,
    max_payload: int,
    known: Mapping[str, object],
    now: datetime | None,
) -> Command:
    """The validated command, or `CommandRefused` naming the first field that is wrong.

    `now` is the hub's time (`edge_agent.commands.hubclock`), never the device's clock alone; None
    (nothing heard from the hub) expires nothing."""
    body = _envelope(item, max_payload)
    if "id" not in body:
        raise CommandRefused("id", "missing")
    if not isinstance(body["id"], str) or not _ID_RE.match(body["id"]):
        raise CommandRefused("id", f"expected 1-128 printable characters, got {body['id']!r}")
    type_ = body.get("type")
    if not isinstance(type_, str) or not type_:
        raise CommandRefused("type", f"expected a non-empty string, got {type_!r}")
    _, target, subject_type = [*item.subject.split(".", 2), "", ""][:3]
    if target not in (device_id, BROADCAST):
        raise CommandRefused("subject", f"{item.subject} is not for this device ({device_id})")
    if subject_type != type_:
        raise CommandRefused("type", f"{type_!r} does not match the subject {item.subject}")
    addressed = body.get("device_id", target)
    if addressed != target:
        raise CommandRefused("device_id", f"command for {addressed!r}, this is {device_id!r}")
    args = body.get("args", {})
    if not isinstance(args, dict):
        raise CommandRefused("args", f"expected an object, got {args!r}")
    if "issued_at" not in body:
        raise CommandRefused("issued_at", "missing")
    issued_at = _time("issued_at", body["issued_at"])
    expires_at = _time("expires_at", body["expires_at"]) if body.get("expires_at") else None
    if expires_at is not None and now is not None and expires_at <= now:
        raise CommandRefused(
            "expires_at",
            f"expired at {expires_at.isoformat()}, received at "
            f"{now.isoformat(timespec='seconds')} on the hub's clock",
            status="expired",
        )
    if type_ not in known:
        raise CommandRefused(
            "type", f"unknown command type {type_!r} (known: {', '.join(sorted(known))})"
        )
    return Command(body["id"], type_, args, issued_at, expires_at, target)


def check_fence(item: Incoming, fence: int) -> None:
    if item.seq <= fence:
        raise CommandRefused(
            "seq",
            f"device re-imaged: command {item.seq} was issued before this incarnation "
            f"(fence {fence}) and may have run on the previous one; not run",
        )
