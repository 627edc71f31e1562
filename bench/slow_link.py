"""A backlog over a slow, lossy link: how close to the link's capacity it drains.

A device fills while its link is cut (about 30 s of the raw link's worth of ~200-byte JSON
readings, or `--readings`); the link then comes back shaped (`hub_ingest.local.link.Shape`:
round trip, rate each way, segment loss) and the time until the hub has every reading, in
the device's mirror and in the fleet aggregate, is measured. Each shape is run with leaf
compression off (not with ``--compressed-only``) and with nats-server's ``s2_auto``, each on
a fresh hub and device, and against the physical limit measured through the same shaped
proxy in the same run: a plain bulk TCP transfer of the same reading bytes, raw and
snappy-compressed (s2's base format; the `cramjam` package). Two commands must start (their
results in the island's ``EVENTS``) within seconds, not after the backlog: one sent while
the link is cut (timed from the link's return: the agent reads it up the link the backlog
fills, or its mirror brings it), one sent midway through the drain. For context it first
measures how many unpacked readings a second the hub's store takes on this disk
(`bench/hub_store.py`: each stored and fsynced in the mirror and in the aggregate), which
can bound a compressed drain before the link does.

    .venv/bin/python bench/slow_link.py [--shape lte|rural|geo|all] [--readings N]
    .venv/bin/python bench/slow_link.py --day     # 86,400 readings, LTE, to the archive too
    .venv/bin/python bench/slow_link.py --no-pack # a reading a message (hub.pack = false)
    .venv/bin/python bench/slow_link.py --shape all --readings 86400 --compressed-only

Shapes: ``lte`` 100 ms, 2 Mbit/s, 1 % loss; ``rural`` 300 ms, 256 kbit/s, 5 %; ``geo``
(geostationary satellite) 600 ms, 1 Mbit/s, 1 %.

Figures, per run: ``utilization`` = bytes that crossed toward the hub / (rate * elapsed);
``goodput`` = reading bytes delivered / (rate * elapsed); ``tcp_ratio`` = the TCP transfer's
time / the drain's (1.0: as fast as a bulk copy of the same bytes, compressed alike). The last
line: ``link_utilization=… payload_goodput_ratio=… tcp_ratio=… day_backlog_s=… lost=…
duplicated=… command_start_s=…`` (the compressed runs' worst utilization, goodput and TCP
ratio over the shapes, the slowest of either command; ``day_backlog_s`` only with ``--day``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import cramjam
from nats.js.errors import NotFoundError
from pyspark.sql import SparkSession

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from bench.hub_store import measure as store_rate
from edge_agent.protocol.envelope import new_envelope
from edge_agent.protocol.logs import configure_logging
from edge_agent.protocol.pack import PACK_HEADER, PACK_SUBJECT, pack_range
from hub_ingest.archive import table
from hub_ingest.commands.send import send
from hub_ingest.ingest.job import IngestSummary, ingest, spark_session
from hub_ingest.local.link import LinkProxy, Shape
from tests.support.cluster import (
    Device,
    Hub,
    mirror_live,
    packed_readings,
    start_hub,
    stream_messages,
)
from tests.support.commands import command_fence, results
from tests.support.waiting import RESUME_TIMEOUT, eventually

LTE = Shape(rtt=0.1, rate=2_000_000 / 8)
SHAPES = {
    "lte": Shape(rtt=0.1, rate=2_000_000 / 8, loss=0.01, seed=7),
    "rural": Shape(rtt=0.3, rate=256_000 / 8, loss=0.05, seed=7),
    "geo": Shape(rtt=0.6, rate=1_000_000 / 8, loss=0.01, seed=7),
}
READING_BYTES = 200
DAY = 86_400  # a day of readings at 1 Hz
SUBJECT = "tele.line.temperature"
# How often the hub is asked during a drain: its end is timed to within this, and a TCP
# copy's exactly (a 0.25 s poll added ~0.1 s to a drain of 5 s).
POLL_S = 0.05


@dataclass(frozen=True)
class Drain:
    compression: str
    readings: int
    payload_bytes: int
    elapsed_s: float
    bytes_up: int
    command_start_s: float  # a command sent halfway through the drain
    offline_command_s: float  # one sent while the link was down, from the link's return
    resumed_s: float  # from the link's return until the hub's mirror took a first reading
    at_hub: int
    lost: int
    duplicated: int
    archive_s: float | None = None  # until every reading was in the archive (`spark` runs)

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
    return json.dumps(body).encode().ljust(READING_BYTES)


async def _fill(device: Device, readings: int) -> int:
    """Publish `readings` to the island; their bytes."""
    payload = 0
    for start in range(0, readings, 500):
        batch = [reading(m) for m in range(start, min(start + 500, readings))]
        await asyncio.gather(*(device.js.publish(SUBJECT, b) for b in batch))
        payload += sum(len(b) for b in batch)
    return payload


async def _counts(hub: Hub, device: Device, packed: bool) -> tuple[int, int, int]:
    """(readings in the hub's mirror, the last one's seq, the device's readings in the
    aggregate); packed, the last reading of the last pack in each."""
    mirror = await hub.mirror(device.id)
    if packed:
        in_mirror = await _last_packed(hub, mirror, PACK_SUBJECT)
        in_fleet = await _last_packed(hub, "FLEET_TELEMETRY", f"fleet.{device.id}.{PACK_SUBJECT}")
        return in_mirror, in_mirror, in_fleet
    state = (await hub.js.stream_info(mirror)).state
    fleet = await hub.js.stream_info("FLEET_TELEMETRY", subjects_filter=f"fleet.{device.id}.tele.>")
    return state.messages, state.last_seq, sum((fleet.state.subjects or {}).values())


async def _last_packed(hub: Hub, stream: str, subject: str) -> int:
    try:
        msg = await hub.js.get_last_msg(stream, subject, direct=True)
    except NotFoundError:
        return 0
    return pack_range((msg.headers or {})[PACK_HEADER])[1]


async def _packed_seqs(hub: Hub, stream: str, device_id: str) -> list[int]:
    """Every reading sequence in the packs `stream` holds from the device, in order."""
    subjects = (PACK_SUBJECT, f"fleet.{device_id}.{PACK_SUBJECT}")
    msgs = [m for m in await stream_messages(hub.js, stream) if m.subject in subjects]
    return [r.seq for r in packed_readings(msgs)]


async def _command_start(hub: Hub, device: Device) -> float:
    """Seconds from sending a ping until its result is in the island's EVENTS."""
    envelope = new_envelope(device.id, "ping", {}, ttl=600)
    start = time.monotonic()
    await send(hub.js, envelope)
    await eventually(
        lambda: _has_result(device, envelope.id), timeout=120, interval=0.05, what="ping ran"
    )
    return time.monotonic() - start


async def _fenced(device: Device) -> bool:
    return await command_fence(device) is not None  # 0 for a device sent nothing yet


async def _has_result(device: Device, command_id: str) -> bool:
    return command_id in await results(device.js, "EVENTS")


async def drain(
    root: Path,
    readings: int,
    shape: Shape,
    compression: str,
    *,
    cuts: int = 0,
    spark: SparkSession | None = None,
    packed: bool = False,
) -> Drain:
    """Fill a device while cut, restore a link shaped `shape`, time the drain (with `cuts`
    extra cuts during it) and check every reading reached the hub once; with `spark`, the
    ingest runs meanwhile and the time until the archive has every reading is taken too.
    `packed`: the device packs its telemetry (``hub.pack``)."""
    hub = await start_hub(root, leaf_compression=compression)
    stop_ingest = threading.Event()
    ingesting: asyncio.Future[IngestSummary] | None = None
    try:
        # Both ends set, so that each run measures its mode from the first byte (by default
        # a device chooses by the round trip it measures, `edge_agent.island.compression`).
        device = await hub.device(
            "slow",
            register_when_ready=True,
            sections={"hub": {"compression": compression, "pack": packed}},
        )
        await hub.provision()
        mirror = await hub.mirror(device.id)
        await eventually(lambda: mirror_live(hub.js, mirror), timeout=RESUME_TIMEOUT)
        # An established device is cut: a new one's first contact also asks the hub for its
        # command fence, a request more up the link before its first command runs.
        await eventually(lambda: _fenced(device), timeout=RESUME_TIMEOUT, what="command fence")
        device.proxy.cut()
        await device.wait_link(up=False)
        payload = await _fill(device, readings)
        offline = new_envelope(device.id, "ping", {}, ttl=600)
        await send(hub.js, offline)
        device.proxy.shape = shape
        device.proxy.bytes_up = 0
        if spark is not None:
            ingesting = asyncio.ensure_future(
                asyncio.to_thread(ingest, spark, hub.config, once=False, stop=stop_ingest)
            )
        start = time.monotonic()
        device.proxy.restore()
        command_s, offline_s, resumed_s = await _until_drained(
            hub, device, readings, packed=packed, cuts=cuts, offline=offline.id, start=start
        )
        elapsed = time.monotonic() - start
        archive_s = None
        if spark is not None:
            await eventually(
                lambda: _archived(hub, readings), timeout=600, interval=1.0, what="archived"
            )
            archive_s = time.monotonic() - start
        at_hub, lost, duplicated = await _verify(hub, device, readings, packed)
        return Drain(
            compression,
            readings,
            payload,
            elapsed,
            device.proxy.bytes_up,
            command_s,
            offline_s,
            resumed_s,
            at_hub,
            lost=lost,
            duplicated=duplicated,
            archive_s=archive_s,
        )
    finally:
        stop_ingest.set()
        if ingesting is not None:
            await ingesting
        await hub.close()


async def _until_drained(
    hub: Hub, device: Device, readings: int, *, packed: bool, cuts: int, offline: str, start: float
) -> tuple[float, float, float]:
    """Watch the drain (cutting the link `cuts` times in it) until the hub has every reading
    and command `offline` ran: (a command's start midway, `offline`'s start, the first
    reading at the hub), in seconds, each from `start` but the first."""
    command_s = offline_s = resumed_s = -1.0
    cut_at = [readings * (k + 1) // (cuts + 2) for k in range(cuts)]
    while time.monotonic() - start < 1800:
        stored, last, at_hub = await _counts(hub, device, packed)
        if resumed_s < 0 and stored > 0:
            resumed_s = time.monotonic() - start
        if offline_s < 0 and await _has_result(device, offline):
            offline_s = time.monotonic() - start
        if command_s < 0 and stored >= readings // 2:
            command_s = await _command_start(hub, device)
        if cut_at and stored >= cut_at[0]:
            cut_at.pop(0)
            device.proxy.cut()
            await device.wait_link(up=False)
            device.proxy.restore()
        if at_hub >= readings and last >= readings and offline_s >= 0:
            break
        await asyncio.sleep(POLL_S)
    return command_s, offline_s, resumed_s


async def _verify(hub: Hub, device: Device, readings: int, packed: bool) -> tuple[int, int, int]:
    """(readings at the hub, lost, duplicated). The mirror keeps the device's sequence
    numbers: complete and once means exactly 1..N there, and N in the aggregate (packed: in
    the packs each holds)."""
    if packed:
        mirror = await _packed_seqs(hub, await hub.mirror(device.id), device.id)
        fleet = await _packed_seqs(hub, "FLEET_TELEMETRY", device.id)
        return len(fleet), *_lost_duplicated(readings, mirror, fleet)
    stored, last, at_hub = await _counts(hub, device, packed)
    lost = max(0, readings - min(stored, at_hub))
    return at_hub, lost, max(0, at_hub - readings) + max(0, last - readings)


def _lost_duplicated(readings: int, *copies: list[int]) -> tuple[int, int]:
    """Readings 1..`readings` missing from any copy, and copies of a reading beyond one."""
    wanted = set(range(1, readings + 1))
    lost = len(set().union(*(wanted - set(c) for c in copies)))
    return lost, sum(len(c) - len(set(c)) + len(set(c) - wanted) for c in copies)


async def _archived(hub: Hub, readings: int) -> bool:
    rows = await asyncio.to_thread(
        table.read, hub.config.ingest, ["hub_seq"], row_filter=f"subject = '{SUBJECT}'"
    )
    return rows is not None and rows.num_rows >= readings


async def tcp_seconds(data: bytes, shape: Shape) -> float:
    """How long a plain bulk TCP copy of `data` takes through a proxy shaped `shape`: the
    physical limit a drain of the same bytes is compared with."""
    received = 0
    done, closed = asyncio.Event(), asyncio.Event()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        while chunk := await reader.read(65536):
            received += len(chunk)
            if received >= len(data):
                done.set()
        writer.close()
        closed.set()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    try:
        async with LinkProxy(server.sockets[0].getsockname()[1], shape=shape) as proxy:
            _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            start = time.monotonic()
            writer.write(data)
            await writer.drain()
            await asyncio.wait_for(done.wait(), timeout=1800)
            elapsed = time.monotonic() - start
            writer.close()
            await closed.wait()  # the proxy's pipes end before the proxy closes
    finally:
        server.close()
    return elapsed


@dataclass(frozen=True)
class ShapeRun:
    name: str
    shape: Shape
    tcp_compressed_s: float
    compressed: Drain
    tcp_raw_s: float | None = None  # None: `--compressed-only`
    off: Drain | None = None

    def line(self) -> str:
        on = self.compressed
        parts = [f"{self.name}: {on.readings} readings; tcp {self.tcp_compressed_s:.1f}s snappy"]
        if self.off is not None and self.tcp_raw_s is not None:
            off = self.off
            parts.append(
                f"off {off.elapsed_s:.1f}s (tcp {self.tcp_raw_s:.1f}s raw), utilization "
                f"{off.utilization(self.shape):.2f}, tcp_ratio "
                f"{self.tcp_raw_s / off.elapsed_s:.2f}, command started in "
                f"{off.command_start_s:.2f}s, one sent while cut {off.offline_command_s:.2f}s "
                "after the link returned"
            )
        parts.append(
            f"s2_auto {on.elapsed_s:.1f}s (resumed after {on.resumed_s:.1f}s, then "
            f"{on.elapsed_s - on.resumed_s:.1f}s: tcp_ratio "
            f"{self.tcp_compressed_s / (on.elapsed_s - on.resumed_s):.2f}), utilization "
            f"{on.utilization(self.shape):.2f}, goodput {on.goodput_ratio(self.shape):.2f}x, "
            f"{on.readings / on.elapsed_s:.0f} readings/s, tcp_ratio {self.tcp_ratio:.2f}, "
            f"command started in {on.command_start_s:.2f}s, one sent while cut "
            f"{on.offline_command_s:.2f}s after the link returned"
        )
        lost = sum(d.lost for d in self.drains)
        parts.append(f"lost {lost}, duplicated {sum(d.duplicated for d in self.drains)}")
        return " | ".join(parts)

    @property
    def drains(self) -> list[Drain]:
        return [d for d in (self.off, self.compressed) if d is not None]

    @property
    def tcp_ratio(self) -> float:
        """The compressed drain against a compressed bulk copy of the same readings."""
        return self.tcp_compressed_s / self.compressed.elapsed_s


async def run_shape(
    name: str, shape: Shape, readings: int, packed: bool = False, compressed_only: bool = False
) -> ShapeRun:
    """A shape's drains and TCP copies: compressed, and (unless `compressed_only`) not."""
    data = b"".join(reading(i) for i in range(readings))
    tcp_compressed = await tcp_seconds(bytes(cramjam.snappy.compress(data)), shape)
    compressed = await _drain_once(readings, shape, "s2_auto", packed)
    tcp_raw, off = None, None
    if not compressed_only:
        tcp_raw = await tcp_seconds(data, shape)
        off = await _drain_once(readings, shape, "off", packed)
    run = ShapeRun(name, shape, tcp_compressed, compressed, tcp_raw, off)
    print(run.line(), flush=True)
    return run


async def _drain_once(readings: int, shape: Shape, compression: str, packed: bool) -> Drain:
    with tempfile.TemporaryDirectory(prefix="slow-link-") as tmp:
        return await drain(Path(tmp), readings, shape, compression, packed=packed)


async def day(packed: bool) -> Drain:
    """A day of readings over the headline link (2 Mbit/s, 100 ms), the ingest running."""
    spark = spark_session("local[2]")
    try:
        with tempfile.TemporaryDirectory(prefix="slow-link-day-") as tmp:
            run = await drain(Path(tmp), DAY, LTE, "s2_auto", spark=spark, packed=packed)
    finally:
        spark.stop()
    print(
        f"day: {run.readings} readings at the hub in {run.elapsed_s:.1f}s, in the archive in "
        f"{run.archive_s:.1f}s (resumed after {run.resumed_s:.1f}s); utilization "
        f"{run.utilization(LTE):.2f}, goodput "
        f"{run.goodput_ratio(LTE):.2f}x, command started in {run.command_start_s:.2f}s "
        f"(sent while cut: {run.offline_command_s:.2f}s after the link returned), "
        f"lost {run.lost}, duplicated {run.duplicated}",
        flush=True,
    )
    return run


async def main(args: argparse.Namespace) -> None:
    configure_logging("warning")
    with tempfile.TemporaryDirectory(prefix="slow-link-store-", dir="/var/tmp") as tmp:
        ceiling = await store_rate("always", Path(tmp), 1, 10_000, 1)
    # Unpacked, the hub stores and fsyncs each reading twice (mirror, aggregate): a drain
    # faster than the link can still be held to this by the hub's disk.
    print(f"the hub's store here takes {ceiling:.0f} unpacked readings/s", flush=True)
    whole_day = await day(args.pack) if args.day else None
    runs = []
    for name in list(SHAPES) if args.shape == "all" else [args.shape]:
        shape = SHAPES[name]
        count = args.readings or int(shape.rate * args.seconds / READING_BYTES)
        runs.append(await run_shape(name, shape, count, args.pack, args.compressed_only))
    drains = [d for r in runs for d in r.drains]
    if whole_day is not None:
        drains.append(whole_day)
    day_s = f"day_backlog_s={whole_day.elapsed_s:.1f} " if whole_day else ""
    print(
        f"link_utilization={min(r.compressed.utilization(r.shape) for r in runs):.2f} "
        f"payload_goodput_ratio={min(r.compressed.goodput_ratio(r.shape) for r in runs):.2f} "
        f"tcp_ratio={min(r.tcp_ratio for r in runs):.2f} {day_s}"
        f"lost={sum(d.lost for d in drains)} duplicated={sum(d.duplicated for d in drains)} "
        f"command_start_s={max(max(d.command_start_s, d.offline_command_s) for d in drains):.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="lte")
    parser.add_argument("--readings", type=int, help="backlog size (default: --seconds' worth)")
    parser.add_argument("--seconds", type=float, default=30.0, help="raw link time to fill")
    parser.add_argument("--day", action="store_true", help="first a day's backlog, archived")
    parser.add_argument(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the device packs its telemetry (hub.pack, the default)",
    )
    parser.add_argument(
        "--compressed-only",
        action="store_true",
        help="skip the uncompressed drain and raw TCP copy (long on slow links, large backlogs)",
    )
    asyncio.run(main(parser.parse_args()))
