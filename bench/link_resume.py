"""Time from a link restore to (a) telemetry flowing at the hub, (b) commands in the mirror.

Stock nats-server behaviour: sources and mirrors notice a dead link only after their
health checks, then retry with backoff, so data resumes seconds after the link does.

    .venv/bin/python bench/link_resume.py [--cuts 3] [--outage 20]

Last line: ``telemetry_resume_median_s=... commands_resume_median_s=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.protocol.logs import configure_logging
from tests.support.cluster import Device, Hub, start_hub


async def _has_subject(js: object, stream: str, subject: str) -> bool:
    info = await js.stream_info(stream, subjects_filter=subject)  # type: ignore[attr-defined]
    return bool(info.state.subjects)


async def _time_until(probe_stream: str, js: object, subject: str, start: float) -> float:
    while not await _has_subject(js, probe_stream, subject):
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def one_cut(hub: Hub, device: Device, n: int, outage: float) -> tuple[float, float]:
    device.proxy.cut()
    await device.wait_link(up=False)
    await device.js.publish(f"tele.bench.{n}", b"x")
    await hub.js.publish(f"cmd.{device.id}.bench{n}", b"{}")
    await asyncio.sleep(outage)  # the outage itself: what is being simulated
    start = time.monotonic()
    device.proxy.restore()
    tele, cmd = await asyncio.wait_for(
        asyncio.gather(
            _time_until("FLEET_TELEMETRY", hub.js, f"fleet.{device.id}.tele.bench.{n}", start),
            _time_until("COMMANDS", device.js, f"cmd.{device.id}.bench{n}", start),
        ),
        timeout=180,
    )
    print(
        f"cut {n + 1}: outage {outage:.0f}s  telemetry {tele:.2f}s  commands {cmd:.2f}s", flush=True
    )
    return tele, cmd


async def main(cuts: int, outage: float) -> None:
    configure_logging("warning")
    with tempfile.TemporaryDirectory(prefix="link-resume-") as tmp:
        hub = await start_hub(Path(tmp))
        try:
            device = await hub.device("bench")
            results = [await one_cut(hub, device, n, outage) for n in range(cuts)]
        finally:
            await hub.close()
    tele = statistics.median(r[0] for r in results)
    cmd = statistics.median(r[1] for r in results)
    print(f"cuts={cuts} outage_s={outage:g}")
    print(f"telemetry_resume_median_s={tele:.2f} commands_resume_median_s={cmd:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuts", type=int, default=3)
    parser.add_argument("--outage", type=float, default=20.0, help="seconds each cut lasts")
    args = parser.parse_args()
    asyncio.run(main(args.cuts, args.outage))
