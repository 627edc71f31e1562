"""Resume latency of commands issued while a device is offline: stock mirror vs fast resume.

Two devices on one hub, both running the agent: ``stock`` with ``commands.fast_resume =
false`` (the executor only consumes the island's mirror) and ``fast`` with it on. For each
cut both links go down, a command is issued to each, the outage lasts until both mirrors
have not heard from the hub for ``--outage`` seconds (past ~10 s nats-server 2.15 may stall
a mirror for 10-40 s after the link returns), then both links are restored together.
Measured from the restore to the moment each command's handler starts on its device.

    .venv/bin/python bench/command_latency.py [--cuts 4] [--outage 12]

Last line: ``stock_median_s=... ours_median_s=... ours_p90_s=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.commands.handlers import HandlerContext, builtin_handlers
from edge_agent.protocol.logs import configure_logging
from tests.support.cluster import Device, Hub, start_hub
from tests.support.commands import send_command


async def _mirror_active(device: Device) -> float | None:
    info = await device.js.stream_info("COMMANDS")
    active = info.mirror.active if info.mirror else None
    return None if active is None or active < 0 else active / 1e9


async def _started(started: dict[str, float], command_id: str, since: float) -> float:
    while command_id not in started:
        await asyncio.sleep(0.01)
    return started[command_id] - since


async def one_cut(
    hub: Hub, stock: Device, fast: Device, *, started: dict[str, float], n: int, outage: float
) -> tuple[float, float]:
    for device in (stock, fast):
        while (active := await _mirror_active(device)) is None or active > 2:
            await asyncio.sleep(0.2)  # polling for the mirror to be live before the next cut
        device.proxy.cut()
    for device in (stock, fast):
        await device.wait_link(up=False)
    commands = [await send_command(hub, d.id, "mark") for d in (stock, fast)]
    for device in (stock, fast):
        while (active := await _mirror_active(device)) is None or active < outage:
            await asyncio.sleep(0.2)  # the outage itself: what is being simulated
    restored = time.monotonic()
    stock.proxy.restore()
    fast.proxy.restore()
    stock_s, ours_s = await asyncio.wait_for(
        asyncio.gather(*(_started(started, c.id, restored) for c in commands)), timeout=180
    )
    print(f"cut {n + 1}: stock mirror {stock_s:.2f}s  fast resume {ours_s:.2f}s", flush=True)
    return stock_s, ours_s


async def main(cuts: int, outage: float) -> None:
    configure_logging("warning")
    started: dict[str, float] = {}

    async def mark(ctx: HandlerContext, args: Mapping[str, Any]) -> Any:
        started[ctx.command_id] = time.monotonic()
        return None

    handlers = {**builtin_handlers(), "mark": mark}
    with tempfile.TemporaryDirectory(prefix="bench-cmd-") as root:
        hub = await start_hub(Path(root))
        try:
            stock, fast = [
                await hub.device(
                    name,
                    handlers=handlers,
                    register_when_ready=True,
                    sections={"commands": {"fast_resume": name == "fast"}},
                )
                for name in ("stock", "fast")
            ]
            samples = [
                await one_cut(hub, stock, fast, started=started, n=n, outage=outage)
                for n in range(cuts)
            ]
        finally:
            await hub.close()
    stock_s = [s for s, _ in samples]
    ours = sorted(o for _, o in samples)
    p90 = statistics.quantiles(ours, n=10, method="inclusive")[8] if len(ours) > 1 else ours[0]
    print(
        f"stock_median_s={statistics.median(stock_s):.2f} "
        f"ours_median_s={statistics.median(ours):.2f} ours_p90_s={p90:.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cuts", type=int, default=4)
    parser.add_argument(
        "--outage", type=float, default=12.0, help="seconds without mirror contact per cut"
    )
    args = parser.parse_args()
    asyncio.run(main(args.cuts, args.outage))
