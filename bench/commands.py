"""Online command round trip, and outbox drain rate against raw nats-py publishing.

1. Round trip: ``ping`` sent at the hub (``COMMANDS``) → device mirror → executor → outbox
   → island ``EVENTS`` → hub ``FLEET_EVENTS``, one command at a time, link up.
2. Drain rate: rows committed to a fresh outbox, then drained to the island (PubAck, then
   delete), against the same number of messages sent with nats-py ``publish_async`` to the
   same island and stream (baseline, no outbox, no headers).

    .venv/bin/python bench/commands.py [--commands 1000] [--messages 20000]

Last line: ``rtt_median_ms=... rtt_p99_ms=... drain_per_s=... raw_per_s=... drain_ratio=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.core.statedb import StateDB
from edge_agent.outbox.drain import Drainer
from edge_agent.outbox.store import Outbox
from edge_agent.protocol.logs import configure_logging
from hub_ingest.commands.send import ResultReader, event_streams, new_envelope, send
from hub_ingest.fleet.registry import Registry
from tests.support.cluster import Device, Hub, start_hub


async def round_trips(hub: Hub, device: Device, n: int) -> list[float]:
    devices = await (await Registry.open(hub.js)).list()
    samples = []
    async with ResultReader.open(hub.js, event_streams(devices), since=None) as reader:
        for _ in range(n):
            envelope = new_envelope(device.id, "ping", {}, 3600)
            start = time.monotonic()
            await send(hub.js, envelope)
            while not any(r["command_id"] == envelope.id for _, r in await reader.read(5.0)):
                pass
            samples.append(time.monotonic() - start)
    return samples


async def raw_rate(device: Device, n: int, payload: bytes) -> float:
    nc = await nats.connect(device.config.island.client_url)
    js = nc.jetstream()
    start = time.monotonic()
    for i in range(n):
        await js.publish_async(f"evt.bench.raw.{i % 16}", payload)
    await js.publish_async_completed()
    elapsed = time.monotonic() - start
    await nc.close()
    return n / elapsed


async def drain_rate(device: Device, root: Path, n: int, payload: bytes) -> float:
    nc = await nats.connect(device.config.island.client_url)
    async with await StateDB.open(root / "bench-outbox.sqlite3") as db:
        outbox = Outbox(db, max_bytes=1024**3)
        await outbox.append_many((f"evt.bench.outbox.{i % 16}", payload) for i in range(n))
        start = time.monotonic()
        sent = await Drainer(outbox, nc.jetstream()).drain()
        elapsed = time.monotonic() - start
    await nc.close()
    assert sent == n, (sent, n)
    return n / elapsed


async def main(commands: int, messages: int) -> None:
    configure_logging("warning")
    payload = b"x" * 100
    with tempfile.TemporaryDirectory(prefix="bench-commands-") as tmp:
        root = Path(tmp)
        hub = await start_hub(root)
        try:
            device = await hub.device("a", register_when_ready=True)
            rtt = sorted(await round_trips(hub, device, commands))
            raw = await raw_rate(device, messages, payload)
            drained = await drain_rate(device, root, messages, payload)
        finally:
            await hub.close()
    p99 = statistics.quantiles(rtt, n=100, method="inclusive")[98]
    print(f"round trip over {commands} commands: median {statistics.median(rtt) * 1000:.1f} ms")
    print(f"{messages} messages: raw publish_async {raw:.0f}/s, outbox drain {drained:.0f}/s")
    print(
        f"rtt_median_ms={statistics.median(rtt) * 1000:.1f} rtt_p99_ms={p99 * 1000:.1f} "
        f"drain_per_s={drained:.0f} raw_per_s={raw:.0f} drain_ratio={drained / raw:.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commands", type=int, default=1000)
    parser.add_argument("--messages", type=int, default=20000)
    args = parser.parse_args()
    asyncio.run(main(args.commands, args.messages))
