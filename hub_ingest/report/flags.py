"""What the report flags a device for, and the warnings that say why."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hub_ingest.fleet.registry import Device
from hub_ingest.report.heartbeats import beat_figure
from hub_ingest.report.model import GapCounts, SourceState


def device_flags(
    last_seen_s: float | None,
    silent_after: float,
    unexamined: Mapping[str, tuple[int, int]],
    gaps: GapCounts,
    *,
    shared: bool,
    refused: bool,
) -> tuple[str, ...]:
    """A device's flags (`hub_ingest.report.model.DeviceReport.flags`)."""
    flags = []
    if last_seen_s is None:
        flags.append("never_seen")
    elif last_seen_s > silent_after:
        flags.append("silent")
    if unexamined:
        flags.append("hub_gap")
    if gaps.pending:
        flags.append("gap_pending")
    if any(reason != "evicted" for reason in gaps.lost):  # evictions are the budget's drops
        flags.append("lost")
    if shared:
        flags.append("key_shared")
    if refused:
        flags.append("incarnation_refused")
    return tuple(flags)


def hub_gaps(
    sources: Iterable[SourceState],
    beat: Mapping[str, Any] | None,
    accounted: Mapping[str, int] | None = None,
) -> dict[str, tuple[int, int]]:
    """Per device stream, (skipped, dropped) where the hub's mirror skipped more sequences
    than the refill has looked at (`accounted`, per device stream) plus what the device says
    its budget removed (by heartbeat `beat`): not yet refilled nor counted lost
    (`hub-ingest audit` names them)."""
    gaps = {}
    for source in sources:
        dropped = beat_figure(beat, "streams", source.device_stream, "dropped") or 0
        skipped = (source.skipped or 0) - (accounted or {}).get(source.device_stream, 0)
        if skipped > dropped:
            gaps[source.device_stream] = (skipped, dropped)
    return gaps


def gap_warnings(device_id: str, gaps: GapCounts) -> list[str]:
    warnings = []
    if gaps.pending:
        warnings.append(
            f"device {device_id}: {gaps.pending} readings the hub's copy skipped wait for "
            f"its island to answer (for {gaps.pending_age_s:.0f}s); they are refilled when it "
            f"links"
        )
    lost = {reason: n for reason, n in gaps.lost.items() if reason != "evicted"}
    if lost:
        said = ", ".join(f"{n} {reason}" for reason, n in lost.items())
        warnings.append(f"device {device_id}: readings lost before the hub had them: {said}")
    return warnings


def refusal_warnings(device: Device) -> list[str]:
    """The incarnations of the device's streams the hub refuses to mirror (`fleet.watch`)."""
    return [
        f"device {device.device_id}: the hub does not take its {r.stream} (incarnation "
        f"{r.id!r}, since {r.at}): {r.reason}; what it sends waits on the device"
        for r in device.refused
    ]
