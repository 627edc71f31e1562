"""How fast a skipped range is refilled from the island, and how soon a gap is noticed.

A device's hub mirror is made to skip readings the way nats-server does (the island
consumer's floor moved past them while the link is cut; `tests/test_refill.py`), over a
shaped link (100 ms round trip, 2 Mbit/s each way by default; `hub_ingest.local.link.Shape`):

- **throughput**: `--readings` readings skipped at once (the mirror skips them when the
  next reading arrives); the time from the link's return until the aggregate holds them
  all, as readings per second, against the baseline of the same number of readings drained
  the usual way (through the mirror) over the same link in the same run;
- **detection delay**: `--gaps` small gaps made one after the other; for each, the time from
  the mirror's skip (its last sequence jumps past the range) to the range in the aggregate.

    .venv/bin/python bench/refill.py [--readings 5000] [--gaps 10] [--rtt 0.1] [--mbit 2]

Last line: ``refill_per_s=… refill_vs_mirror=… detect_median_s=… detect_p90_s=… lost=0
duplicated=0``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from bench.slow_link import reading
from edge_agent.protocol.logs import configure_logging
from hub_ingest.fleet.gaps import REFILL_HEADER
from hub_ingest.local.link import Shape
from tests.support.cluster import Device, Hub, mirror_live, reset_uplink, start_hub
from tests.support.scan import scan
from tests.support.waiting import RESUME_TIMEOUT, eventually


async def _publish(device: Device, first: int, count: int) -> None:
    for start in range(first, first + count, 500):
        batch = range(start, min(start + 500, first + count))
        await asyncio.gather(*(device.js.publish("tele.bench", reading(i)) for i in batch))


async def _in_aggregate(hub: Hub, device: Device) -> int:
    info = await hub.js.stream_info("FLEET_TELEMETRY", subjects_filter=f"fleet.{device.id}.>")
    return sum((info.state.subjects or {}).values())


async def _wait_aggregate(hub: Hub, device: Device, count: int) -> None:
    async def there() -> bool:
        return await _in_aggregate(hub, device) >= count

    await eventually(there, timeout=1800, interval=0.05, what=f"{count} in the aggregate")


async def _cut_and_fill(device: Device, first: int, count: int, *, skip: bool) -> None:
    """Readings `first`.. stored while the link is cut; with `skip`, the hub's mirror made to
    skip them when it binds again."""
    device.proxy.cut()
    await device.wait_link(up=False)
    await _publish(device, first, count)
    if skip:
        last = (await device.js.stream_info("TELEMETRY")).state.last_seq
        await reset_uplink(device, last + 1)


async def _mirror_last(hub: Hub, mirror: str) -> int:
    return (await hub.js.stream_info(mirror)).state.last_seq


@dataclass(frozen=True)
class Result:
    mirror_s: float  # the baseline: readings drained through the mirror
    refill_s: float  # the same number, skipped by the mirror and refilled
    delays: list[float]  # per small gap: the mirror's skip → the range in the aggregate
    lost: int
    duplicated: int
    refilled: int


async def run(root: Path, readings: int, gaps: int, shape: Shape) -> Result:
    hub = await start_hub(root)
    try:
        device = await hub.device("r", register_when_ready=True)
        await hub.provision()
        mirror = await hub.mirror(device.id)
        await eventually(lambda: mirror_live(hub.js, mirror), timeout=RESUME_TIMEOUT)
        device.proxy.shape = shape
        total = 0

        # Baseline: the same readings drained the usual way, through the mirror.
        await _cut_and_fill(device, total, readings, skip=False)
        start = time.monotonic()
        device.proxy.restore()
        total += readings
        await _wait_aggregate(hub, device, total)
        mirror_s = time.monotonic() - start
        print(f"baseline: {readings} through the mirror in {mirror_s:.1f}s", flush=True)

        # Refill: skipped by the mirror, read again from the island.
        await _cut_and_fill(device, total, readings, skip=True)
        start = time.monotonic()
        device.proxy.restore()
        total += readings + 1
        await _publish(device, total - 1, 1)  # the mirror skips when the next one arrives
        await _wait_aggregate(hub, device, total)
        refill_s = time.monotonic() - start

        delays = []
        for _ in range(gaps):
            await _cut_and_fill(device, total, 20, skip=True)
            device.proxy.restore()
            total += 21
            await _publish(device, total - 1, 1)
            await eventually(
                functools.partial(_skipped, hub, mirror, total),
                timeout=RESUME_TIMEOUT,
                interval=0.02,
            )
            skipped_at = time.monotonic()
            await _wait_aggregate(hub, device, total)
            delays.append(time.monotonic() - skipped_at)

        rows = await scan(hub.js, "FLEET_TELEMETRY", f"fleet.{device.id}.>")
        seqs = [json.loads(m.data)["seq"] for m in rows]
        refilled = sum(1 for m in rows if REFILL_HEADER in (m.headers or {}))
        return Result(
            mirror_s,
            refill_s,
            delays,
            lost=len(set(range(total)) - set(seqs)),
            duplicated=len(seqs) - len(set(seqs)),
            refilled=refilled,
        )
    finally:
        await hub.close()


async def _skipped(hub: Hub, mirror: str, through: int) -> bool:
    return await _mirror_last(hub, mirror) >= through


async def main(readings: int, gaps: int, shape: Shape) -> None:
    configure_logging("warning")
    print(f"link: {shape.rtt * 1000:.0f} ms rtt, {shape.rate * 8 / 1e6:g} Mbit/s")
    with tempfile.TemporaryDirectory(prefix="refill-") as tmp:
        got = await run(Path(tmp), readings, gaps, shape)
    delays = sorted(got.delays)
    p90 = delays[min(len(delays) - 1, int(0.9 * len(delays)))] if delays else float("nan")
    median = statistics.median(delays) if delays else float("nan")
    mirror_rate, refill_rate = readings / got.mirror_s, readings / got.refill_s
    print(
        f"mirror drain: {readings} readings in {got.mirror_s:.1f}s ({mirror_rate:.0f}/s); "
        f"refill: {readings} in {got.refill_s:.1f}s ({refill_rate:.0f}/s); "
        f"detection delays (s): {', '.join(f'{d:.1f}' for d in delays)}; "
        f"refilled {got.refilled} in all"
    )
    print(
        f"refill_per_s={refill_rate:.0f} refill_vs_mirror={refill_rate / mirror_rate:.2f} "
        f"detect_median_s={median:.1f} detect_p90_s={p90:.1f} "
        f"lost={got.lost} duplicated={got.duplicated}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--readings", type=int, default=5000)
    parser.add_argument("--gaps", type=int, default=10)
    parser.add_argument("--rtt", type=float, default=0.1, help="round trip, seconds")
    parser.add_argument("--mbit", type=float, default=2.0, help="Mbit/s each way")
    args = parser.parse_args()
    asyncio.run(main(args.readings, args.gaps, Shape(rtt=args.rtt, rate=args.mbit * 1e6 / 8)))
