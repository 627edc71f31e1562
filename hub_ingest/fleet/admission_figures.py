"""What each node's watcher let in, refused and cut, and the device keys it saw on two
machines at once (`hub_ingest.fleet.shared_keys`), where `report` reads it.

Under the auth callout a refused connection is a device whose data does not arrive, and only
the watcher that answered knows why. Each watcher writes what it did since it started to the
``FLEET_ADMISSION`` bucket under its node's name every `WRITE_S`. `report --json` shows the
figures (``admission``) and warns of refusals and shared keys seen in the last `RECENT_S`,
and of figures not written for `STALE_S`: a watcher that is not running, and if none is, no
device links.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError

from edge_agent.protocol.units import parse_time, utc_now_iso
from hub_ingest.core.buckets import ADMISSION, bucket_values

WRITE_S = 10.0
STALE_S = 60.0
RECENT_S = 3600.0
_REASONS_KEPT = 1000  # a stranger may try a new key each time
_REASONS_WARNED = 5  # a node's most frequent recent reasons, in the report's warnings


@dataclass(frozen=True, slots=True)
class Seen:
    count: int
    last_at: str  # UTC, RFC 3339


@dataclass(frozen=True, slots=True)
class AdmissionFigures:
    """One node's watcher, since it started."""

    node: str
    since: str
    at: str  # when it wrote these
    admitted: int
    refused: int
    cut: int  # links of devices removed or granted otherwise (`hub_ingest.fleet.cutoff`)
    refusals: dict[str, Seen]  # by reason
    # By device: the times its key looked in use on two machines (`fleet.shared_keys`).
    shared: dict[str, Seen] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> AdmissionFigures:
        raw = json.loads(data)
        refusals = {reason: Seen(**r) for reason, r in raw.pop("refusals").items()}
        # Absent from the figures of a watcher older than the count.
        shared = {device: Seen(**s) for device, s in raw.pop("shared", {}).items()}
        return cls(**raw, refusals=refusals, shared=shared)


class Tally:
    """The running watcher's figures."""

    def __init__(self, node: str) -> None:
        self.node, self.since = node, utc_now_iso()
        self.admitted = self.refused = 0
        self._refusals: dict[str, Seen] = {}
        self._shared: dict[str, Seen] = {}

    def refusal(self, reason: str) -> None:
        if reason not in self._refusals and len(self._refusals) >= _REASONS_KEPT:
            oldest = min(self._refusals, key=lambda r: self._refusals[r].last_at)
            del self._refusals[oldest]
        count = self._refusals[reason].count if reason in self._refusals else 0
        self._refusals[reason] = Seen(count + 1, utc_now_iso())
        self.refused += 1

    def shared_link(self, device_id: str) -> int:
        """Count a time `device_id`'s key looked in use on two machines (a link let in, or a
        look at a cluster's links); how many there were."""
        count = self._shared[device_id].count + 1 if device_id in self._shared else 1
        self._shared[device_id] = Seen(count, utc_now_iso())
        return count

    def figures(self, cut: int) -> AdmissionFigures:
        return AdmissionFigures(
            self.node,
            self.since,
            utc_now_iso(),
            self.admitted,
            self.refused,
            cut,
            dict(self._refusals),
            dict(self._shared),
        )


async def write_figures(js: JetStreamContext, figures: AdmissionFigures) -> None:
    """Into the bucket `provision` makes (with every node up, as the other buckets: made
    while a node is down, a replica group can be left without a leader); none: not written."""
    try:
        bucket = await js.key_value(ADMISSION)
    except BucketNotFoundError:
        return
    await bucket.put(figures.node, figures.to_json())


async def read_figures(js: JetStreamContext) -> list[AdmissionFigures]:
    """Every node's figures, by node (none before `provision` made the bucket)."""
    stored = await bucket_values(js, ADMISSION)
    return [AdmissionFigures.from_json(value) for value in stored.values()]


def _recent(seen: dict[str, Seen], now: datetime) -> list[tuple[str, Seen]]:
    """`seen`'s entries of the last `RECENT_S`, most frequent first."""
    recent = [
        (what, s)
        for what, s in seen.items()
        if (at := parse_time(s.last_at)) and (now - at).total_seconds() <= RECENT_S
    ]
    return sorted(recent, key=lambda item: -item[1].count)


def shared_devices(figures: list[AdmissionFigures], now: datetime) -> set[str]:
    """The devices any watcher saw on two machines at once in the last `RECENT_S`."""
    return {device for f in figures for device, _ in _recent(f.shared, now)}


def figure_warnings(figures: list[AdmissionFigures], now: datetime) -> list[str]:
    """The keys on two machines and the refusals of the last `RECENT_S`, most frequent
    first, and the watchers that stopped writing; with no figures at all, that no watcher has
    answered."""
    if not figures:
        return [
            "no hub-ingest watch has written its admission figures (or `hub-ingest provision` "
            "has not run since the upgrade): under the auth callout no device links while "
            "none runs"
        ]
    warnings = []
    for f in figures:
        written = parse_time(f.at)
        if written is None or (now - written).total_seconds() > STALE_S:
            warnings.append(
                f"hub-ingest watch on node {f.node} last wrote its admission figures at {f.at}: "
                "is it running? (under the auth callout no device links while none runs)"
            )
        warnings.extend(
            f"device {device}: its key links from two machines at once (seen {s.count} times "
            f"by node {f.node}, last at {s.last_at}): a copied disk? Both are held off "
            "(server.shared_key_hold) as their readings would mix; give the copy an "
            'identity of its own (docs/operations.md, "A device key on two machines").'
            for device, s in _recent(f.shared, now)
        )
        recent = _recent(f.refusals, now)
        for reason, r in recent[:_REASONS_WARNED]:
            warnings.append(
                f"node {f.node} refused connections: {reason} ({r.count} times since {f.since}, "
                f"last at {r.last_at})"
            )
        if len(recent) > _REASONS_WARNED:
            warnings.append(f"node {f.node}: {len(recent) - _REASONS_WARNED} more refusal reasons")
    return warnings
