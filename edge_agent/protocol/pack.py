"""Packs: many telemetry readings in one message, for the uplink (``hub.pack``).

Over a slow link each message costs the hub two fsyncs (its mirror and the aggregate) and the
link a subject, a reply subject and headers beside the reading: packing readings into one
message pays those once for many. A pack keeps each reading's own sequence in the island's
``READINGS`` stream, its subject as published, its store time (to the microsecond, as the
archive keeps it), its headers and its bytes, so the ingest writes one archive row per
reading exactly as if it had crossed alone.

Body: one JSON line indexing the readings, then their payloads back to back. The index is
columns of differences, so that the link's compression takes it almost whole (its first
form, a row of absolute values per reading, made a compressed pack half as large again as
its readings)::

    {"v": 2, "seq": first, "us": first store time, "subjects": [each subject once],
     "dseq": [0, +1, ...], "dus": [0, +µs, ...], "subject": [index, ...], "size": [...],
     "headers": [[position, {name: value}], ...]}

Version 1 (``"r": [[seq, time_ns, subject, size, headers?], ...]``) is still read. The
``Edge-Pack`` header says ``<first seq> <last seq> <readings>``, so a pack's range is known
without reading its body.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import Any

READINGS = "READINGS"  # the island stream apps publish to (tele.>) when telemetry is packed
PACK_SUBJECT = "pack.tele"  # what the packed TELEMETRY stream holds
PACK_HEADER = "Edge-Pack"
_VERSION = 2


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
    subjects = list(dict.fromkeys(r.subject for r in readings))
    at = {subject: i for i, subject in enumerate(subjects)}
    seqs = [r.seq for r in readings]
    micros = [r.time_ns // 1000 for r in readings]
    index = {
        "v": _VERSION,
        "seq": seqs[0],
        "us": micros[0],
        "subjects": subjects,
        "dseq": _differences(seqs),
        "dus": _differences(micros),
        "subject": [at[r.subject] for r in readings],
        "size": [len(r.data) for r in readings],
        "headers": [[i, r.headers] for i, r in enumerate(readings) if r.headers],
    }
    line = json.dumps(index, separators=(",", ":")).encode()
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
    if not isinstance(index, dict) or index.get("v") not in (1, 2):
        raise PackError("not a version 1 or 2 pack")
    try:
        entries = _entries_v2(index) if index["v"] == 2 else _entries_v1(index)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise PackError(f"pack index entry malformed: {exc!r}") from None
    return _readings(entries, rest)


# What the index says of one reading: sequence, store time (ns), subject, size, headers.
_Entry = tuple[int, int, str, int, dict[str, str]]


def _differences(values: list[int]) -> list[int]:
    return [0, *(b - a for a, b in pairwise(values))]


def _entries_v2(index: dict[str, Any]) -> list[_Entry]:
    seqs = list(accumulate(index["dseq"], initial=index["seq"]))[1:]
    micros = list(accumulate(index["dus"], initial=index["us"]))[1:]
    subjects = [index["subjects"][i] for i in index["subject"]]
    sizes, headers = index["size"], dict(index["headers"])
    if not len(seqs) == len(micros) == len(subjects) == len(sizes):
        raise ValueError("index columns differ in length")
    return [
        (seq, us * 1000, subject, size, headers.get(i, {}))
        for i, (seq, us, subject, size) in enumerate(
            zip(seqs, micros, subjects, sizes, strict=True)
        )
    ]


def _entries_v1(index: dict[str, Any]) -> list[_Entry]:
    return [
        (seq, time_ns, subject, size, dict(*headers))
        for seq, time_ns, subject, size, *headers in index["r"]
    ]


def _readings(entries: list[_Entry], rest: bytes) -> list[Reading]:
    """The readings `entries` index, their payloads cut from `rest` in order."""
    if any(size < 0 for _, _, _, size, _ in entries):
        raise PackError("pack index entry malformed: a negative size")
    if (indexed := sum(size for _, _, _, size, _ in entries)) != len(rest):
        raise PackError(f"pack body holds {len(rest)} payload bytes, its index {indexed}")
    readings, at = [], 0
    for seq, time_ns, subject, size, headers in entries:
        readings.append(Reading(seq, time_ns, subject, rest[at : at + size], headers))
        at += size
    return readings


def pack_range(header: str) -> tuple[int, int]:
    """The first and last reading sequence an ``Edge-Pack`` header names."""
    try:
        first, last, _ = (int(part) for part in header.split())
    except ValueError:
        raise PackError(f"{PACK_HEADER} header malformed: {header!r}") from None
    return first, last
