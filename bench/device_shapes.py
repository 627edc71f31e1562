"""What one device costs the hub in each shape its per-device objects could take, measured.

Each device is a bare island (nats-server at niceness 19, its own JetStream domain) with two
streams, ``T`` and ``E``, each with the durable flow-controlled consumer the hub binds to, and
a mirror ``C`` of its commands bound to a durable consumer on the hub, as the agent makes
them. The hub is split as the product's is (`hub_ingest/fleet/auth.py`): the streams in
``FLEET``, the links in an account of their own (``D0``; with ``--per-account N``, accounts
``D<k>`` of N devices each), isolated links, ``GOGC=25``, uncompressed links. The shapes
differ in what the hub holds per device:

- ``current``, the product's: two mirrors (``MT<i>``, ``ME<i>``) that the aggregates source,
  and ``CMD<i>``, which sources the device's slice of ``COMMANDS`` and holds the consumer
  the island's command mirror binds to. Three streams, five flow-controlled consumers.
- ``direct``, the seed's: no hub mirror; the aggregates source the islands' streams across
  the links. ``CMD<i>`` as in ``current``.
- ``filtered``: the mirrors as in ``current``; no ``CMD<i>``: the island's command mirror
  binds to a durable consumer on ``COMMANDS`` filtered to the device's commands and the
  broadcasts.
- ``lean``: ``direct`` and ``filtered`` together: no stream per device at all.
- ``single``: ``lean`` with one island stream instead of two (telemetry and events in one).
- ``mirrored``: ``filtered`` with one island stream: one hub mirror per device, no other
  stream of its own.

Per shape: steady memory, descriptors right after every stream was written, idle CPU; then
the hub SIGKILLed with one new message on every island stream, started again, and timed
until the aggregates hold every one (`resume`), and then until a broadcast sent is on
every island (`command`). With ``--callout`` each shape is measured again with its devices
admitted by an auth callout (`bench.fleetscale.callout`) instead of users in the hub's
config, which then names no device: adding one needs no reload, and every link made after
a restart waits for the callout's answer.

    .venv/bin/python bench/device_shapes.py --devices 100
    .venv/bin/python bench/device_shapes.py --devices 500 --shapes current --callout

Last line: ``devices=… <shape>_<figure>=…`` for each shape, then each figure of the other
shapes over ``current``'s in the same run (``<shape>_cpu_ratio=…``, ``…_rss_ratio``,
``…_fds_ratio``, ``…_resume_ratio``), and of a shape admitted by the callout over the same
shape's (``current_callout_resume_ratio=…``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    ExternalStream,
    StreamConfig,
    StreamConsumerSource,
    StreamSource,
    SubjectTransform,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from bench.fleetscale.bare import hub_client, start_island, stream_messages
from bench.fleetscale.callout import Callout
from bench.fleetscale.common import BenchError, proc_cpu_s, proc_fds, proc_rss_mib
from bench.fleetscale.plainhub import hub_config
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.natsserver import ServerProcess
from edge_agent.protocol.reconcile import mirror_consumer
from hub_ingest.fleet.server import SERVER_ENV
from hub_ingest.local.fleet import free_port

SHAPES = ("current", "direct", "filtered", "lean", "single", "mirrored")
UPLINK = ("T", "E")  # the island streams the hub collects
PER_AGGREGATE = 100  # sources of one aggregate shard: the product's default
HUB_API = "$JS.hub.API"
CALLOUT = "_callout"  # a shape measured again, its devices admitted by an auth callout
MONITOR_TIMEOUT = 20.0
WINDOW = 1000  # deliveries in flight on a bound consumer
ISLAND_LIMITS = "max_file_store: 64MB, max_memory_store: 8MB"
# With --pin: the hub on the first CPU, the islands on the others, so that neither waits for
# the other's turn (the islands at niceness 19 still take what the hub leaves when unpinned).
ISLAND_CPUS = set(range(1, os.cpu_count() or 2)) or {0}


def _bound_consumer(name: str, deliver: str, filters: list[str] | None = None) -> ConsumerConfig:
    """A durable push consumer a mirror or source binds to, as the product makes it."""
    return replace(mirror_consumer(name, deliver, {}, window=WINDOW), filter_subjects=filters)


def _island_source(i: int, stream: str, consumer: str) -> StreamSource:
    """The hub's read of island `i`'s `stream` through the consumer bound to it."""
    return StreamSource(
        name=stream,
        external=ExternalStream(api=f"$JS.d{i}.API"),
        consumer=StreamConsumerSource(name=consumer, deliver_subject=f"hubin.d{i}.{stream}"),
    )


@dataclass
class Result:
    rss_mib: float = 0.0
    fds: int = 0
    idle_cpu_pct: float = 0.0
    streams: int = 0
    consumers: int = 0
    resume_s: float = float("nan")
    command_s: float = float("nan")
    restart_peak_mib: float = 0.0


class Fleet:
    def __init__(
        self, root: Path, shape: str, n: int, args: argparse.Namespace, callout: bool
    ) -> None:
        self.root, self.shape, self.n = root, shape, n
        self.timeout, self.per_aggregate, self.pin = args.timeout, args.per_aggregate, args.pin
        self.per_account = args.per_account or n
        # Else the aggregates read the islands across the links.
        self.mirrors = shape in ("current", "filtered", "mirrored")
        self.own_commands = shape in ("current", "direct")  # a CMD<i> stream per device
        self.uplink = UPLINK[:1] if shape in ("single", "mirrored") else UPLINK
        self.ports = {"client": free_port(), "monitor": free_port(), "leaf": free_port()}
        self.callout = Callout(self.device_account) if callout else None
        conf = root / "hub.conf"
        conf.write_text(hub_config(n, self.per_account, self.ports, root / "hub", self.callout))
        monitor = f"http://127.0.0.1:{self.ports['monitor']}"
        self.hub = ServerProcess(conf, monitor, env=SERVER_ENV)
        # A hub busy with a fleet's links answers /jsz in seconds: a 2 s wait would miss
        # every answer and measure nothing.
        self.monitor = Monitor(monitor, timeout=MONITOR_TIMEOUT)
        self.unanswered = 0  # monitoring requests the hub did not answer in time
        self.islands: dict[int, NATS] = {}
        self.servers: list[ServerProcess] = []

    def island_consumer(self, i: int) -> str:
        return f"HUB{i // self.per_account}"

    def device_account(self, i: int) -> str | None:
        return f"D{i // self.per_account}" if i < self.n else None

    async def start_hub(self) -> None:
        await self.hub.start()
        if self.callout is not None:
            await self.callout.start(self.ports["client"])
        if self.pin:
            assert self.hub.proc is not None
            os.sched_setaffinity(self.hub.proc.pid, {0})

    async def start_island(self, i: int) -> None:
        cpus = ISLAND_CPUS if self.pin else None
        island, nc = await start_island(self.root, i, self.ports["leaf"], ISLAND_LIMITS, cpus)
        self.servers.append(island)
        self.islands[i] = nc
        js = nc.jetstream()
        for stream in self.uplink:
            await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream.lower()}.>"]))
            deliver = f"hubin.d{i}.{stream}"
            await js.add_consumer(stream, _bound_consumer(self.island_consumer(i), deliver))
            await js.publish(f"{stream.lower()}.d{i}", b"first")

    async def provision(self, js: JetStreamContext) -> None:
        """The hub's objects of the shape, then each island's command mirror bound to its
        consumer on the hub."""
        await js.add_stream(StreamConfig(name="COMMANDS", subjects=["cmd.>"]))
        for i in range(self.n):
            await self._provision_device(js, i)
        for shard in range(0, self.n, self.per_aggregate):
            for stream in self.uplink:
                sources = [
                    self._aggregate_source(i, stream)
                    for i in range(shard, min(shard + self.per_aggregate, self.n))
                ]
                await js.add_stream(StreamConfig(name=f"AGG_{stream}_{shard}", sources=sources))
        for i, nc in self.islands.items():
            stream, consumer = (f"CMD{i}", "ISLAND") if self.own_commands else ("COMMANDS", f"I{i}")
            source = StreamSource(
                name=stream,
                external=ExternalStream(api=HUB_API),
                consumer=StreamConsumerSource(name=consumer, deliver_subject=f"devin.d{i}.C"),
            )
            await nc.jetstream().add_stream(StreamConfig(name="C", mirror=source))

    async def _provision_device(self, js: JetStreamContext, i: int) -> None:
        filters = [f"cmd.d{i}.>", "cmd.all.>"]
        if self.own_commands:
            transforms = [SubjectTransform(src=f, dest=f) for f in filters]
            source = StreamSource(name="COMMANDS", subject_transforms=transforms)
            await js.add_stream(StreamConfig(name=f"CMD{i}", sources=[source]))
            await js.add_consumer(f"CMD{i}", _bound_consumer("ISLAND", f"devin.d{i}.C"))
        else:
            consumer = _bound_consumer(f"I{i}", f"devin.d{i}.C", filters)
            await js.add_consumer("COMMANDS", consumer)
        if self.mirrors:
            for stream in self.uplink:
                mirror = StreamConfig(name=f"M{stream}{i}", mirror=self._island_source(i, stream))
                await js.add_stream(mirror)

    def _island_source(self, i: int, stream: str) -> StreamSource:
        return _island_source(i, stream, self.island_consumer(i))

    def _aggregate_source(self, i: int, stream: str) -> StreamSource:
        if self.mirrors:
            return StreamSource(name=f"M{stream}{i}")
        return self._island_source(i, stream)

    async def held(self) -> dict[str, int]:
        held = await stream_messages(self.monitor)
        if held is None:
            self.unanswered += 1
        return held or {}

    async def await_uplink(self, count: int, what: str) -> float:
        """Until the aggregates hold `count` messages of every island stream."""
        start, want = time.monotonic(), count * self.n * len(self.uplink)
        while (got := sum(v for k, v in (await self.held()).items() if k.startswith("AGG"))) < want:
            if time.monotonic() - start > self.timeout:
                raise BenchError(
                    f"{self.shape} {what}: {got} of {want} after {self.timeout} s "
                    f"(the hub's /jsz unanswered {self.unanswered} times)"
                )
            await asyncio.sleep(0.5)
        return time.monotonic() - start

    async def await_commands(self, count: int) -> float:
        """Until every island's command mirror holds `count` messages."""
        start = time.monotonic()
        waiting = set(self.islands)
        while waiting:
            for i in list(waiting):
                with contextlib.suppress(Exception):
                    info = await self.islands[i].jetstream().stream_info("C")
                    if info.state.messages >= count:
                        waiting.discard(i)
            if waiting and time.monotonic() - start > self.timeout:
                raise BenchError(f"{self.shape}: {len(waiting)} islands without the command")
            if waiting:
                await asyncio.sleep(0.5)
        return time.monotonic() - start

    async def close(self) -> None:
        if self.callout is not None:
            print(f"{self.shape}: callout: {self.callout}", flush=True)
            await self.callout.close()
        for nc in self.islands.values():
            await nc.close()
        for server in [self.hub, *self.servers]:
            server.kill()


async def count_objects(fleet: Fleet, result: Result) -> None:
    jsz = await fleet.hub.monitor.get("/jsz?acc=FLEET")
    result.streams, result.consumers = int(jsz["streams"]), int(jsz["consumers"])


async def measure(
    root: Path, shape: str, n: int, args: argparse.Namespace, callout: bool = False
) -> Result:
    name = f"{shape}{CALLOUT}" if callout else shape
    (root / name).mkdir()
    fleet = Fleet(root / name, shape, n, args, callout)
    result = Result()
    try:
        await fleet.start_hub()
        gate = asyncio.Semaphore(8)

        async def island(i: int) -> None:
            async with gate:
                await fleet.start_island(i)

        await asyncio.gather(*(island(i) for i in range(n)))
        async with hub_client(fleet.ports["client"]) as js:
            await fleet.provision(js)
            fill = await fleet.await_uplink(1, "first fill")
            await js.publish("cmd.all.first", b"broadcast")
            fanout = await fleet.await_commands(1)
        print(f"{shape}: {n} islands in {fill:.1f} s, a broadcast on all in {fanout:.1f} s")
        assert fleet.hub.proc is not None
        pid = fleet.hub.proc.pid
        result.fds = proc_fds(pid)  # every stream was just written: its block file is open
        await count_objects(fleet, result)
        await asyncio.sleep(5)  # what the fill set going settles
        result.rss_mib = proc_rss_mib(pid)
        before = proc_cpu_s(pid)
        await asyncio.sleep(args.idle)
        result.idle_cpu_pct = (proc_cpu_s(pid) - before) / args.idle * 100

        fleet.hub.kill()
        for i, nc in fleet.islands.items():
            for stream in fleet.uplink:
                await nc.jetstream().publish(f"{stream.lower()}.d{i}", b"second")
        start = time.monotonic()
        await fleet.start_hub()
        try:
            await fleet.await_uplink(2, "resume")
            result.resume_s = time.monotonic() - start
            async with hub_client(fleet.ports["client"]) as js:
                await js.publish("cmd.all.second", b"broadcast")
            result.command_s = await fleet.await_commands(2)
        except BenchError as exc:  # the other shapes are still worth measuring
            print(f"{shape}: {exc}", flush=True)
        assert fleet.hub.proc is not None
        result.restart_peak_mib = proc_rss_mib(fleet.hub.proc.pid, "VmHWM")  # since the restart
        print(f"{shape}: {result}", flush=True)
    finally:
        await fleet.close()
    return result


def last_line(n: int, results: dict[str, Result]) -> str:
    figures = [f"devices={n}"]
    for shape, r in results.items():
        figures += [
            f"{shape}_rss_mib_per_device={r.rss_mib / n:.3f}",
            f"{shape}_fds_per_device={r.fds / n:.2f}",
            f"{shape}_idle_cpu_pct_per_device={r.idle_cpu_pct / n:.4f}",
            f"{shape}_streams_per_device={r.streams / n:.2f}",
            f"{shape}_resume_s={r.resume_s:.1f}",
        ]
    for shape, r in results.items():
        # A shape admitted by the callout against the same shape with users, else `current`.
        base = results.get(shape.removesuffix(CALLOUT) if shape.endswith(CALLOUT) else "current")
        if base is not None and base is not r:
            figures += [
                f"{shape}_cpu_ratio={r.idle_cpu_pct / base.idle_cpu_pct:.2f}",
                f"{shape}_rss_ratio={r.rss_mib / base.rss_mib:.2f}",
                f"{shape}_fds_ratio={r.fds / base.fds:.2f}",
                f"{shape}_resume_ratio={r.resume_s / base.resume_s:.2f}",
            ]
    return " ".join(figures)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=25)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of idle CPU measured")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--per-aggregate", type=int, default=PER_AGGREGATE, help="sources of an aggregate shard"
    )
    parser.add_argument(
        "--per-account",
        type=int,
        default=0,
        help="devices in one leaf account (default: all in one, as the product has them)",
    )
    parser.add_argument(
        "--callout",
        action="store_true",
        help="each shape again with its devices admitted by an auth callout instead of users",
    )
    parser.add_argument(
        "--pin", action="store_true", help="the hub on CPU 0, the islands on the other CPUs"
    )
    parser.add_argument("--keep", type=Path, help="an empty directory to keep the servers' logs in")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    if not set(shapes) <= set(SHAPES):
        parser.error(f"--shapes: some of {', '.join(SHAPES)}")
    results = {}
    with contextlib.ExitStack() as stack:
        root = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shapes-")))
        for shape in shapes:
            results[shape] = await measure(root, shape, args.devices, args)
            if args.callout:
                results[f"{shape}{CALLOUT}"] = await measure(
                    root, shape, args.devices, args, callout=True
                )
    print(json.dumps({s: asdict(r) for s, r in results.items()}), file=sys.stderr)
    print(last_line(args.devices, results))


if __name__ == "__main__":
    asyncio.run(main())
