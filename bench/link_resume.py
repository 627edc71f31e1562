"""Time from a link's return to data flowing again: ours against stock nats-server, same run.

Each round the device publishes ``tele.bench.<n>`` and the hub sends ``cmd.<id>.bench<n>``
while the link is cut; after the outage the link is restored and four paths are timed:

- telemetry, ours: the reading in ``FLEET_TELEMETRY`` (the hub's mirror is bound to a durable
  consumer the agent made on the island);
- telemetry, stock: the reading in ``STOCK_TELEMETRY``, a hub mirror of the same island stream
  made the default way (nats-server creates its own consumer, and retries with back-off);
- commands, ours: the command in the island's ``COMMANDS`` (bound to the hub's ``ISLAND``
  consumer);
- commands, stock: the command in ``STOCK_COMMANDS``, an island mirror of ``CMD_<id>`` made
  the default way.

With ``--hub-restarts N`` there are N more rounds where the hub's nats-server is SIGKILLed
and started again instead (the outage is the time it is down).

    .venv/bin/python bench/link_resume.py [--outages 5,30] [--cuts 3] [--hub-restarts 2]
    .venv/bin/python bench/link_resume.py --outages 5,30,180,660   # the full back-off range

Last line: ``telemetry_resume_median_s=… telemetry_resume_p90_s=… commands_resume_median_s=…``
and the same for ``stock_…``, then ``speedup=`` (stock telemetry median ÷ ours).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.api import ExternalStream, StreamConfig, StreamSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.protocol.logs import configure_logging
from edge_agent.protocol.names import (
    TELEMETRY,
    command_stream,
    island_name,
    js_api,
    to_device_prefix,
    to_hub_prefix,
)
from tests.support.cluster import Device, Hub, start_hub

GIVE_UP_S = 300.0  # a path that has not resumed by then is counted at this value
PATHS = ("telemetry", "stock_telemetry", "commands", "stock_commands")


@dataclass(frozen=True)
class Round:
    kind: str
    outage: float
    times: dict[str, float]


async def _has(js: JetStreamContext, stream: str, subject: str) -> bool:
    info = await js.stream_info(stream, subjects_filter=subject)
    return bool(info.state.subjects)


async def _time_until(js: JetStreamContext, stream: str, subject: str, start: float) -> float:
    deadline = start + GIVE_UP_S
    while time.monotonic() < deadline:
        try:
            if await _has(js, stream, subject):
                return time.monotonic() - start
        except Exception:  # the hub may still be starting: not there yet
            pass
        await asyncio.sleep(0.05)
    return GIVE_UP_S


async def add_stock_mirrors(hub: Hub, device: Device) -> None:
    """Mirrors of the same streams as nats-server makes them by default, for comparison."""
    await hub.js.add_stream(
        StreamConfig(
            name="STOCK_TELEMETRY",
            mirror=StreamSource(
                name=TELEMETRY,
                external=ExternalStream(
                    api=js_api(island_name(device.id)), deliver=f"{to_hub_prefix(device.id)}.stock"
                ),
            ),
        )
    )
    await device.js.add_stream(
        StreamConfig(
            name="STOCK_COMMANDS",
            mirror=StreamSource(
                name=command_stream(device.id),
                external=ExternalStream(
                    api=js_api(hub.config.nats.domain),
                    deliver=f"{to_device_prefix(device.id)}.stock",
                ),
            ),
        )
    )


async def _timed(hub: Hub, device: Device, n: int, start: float) -> dict[str, float]:
    tele, cmd = f"tele.bench.{n}", f"cmd.{device.id}.bench{n}"
    got = await asyncio.gather(
        _time_until(hub.js, "FLEET_TELEMETRY", f"fleet.{device.id}.{tele}", start),
        _time_until(hub.js, "STOCK_TELEMETRY", tele, start),
        _time_until(device.js, "COMMANDS", cmd, start),
        _time_until(device.js, "STOCK_COMMANDS", cmd, start),
    )
    return dict(zip(PATHS, got, strict=True))


async def cut_round(hub: Hub, device: Device, n: int, outage: float) -> Round:
    device.proxy.cut()
    await device.wait_link(up=False)
    await device.js.publish(f"tele.bench.{n}", b"x")
    await hub.js.publish(f"cmd.{device.id}.bench{n}", b"{}")
    await asyncio.sleep(outage)  # the outage itself: what is being simulated
    start = time.monotonic()
    device.proxy.restore()
    return Round("cut", outage, await _timed(hub, device, n, start))


async def hub_restart_round(hub: Hub, device: Device, n: int, outage: float) -> Round:
    hub.server.kill()
    await device.wait_link(up=False)
    await device.js.publish(f"tele.bench.{n}", b"x")
    await asyncio.sleep(outage)
    await hub.server.start()
    start = time.monotonic()
    await hub.js.publish(f"cmd.{device.id}.bench{n}", b"{}")
    return Round("hub restart", outage, await _timed(hub, device, n, start))


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


async def main(outages: list[float], cuts: int, hub_restarts: int) -> None:
    configure_logging("warning")
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="link-resume-") as tmp:
        hub = await start_hub(Path(tmp))
        try:
            device = await hub.device("bench", register_when_ready=True)
            await hub.provision()
            await add_stock_mirrors(hub, device)
            start = time.monotonic()
            await device.js.publish("tele.bench.0", b"x")
            await hub.js.publish(f"cmd.{device.id}.bench0", b"{}")
            first = await _timed(hub, device, 0, start)  # every path is live
            print(f"set-up: all four paths live ({max(first.values()):.1f}s)", flush=True)
            n = 1
            plan = [(cut_round, o) for o in outages for _ in range(cuts)]
            plan += [(hub_restart_round, 5.0)] * hub_restarts
            for run_round, outage in plan:
                result = await run_round(hub, device, n, outage)
                rounds.append(result)
                shown = "  ".join(f"{p} {t:.2f}s" for p, t in result.times.items())
                print(f"{result.kind} {n}: outage {outage:.0f}s  {shown}", flush=True)
                n += 1
        finally:
            await hub.close()
    figures = {}
    for path in PATHS:
        values = [r.times[path] for r in rounds]
        figures[f"{path}_resume_median_s"] = statistics.median(values)
        figures[f"{path}_resume_p90_s"] = p90(values)
    speedup = figures["stock_telemetry_resume_median_s"] / max(
        figures["telemetry_resume_median_s"], 0.01
    )
    print(
        f"rounds={len(rounds)} outages_s={','.join(f'{o:g}' for o in outages)} "
        f"hub_restarts={hub_restarts}"
    )
    print(" ".join(f"{k}={v:.2f}" for k, v in figures.items()) + f" speedup={speedup:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--outages", default="5,30", help="seconds per cut, comma-separated")
    parser.add_argument("--cuts", type=int, default=3, help="cuts per outage length")
    parser.add_argument("--hub-restarts", type=int, default=2)
    args = parser.parse_args()
    outages = [float(o) for o in args.outages.split(",")]
    asyncio.run(main(outages, args.cuts, args.hub_restarts))
