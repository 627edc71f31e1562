"""What fleet-size operations cost: enrolling devices, and reading a long command history.

1. Enrolment: `N` devices enrolled one ``device add`` at a time (each rewrites the users
   file, reloads the server and provisions) against `N` others enrolled by one bulk
   ``device add --from`` (one write, one reload, one provisioning pass), on a real hub.
2. History: ``report`` and ``command status`` with `small` commands (and their results) in
   the hub's history, then with `large`; a real agent answers every command. The first call
   after the history grew is shown apart: it brings the command index up to date.

    .venv/bin/python bench/fleet_scale.py [--devices 50] [--small 100] [--large 2000]

Last line: ``enrol_single_ms_per_device=... enrol_bulk_ms_per_device=... enrol_speedup=...
report_small_ms=... report_large_ms=... report_ratio=... status_small_ms=...
status_large_ms=... status_ratio=...`` (ratios: large history over small; 1.0 means the cost
does not grow with history).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.protocol.logs import configure_logging
from hub_ingest.commands import command_status, new_envelope, send
from hub_ingest.enrol import Enrolment, enrol, enrol_many
from hub_ingest.localfleet import start_local_hub
from hub_ingest.registry import Registry
from hub_ingest.report import collect_report
from tests.support.cluster import Hub, start_hub

REPEATS = 5  # steady-state calls timed per measurement; the median is kept


async def enrol_costs(root: Path, n: int) -> tuple[float, float]:
    """Seconds per device: one `enrol` per device, then one `enrol_many` for as many."""
    hub = await start_local_hub(root / "enrol")
    try:
        start = time.monotonic()
        for i in range(n):
            await enrol(hub.js, hub.config, f"single{i}")
        single = (time.monotonic() - start) / n
        wanted = [Enrolment(f"bulk{i}", None, line=i + 1) for i in range(n)]
        start = time.monotonic()
        outcome = await enrol_many(hub.js, hub.config, wanted)
        bulk = (time.monotonic() - start) / n
        assert len(outcome.enrolled) == n, outcome
    finally:
        await hub.close()
    return single, bulk


async def _answered(hub: Hub, n: int) -> bool:
    info = await hub.js.stream_info("FLEET_EVENTS", subjects_filter="fleet.a.evt.a.result")
    return sum((info.state.subjects or {}).values()) >= n


async def grow_history(hub: Hub, total: int, sent: list[str]) -> None:
    """Send commands to device ``a`` until `total` were sent; wait for every result."""
    while len(sent) < total:
        envelope = new_envelope("a", "ping", {}, 3600)
        await send(hub.js, envelope)
        sent.append(envelope.id)
    deadline = time.monotonic() + 600
    while not await _answered(hub, total):
        if time.monotonic() > deadline:
            raise SystemExit(f"the device did not answer {total} commands within 600 s")
        await asyncio.sleep(0.2)


async def timed(call: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """Seconds of the first call, and the median of the next `REPEATS`."""
    start = time.monotonic()
    await call()
    first = time.monotonic() - start
    samples = []
    for _ in range(REPEATS):
        start = time.monotonic()
        await call()
        samples.append(time.monotonic() - start)
    return first, statistics.median(samples)


async def history_costs(root: Path, small: int, large: int) -> dict[str, tuple[float, float]]:
    hub = await start_hub(root / "history")
    sent: list[str] = []
    costs: dict[str, tuple[float, float]] = {}
    try:
        await hub.device("a", register_when_ready=True, heartbeat_interval="1s")
        for label, total in (("small", small), ("large", large)):
            await grow_history(hub, total, sent)
            devices = await (await Registry.open(hub.js)).list()
            middle = sent[len(sent) // 2]
            costs[f"report_{label}"] = await timed(
                partial(collect_report, hub.nc, hub.config, devices, silent_after=60)
            )
            costs[f"status_{label}"] = await timed(partial(command_status, hub.js, middle, devices))
    finally:
        await hub.close()
    return costs


async def main(devices: int, small: int, large: int) -> None:
    configure_logging("warning")
    with tempfile.TemporaryDirectory(prefix="bench-fleet-scale-") as tmp:
        single, bulk = await enrol_costs(Path(tmp), devices)
        costs = await history_costs(Path(tmp), small, large)
    print(
        f"enrol {devices} devices: {single * 1000:.0f} ms per device one at a time, "
        f"{bulk * 1000:.1f} ms per device in bulk"
    )
    for name, (first, steady) in costs.items():
        print(f"{name}: first call {first * 1000:.0f} ms, then {steady * 1000:.0f} ms")
    report = costs["report_large"][1] / costs["report_small"][1]
    status = costs["status_large"][1] / costs["status_small"][1]
    print(
        f"enrol_single_ms_per_device={single * 1000:.1f} "
        f"enrol_bulk_ms_per_device={bulk * 1000:.1f} "
        f"enrol_speedup={single / bulk:.1f} "
        f"report_small_ms={costs['report_small'][1] * 1000:.0f} "
        f"report_large_ms={costs['report_large'][1] * 1000:.0f} report_ratio={report:.2f} "
        f"status_small_ms={costs['status_small'][1] * 1000:.0f} "
        f"status_large_ms={costs['status_large'][1] * 1000:.0f} status_ratio={status:.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=50)
    parser.add_argument("--small", type=int, default=100)
    parser.add_argument("--large", type=int, default=2000)
    args = parser.parse_args()
    asyncio.run(main(args.devices, args.small, args.large))
