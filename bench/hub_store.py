"""How many readings a second the hub's store takes, with many devices sending at once.

Every reading the hub keeps is stored twice, each time with an fsync under the default
`sync = "always"`: in the device's mirror and in the fleet's aggregate that sources it. This
bench measures that path alone on this machine's disk (``--dir``): `--streams` streams stand
in for the devices' mirrors, each filled by a pipelined publisher as a draining mirror is,
and one aggregate sources them all; it times until the aggregate holds every message. Each
is run unpacked (a message per ~200-byte reading) and packed (`--pack` readings a message, as
`hub.pack` sends them), under ``always`` and under nats-server's default ``2m`` (the
baseline, the same process), which fsyncs in the background.

    .venv/bin/python bench/hub_store.py [--streams 1,16,64] [--readings 20000] [--pack 128]

Last line: ``always_readings_per_s=… always_packed_readings_per_s=… always_ratio=…
fsync_per_s=…`` where the rates are at the largest `--streams`, the ratio is ``always`` over
the baseline unpacked, and ``fsync_per_s`` is what this disk takes from one writer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nats
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig, StreamSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from bench.sync_policy import start_store

BASELINE = "2m"  # nats-server's default sync_interval
READING = json.dumps({"ts": "2026-11-27T03:00:00.000Z", "value": 21.5, "pad": "x" * 140}).encode()
_PIPELINE = 256  # publishes in flight per stream, as a mirror's window keeps many in flight


def fsync_per_s(directory: Path, writes: int = 2000) -> float:
    """Appends of one reading, each fsynced, a second: what one stream's store can do."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        start = time.perf_counter()
        for _ in range(writes):
            os.write(fd, READING)
            os.fsync(fd)
        return writes / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()


async def _fill(js: JetStreamContext, stream: int, messages: int, payload: bytes) -> None:
    for start in range(0, messages, _PIPELINE):
        batch = range(start, min(start + _PIPELINE, messages))
        await asyncio.gather(*(js.publish(f"dev.{stream}", payload) for _ in batch))


async def _held(js: JetStreamContext, want: int, deadline: float) -> None:
    while (await js.stream_info("FLEET")).state.messages < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the aggregate did not take {want} messages in time")
        await asyncio.sleep(0.05)


async def measure(policy: str, root: Path, streams: int, readings: int, pack: int) -> float:
    """Readings a second from the first publish until the aggregate holds them all."""
    home = Path(tempfile.mkdtemp(prefix=f"{policy}-", dir=root))
    server, url = await start_store(home, policy, max_file_store="8GiB")
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        names = [f"EDGE_{i}" for i in range(streams)]
        for i, name in enumerate(names):
            await js.add_stream(StreamConfig(name, subjects=[f"dev.{i}"], storage=StorageType.FILE))
        await js.add_stream(StreamConfig("FLEET", sources=[StreamSource(name) for name in names]))
        per_stream = max(readings // streams // pack, 1)
        payload = READING * pack
        start = time.monotonic()
        await asyncio.gather(*(_fill(js, i, per_stream, payload) for i in range(streams)))
        await _held(js, per_stream * streams, start + 600)
        return per_stream * streams * pack / (time.monotonic() - start)
    finally:
        await nc.close()
        await server.stop()


async def main(sizes: list[int], directory: Path, readings: int, pack: int) -> None:
    with tempfile.TemporaryDirectory(prefix="hub-store-", dir=directory) as tmp:
        root = Path(tmp)
        disk = fsync_per_s(root)
        print(f"this disk: {disk:.0f} fsyncs/s from one writer", flush=True)
        rates: dict[tuple[str, int, int], float] = {}
        for streams in sizes:
            for policy in ("always", BASELINE):
                for per in (1, pack):
                    rate = await measure(policy, root, streams, readings, per)
                    rates[policy, streams, per] = rate
                    print(
                        f"{streams:4d} streams, sync {policy:>6}, {per:4d} readings a message: "
                        f"{rate:9.0f} readings/s",
                        flush=True,
                    )
    most = max(sizes)
    always, packed = rates["always", most, 1], rates["always", most, pack]
    print(
        f"always_readings_per_s={always:.0f} always_packed_readings_per_s={packed:.0f} "
        f"always_ratio={always / rates[BASELINE, most, 1]:.2f} fsync_per_s={disk:.0f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--streams", default="1,16,64", help="comma-separated")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="on the disk to test")
    parser.add_argument("--readings", type=int, default=20000, help="per run")
    parser.add_argument("--pack", type=int, default=128, help="readings a packed message")
    args = parser.parse_args()
    sizes = [int(s) for s in args.streams.split(",")]
    asyncio.run(main(sizes, args.dir, args.readings, args.pack))
