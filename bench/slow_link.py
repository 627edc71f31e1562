"""A backlog over a slow, lossy link: how close to the link's capacity it drains.

A device fills while its link is cut (default 50k readings of ~200-byte JSON); the link then
comes back as an LTE-like link (100 ms round trip, 2 Mbit/s each way, optional segment loss;
`hub_ingest.local.link.Shape`) and the time until the hub has every reading is measured. The
first run has leaf compression off (the baseline), the second nats-server's ``s2_auto``; each
uses a fresh hub and device. Midway through each drain a command is sent: it must start
(its result in the island's ``EVENTS``) within seconds, not after the backlog.

    .venv/bin/python bench/slow_link.py [--readings 50000] [--loss 0.01]

Figures: ``link_utilization`` = bytes that crossed toward the hub / (capacity * elapsed),
``payload_goodput_ratio`` = reading bytes delivered / (capacity * elapsed). Last line:
``link_utilization=… payload_goodput_ratio=… lost=0 duplicated=0`` (utilization of the
uncompressed run, goodput of the compressed one, losses and duplicates over both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.protocol.envelope import new_envelope
from edge_agent.protocol.logs import configure_logging
from hub_ingest.commands.send import send
from hub_ingest.local.link import Shape
from tests.support.cluster import Device, Hub, mirror_live, start_hub
from tests.support.commands import results
from tests.support.waiting import RESUME_TIMEOUT, eventually

LTE = Shape(rtt=0.1, rate=2_000_000 / 8)


@dataclass(frozen=True)
class Drain:
    compression: str
    readings: int
    payload_bytes: int
    elapsed_s: float
    bytes_up: int
    command_start_s: float
    at_hub: int
    lost: int
    duplicated: int

    def utilization(self, shape: Shape) -> float:
        return self.bytes_up / (shape.rate * self.elapsed_s)

    def goodput_ratio(self, shape: Shape) -> float:
        return self.payload_bytes / (shape.rate * self.elapsed_s)


def reading(i: int) -> bytes:
    """A ~200-byte JSON reading, as a sensor gateway sends them."""
    body = {
        "ts": f"2026-11-23T08:{i // 60 % 60:02d}:{i % 60:02d}.{i % 1000:03d}Z",
        "seq": i,
        "sensor": f"line-{i % 8}/temperature",
        "value": round(20 + (i % 97) / 10, 2),
        "unit": "celsius",
        "quality": "good",
        "site": "plant-7",
        "firmware": "4.12.0",
    }
    return json.dumps(body).encode().ljust(200)


async def _fill(device: Device, readings: int) -> int:
    payload = 0
    for start in range(0, readings, 500):
        batch = [reading(i) for i in range(start, min(start + 500, readings))]
        await asyncio.gather(*(device.js.publish("tele.line.temperature", b) for b in batch))
        payload += sum(len(b) for b in batch)
    return payload


async def _counts(hub: Hub, device: Device) -> tuple[int, int, int]:
    """(messages in the hub's mirror, its last seq, the device's readings in the aggregate)."""
    mirror = await hub.js.stream_info(await hub.mirror(device.id))
    fleet = await hub.js.stream_info("FLEET_TELEMETRY", subjects_filter=f"fleet.{device.id}.tele.>")
    at_hub = sum((fleet.state.subjects or {}).values())
    return mirror.state.messages, mirror.state.last_seq, at_hub


async def _command_start(hub: Hub, device: Device) -> float:
    """Seconds from sending a ping until its result is in the island's EVENTS."""
    envelope = new_envelope(device.id, "ping", {}, ttl=600)
    start = time.monotonic()
    await send(hub.js, envelope)
    await eventually(
        lambda: _has_result(device, envelope.id), timeout=120, interval=0.05, what="ping ran"
    )
    return time.monotonic() - start


async def _has_result(device: Device, command_id: str) -> bool:
    return command_id in await results(device.js, "EVENTS")


async def drain(
    root: Path, readings: int, shape: Shape, compression: str, *, cuts: int = 0
) -> Drain:
    """Fill a device while cut, restore a link shaped `shape`, time the drain (with `cuts`
    extra cuts during it) and check every reading reached the hub once."""
    hub = await start_hub(root, leaf_compression=compression)
    try:
        # Both ends set, so that each run measures its mode from the first byte (by default
        # a device chooses by the round trip it measures, `edge_agent.island.compression`).
        device = await hub.device(
            "slow", register_when_ready=True, sections={"hub": {"compression": compression}}
        )
        await hub.provision()
        mirror = await hub.mirror(device.id)
        await eventually(lambda: mirror_live(hub.js, mirror), timeout=RESUME_TIMEOUT)
        device.proxy.cut()
        await device.wait_link(up=False)
        payload = await _fill(device, readings)
        device.proxy.shape = shape
        device.proxy.bytes_up = 0
        start = time.monotonic()
        device.proxy.restore()
        command_s = -1.0
        cut_at = [readings * (k + 1) // (cuts + 2) for k in range(cuts)]
        while True:
            stored, last, at_hub = await _counts(hub, device)
            if command_s < 0 and stored >= readings // 2:
                command_s = await _command_start(hub, device)
            if cut_at and stored >= cut_at[0]:
                cut_at.pop(0)
                device.proxy.cut()
                await device.wait_link(up=False)
                device.proxy.restore()
            if at_hub >= readings and last >= readings:
                break
            if time.monotonic() - start > 1800:
                break
            await asyncio.sleep(0.25)
        elapsed = time.monotonic() - start
        # The mirror keeps the device's sequence numbers: complete and once means exactly
        # 1..N there, and N in the aggregate.
        stored, last, at_hub = await _counts(hub, device)
        return Drain(
            compression,
            readings,
            payload,
            elapsed,
            device.proxy.bytes_up,
            command_s,
            at_hub,
            lost=max(0, readings - min(stored, at_hub)),
            duplicated=max(0, at_hub - readings) + max(0, last - readings),
        )
    finally:
        await hub.close()


async def main(readings: int, loss: float) -> None:
    configure_logging("warning")
    shape = Shape(rtt=LTE.rtt, rate=LTE.rate, loss=loss, seed=7)
    print(f"link: {shape.rtt * 1000:.0f} ms rtt, {shape.rate * 8 / 1e6:g} Mbit/s, loss {loss}")
    runs = []
    for compression in ("off", "s2_auto"):
        with tempfile.TemporaryDirectory(prefix="slow-link-") as tmp:
            run = await drain(Path(tmp), readings, shape, compression)
        runs.append(run)
        print(
            f"compression {compression:>7}: {run.readings} readings in {run.elapsed_s:.1f}s, "
            f"{run.bytes_up / 1e6:.1f} MB crossed, utilization {run.utilization(shape):.2f}, "
            f"goodput {run.goodput_ratio(shape):.2f}x the raw link, "
            f"command started in {run.command_start_s:.2f}s, "
            f"lost {run.lost}, duplicated {run.duplicated}",
            flush=True,
        )
    base, compressed = runs
    print(
        f"compressed_vs_off_speedup={base.elapsed_s / compressed.elapsed_s:.2f} "
        f"command_start_max_s={max(r.command_start_s for r in runs):.2f}"
    )
    print(
        f"link_utilization={base.utilization(shape):.2f} "
        f"payload_goodput_ratio={compressed.goodput_ratio(shape):.2f} "
        f"lost={sum(r.lost for r in runs)} duplicated={sum(r.duplicated for r in runs)}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--readings", type=int, default=50_000)
    parser.add_argument("--loss", type=float, default=0.0, help="chance a segment is lost")
    args = parser.parse_args()
    asyncio.run(main(args.readings, args.loss))
