"""The hub's idle CPU a device, built up one object at a time: what the engine costs at least.

Every shape `bench/device_shapes.py` measured keeps at least two flow-controlled consumers a
device (the one its uplink is read through, the one its command mirror binds to), and
nats-server heartbeats each of them once a second, fixed (``sourceHealthHB``). This bench
takes one fleet of bare islands (as there, niceness 19) against a plain hub split as the
product's, and measures the hub's idle CPU after each step:

- ``empty``: the hub alone, before any island links;
- ``links``: every island linked, its stream ``T`` and the durable consumer the hub would
  bind to made, nothing bound;
- ``uplink``: an aggregate on the hub sourcing each island's ``T`` through that consumer
  (the ``single`` shape's read: one heartbeat a second crossing each link);
- ``commands``: each island's command mirror bound to a durable consumer on the hub's
  ``COMMANDS``, filtered to its commands (the second heartbeat).

A device's share of each step is its idle CPU less ``empty``'s, over the fleet. The last two
are the least any shape with a read each way costs on this engine.

    .venv/bin/python bench/idle_floor.py --devices 200
    .venv/bin/python bench/idle_floor.py --devices 25 --idle 10   # quick

Last line: ``devices=… links_idle_cpu_pct_per_device=… uplink_…=… commands_…=…
floor_over_target=…`` (the ``commands`` figure over issue 28's 0.01 %), preceded by each
step's increment over the one before.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import sys
import tempfile
from pathlib import Path

from nats.js.api import ExternalStream, StreamConfig, StreamConsumerSource, StreamSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from bench.device_shapes import HUB_API, Fleet, _bound_consumer
from bench.fleetscale.bare import hub_client
from bench.fleetscale.common import proc_cpu_s

STEPS = ("empty", "links", "uplink", "commands")
TARGET_PCT = 0.01  # issue 28: idle CPU a device on the hub
SAMPLES = 3  # idle windows a step; the median is kept


async def idle_pct(fleet: Fleet, seconds: float) -> float:
    """The hub's CPU over `seconds` idle, in % of a core (median of `SAMPLES` windows)."""
    assert fleet.hub.proc is not None
    pid = fleet.hub.proc.pid
    await asyncio.sleep(5)  # what the last step set going settles
    windows = []
    for _ in range(SAMPLES):
        before = proc_cpu_s(pid)
        await asyncio.sleep(seconds / SAMPLES)
        windows.append((proc_cpu_s(pid) - before) / (seconds / SAMPLES) * 100)
    return statistics.median(windows)


async def measure(root: Path, n: int, args: argparse.Namespace) -> dict[str, float]:
    args.per_aggregate, args.pin, args.per_account = 100, False, 0
    fleet = Fleet(root, "single", n, args, callout=False)
    pct: dict[str, float] = {}
    try:
        await fleet.start_hub()
        pct["empty"] = await idle_pct(fleet, args.idle)
        gate = asyncio.Semaphore(8)

        async def island(i: int) -> None:
            async with gate:
                await fleet.start_island(i)

        await asyncio.gather(*(island(i) for i in range(n)))
        pct["links"] = await idle_pct(fleet, args.idle)
        async with hub_client(fleet.ports["client"]) as js:
            for shard in range(0, n, fleet.per_aggregate):
                sources = [
                    fleet._aggregate_source(i, "T")
                    for i in range(shard, min(shard + fleet.per_aggregate, n))
                ]
                await js.add_stream(StreamConfig(name=f"AGG_T_{shard}", sources=sources))
            await fleet.await_uplink(1, "first fill")
            pct["uplink"] = await idle_pct(fleet, args.idle)
            await js.add_stream(StreamConfig(name="COMMANDS", subjects=["cmd.>"]))
            for i in range(n):
                filters = [f"cmd.d{i}.>", "cmd.all.>"]
                await js.add_consumer(
                    "COMMANDS", _bound_consumer(f"I{i}", f"devin.d{i}.C", filters)
                )
            for i, nc in fleet.islands.items():
                source = StreamSource(
                    name="COMMANDS",
                    external=ExternalStream(api=HUB_API),
                    consumer=StreamConsumerSource(name=f"I{i}", deliver_subject=f"devin.d{i}.C"),
                )
                await nc.jetstream().add_stream(StreamConfig(name="C", mirror=source))
            await js.publish("cmd.all.first", b"broadcast")
            await fleet.await_commands(1)
            pct["commands"] = await idle_pct(fleet, args.idle)
    finally:
        await fleet.close()
    return pct


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=25)
    parser.add_argument("--idle", type=float, default=60.0, help="seconds of idle CPU a step")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    n = args.devices
    with tempfile.TemporaryDirectory(prefix="floor-") as root:
        pct = await measure(Path(root), n, args)
    per_device = {s: (pct[s] - pct["empty"]) / n for s in STEPS[1:]}
    for before, step in itertools.pairwise(STEPS[1:]):
        more = per_device[step] - per_device[before]
        print(f"{step}: +{more:.4f} % of a core a device over {before}", flush=True)
    print(f"hub alone: {pct['empty']:.3f} % of a core; each step: {pct}", file=sys.stderr)
    figures = [f"devices={n}"]
    figures += [f"{s}_idle_cpu_pct_per_device={v:.4f}" for s, v in per_device.items()]
    figures.append(f"floor_over_target={per_device['commands'] / TARGET_PCT:.2f}")
    print(" ".join(figures))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
