"""Packs: many telemetry readings in one message, for the uplink (``hub.pack``).

Over a slow link each message costs the hub two fsyncs (its mirror and the aggregate) and the
link a subject, a reply subject and headers beside the reading: packing readings into one
message pays those once for many. A pack keeps each reading's own sequence in the island's
``READINGS`` stream, its subject as published, its store time, its headers and its bytes,
so the ingest writes one archive row per reading exactly as if it had crossed alone.

Body: one JSON line indexing the readings, ``{"v": 1, "r": [[seq, time_ns, subject, size,
headers?], ...]}``, then their payloads back to back. The ``Edge-Pack`` header says
``<first seq> <last seq> <readings>``, so a pack's range is known without reading its body.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

READINGS = "READINGS"  # the island stream apps publish to (tele.>) when telemetry is packed
PACK_SUBJECT = "pack.tele"  # what the packed TELEMETRY stream holds
PACK_HEADER = "Edge-Pack"
_VERSION = 1


class PackError(ValueError):
    """A message that claims to be a pack and is not one."""


@dataclass(frozen=True, slots=True)
class Reading:
    seq: int  # in READINGS
    time_ns: int  # its store time there
    subject: str  # as published
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)


def encode(readings: Sequence[Reading]) -> tuple[bytes, dict[str, str]]:
    """The body and headers of the pack holding `readings` (in sequence order)."""
    if not readings:
        raise PackError("a pack holds at least one reading")
    index = [
        [r.seq, r.time_ns, r.subject, len(r.data), *([r.headers] if r.headers else [])]
        for r in readings
    ]
    line = json.dumps({"v": _VERSION, "r": index}, separators=(",", ":")).encode()
    body = b"".join([line, b"\n", *(r.data for r in readings)])
    header = f"{readings[0].seq} {readings[-1].seq} {len(readings)}"
    return body, {PACK_HEADER: header}


def decode(body: bytes) -> list[Reading]:
    """The readings of a pack's body; `PackError` naming what is wrong with it."""
    line, newline, rest = body.partition(b"\n")
    try:
        index = json.loads(line) if newline else None
    except ValueError as exc:
        raise PackError(f"pack index is not JSON: {exc}") from None
    if not isinstance(index, dict) or index.get("v") != _VERSION:
        raise PackError(f"not a version {_VERSION} pack")
    readings, at = [], 0
    try:
        for seq, time_ns, subject, size, *headers in index["r"]:
            readings.append(Reading(seq, time_ns, subject, rest[at : at + size], *headers))
            at += size
    except (KeyError, TypeError, ValueError) as exc:
        raise PackError(f"pack index entry malformed: {exc}") from None
    if at != len(rest):
        raise PackError(f"pack body holds {len(rest)} payload bytes, its index {at}")
    return readings


def pack_range(header: str) -> tuple[int, int]:
    """The first and last reading sequence an ``Edge-Pack`` header names."""
    try:
        first, last, _ = (int(part) for part in header.split())
    except ValueError:
        raise PackError(f"{PACK_HEADER} header malformed: {header!r}") from None
    return first, last
