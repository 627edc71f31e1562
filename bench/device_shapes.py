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
every island (`command`).

    .venv/bin/python bench/device_shapes.py --devices 100

Last line: ``devices=… <shape>_<figure>=…`` for each shape, then each figure of the other
shapes over ``current``'s in the same run (``<shape>_cpu_ratio=…``, ``…_rss_ratio``,
``…_fds_ratio``, ``…_resume_ratio``).
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
from bench.fleetscale.common import BenchError, proc_cpu_s, proc_fds, proc_rss_mib
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.natsserver import ServerProcess
from edge_agent.protocol.reconcile import mirror_consumer
from hub_ingest.fleet.server import SERVER_ENV
from hub_ingest.local.fleet import free_port

SHAPES = ("current", "direct", "filtered", "lean", "single", "mirrored")
UPLINK = ("T", "E")  # the island streams the hub collects
PER_AGGREGATE = 100  # sources of one aggregate shard: the product's default
HUB_API = "$JS.hub.API"
MONITOR_TIMEOUT = 20.0
WINDOW = 1000  # deliveries in flight on a bound consumer
ISLAND_LIMITS = "max_file_store: 64MB, max_memory_store: 8MB"
# With --pin: the hub on the first CPU, the islands on the others, so that neither waits for
# the other's turn (the islands at niceness 19 still take what the hub leaves when unpinned).
ISLAND_CPUS = set(range(1, os.cpu_count() or 2)) or {0}

# The product's split of accounts, for these names: the hub's account imports each island's
# API and the flow control of the islands' consumers; the devices' imports the hub's API and
# the deliveries to the islands' command mirrors. No import of one direction overlaps one of
# the other. With --per-account the devices are split over accounts of that many (`Dk`),
# each island's consumer named after its account (`HUBk`) so that flow control, a service,
# is imported from the one account it comes from.
FLEET_ACCOUNT = """
  FLEET: {
    jetstream: enabled
    users: [ {user: op, password: op} ]
    exports: [
      {service: "$JS.API.>", response_type: stream}
      {stream: "devin.>"}
    ]
    imports: [ IMPORTS ]
  }
"""
DEVICE_ACCOUNT = """
  NAME: {
    users: [ USERS ]
    mappings: { "$JS.hub.API.>": "$JS.API.>" }
    exports: [
      {service: "$JS.*.API.>", response_type: stream}
      {service: "$JS.FC.T.HUBK.>"}
      {service: "$JS.FC.E.HUBK.>"}
      {service: "$JS.FC.*.*.T.HUBK.>"}
      {service: "$JS.FC.*.*.E.HUBK.>"}
      {stream: "hubin.>"}
      {stream: "$JS.FC.*.ISLAND.*"}
      {stream: "$JS.FC.*.*.*.ISLAND.*"}
      {stream: "$JS.FC.COMMANDS.>"}
      {stream: "$JS.FC.*.*.COMMANDS.>"}
    ]
    imports: [
      {service: {account: FLEET, subject: "$JS.API.>"}}
      {stream: {account: FLEET, subject: "devin.>"}}
    ]
  }
"""
FROM_DEVICES = (
    '{service: {account: NAME, subject: "$JS.FC.T.HUBK.>"}}',
    '{service: {account: NAME, subject: "$JS.FC.E.HUBK.>"}}',
    '{service: {account: NAME, subject: "$JS.FC.*.*.T.HUBK.>"}}',
    '{service: {account: NAME, subject: "$JS.FC.*.*.E.HUBK.>"}}',
    '{stream: {account: NAME, subject: "hubin.>"}}',
    '{stream: {account: NAME, subject: "$JS.FC.*.ISLAND.*"}}',
    '{stream: {account: NAME, subject: "$JS.FC.*.*.*.ISLAND.*"}}',
    '{stream: {account: NAME, subject: "$JS.FC.COMMANDS.>"}}',
    '{stream: {account: NAME, subject: "$JS.FC.*.*.COMMANDS.>"}}',
)


def _accounts(n: int, per_account: int) -> str:
    imports, blocks = [], [FLEET_ACCOUNT]
    for k in range((n + per_account - 1) // per_account):
        members = range(k * per_account, min((k + 1) * per_account, n))
        users = ", ".join(json.dumps({"user": f"d{i}", "password": f"d{i}"}) for i in members)
        name = f"D{k}"
        block = DEVICE_ACCOUNT.replace("NAME", name).replace("USERS", users)
        blocks.append(block.replace("HUBK", f"HUB{k}"))
        imports += [i.replace("NAME", name).replace("HUBK", f"HUB{k}") for i in FROM_DEVICES]
        imports += [f'{{service: {{account: {name}, subject: "$JS.d{i}.API.>"}}}}' for i in members]
    return "".join(blocks).replace("IMPORTS", "\n      ".join(imports))


def _hub_config(n: int, per_account: int, ports: dict[str, int], store: Path) -> str:
    accounts = _accounts(n, per_account)
    return f"""server_name: hub
listen: "127.0.0.1:{ports["client"]}"
http: "127.0.0.1:{ports["monitor"]}"
jetstream {{ domain: hub, store_dir: {json.dumps(str(store))} }}
accounts {{ {accounts} }}
leafnodes {{
  listen: "127.0.0.1:{ports["leaf"]}"
  compression: off
  isolate_leafnode_interest: true
}}
"""


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
    def __init__(self, root: Path, shape: str, n: int, args: argparse.Namespace) -> None:
        self.root, self.shape, self.n = root, shape, n
        self.timeout, self.per_aggregate, self.pin = args.timeout, args.per_aggregate, args.pin
        self.per_account = args.per_account or n
        # Else the aggregates read the islands across the links.
        self.mirrors = shape in ("current", "filtered", "mirrored")
        self.own_commands = shape in ("current", "direct")  # a CMD<i> stream per device
        self.uplink = UPLINK[:1] if shape in ("single", "mirrored") else UPLINK
        self.ports = {"client": free_port(), "monitor": free_port(), "leaf": free_port()}
        conf = root / "hub.conf"
        conf.write_text(_hub_config(n, self.per_account, self.ports, root / "hub"))
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

    async def start_hub(self) -> None:
        await self.hub.start()
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
        for nc in self.islands.values():
            await nc.close()
        for server in [self.hub, *self.servers]:
            server.kill()


async def count_objects(fleet: Fleet, result: Result) -> None:
    jsz = await fleet.hub.monitor.get("/jsz?acc=FLEET")
    result.streams, result.consumers = int(jsz["streams"]), int(jsz["consumers"])


async def measure(root: Path, shape: str, n: int, args: argparse.Namespace) -> Result:
    (root / shape).mkdir()
    fleet = Fleet(root / shape, shape, n, args)
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
    base = results.get("current")
    for shape, r in results.items():
        if base is not None and shape != "current":
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
    print(json.dumps({s: asdict(r) for s, r in results.items()}), file=sys.stderr)
    print(last_line(args.devices, results))


if __name__ == "__main__":
    asyncio.run(main())
