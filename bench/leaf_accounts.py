"""Which account the devices' leaf connections bind to on the hub, measured at fleet size.

`one`, as the product did until 2026-11-28: the devices' users are in the hub's JetStream
account, so every connection a leaf makes has nats-server look at every mirror and source of
that account (`checkInternalSyncConsumers`), and every subscription the hub's streams make
is checked against every linked leaf. `split`: the devices' users are in an account of their
own with no JetStream, from which the hub's account imports what its mirrors need: the
islands' JetStream API (as ``DEVJS.<domain>.API``), flow-control replies, replies to set-up,
and the deliveries on ``hubin.>``. The product took this shape then, with the command
direction too and each island's API imported under its own name (`hub_ingest/fleet/auth.py`).
Each device here is a bare island (nats-server at niceness 19)
with two streams, each with the durable flow-controlled consumer the hub's mirror binds to,
as the agent makes them; the hub mirrors both and one aggregate sources every telemetry
mirror. As in the product on loopback, the links are uncompressed and the hub runs with
`GOGC=25`. Per mode: steady memory, descriptors and idle CPU, then the hub SIGKILLed with one
new message on every island, started again, and timed until every mirror has it.

Only the telemetry direction is modelled: the commands' (hub consumers delivering to the
islands, the islands' requests to the hub) is not.

    .venv/bin/python bench/leaf_accounts.py --devices 100

Last line: ``devices=… one_resume_s=… split_resume_s=… resume_ratio=…`` (split over one)
and each mode's steady and restart figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    ExternalStream,
    StreamConfig,
    StreamConsumerSource,
    StreamSource,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from bench.fleetscale.bare import hub_client, start_island, stream_messages
from bench.fleetscale.common import proc_cpu_s, proc_fds, proc_rss_mib
from edge_agent.protocol.natsserver import ServerProcess
from edge_agent.protocol.reconcile import mirror_consumer
from hub_ingest.fleet.server import SERVER_ENV
from hub_ingest.local.fleet import free_port

ISLAND_LIMITS = "max_file_store: 256MB"
STREAMS = {"T": "M", "E": "EV"}  # island stream -> prefix of the hub's mirror of it
SPLIT_ACCOUNTS = """
  FLEET: {
    jetstream: enabled
    users: [ {user: op, password: op} ]
    imports: [
      {service: {account: DEVICES, subject: "$JS.*.API.>"}, to: "DEVJS.*.API.>"}
      {service: {account: DEVICES, subject: "$JS.FC.>"}}
      {service: {account: DEVICES, subject: "$JSC.R.>"}}
      {stream: {account: DEVICES, subject: "hubin.>"}}
    ]
  }
  DEVICES: {
    users: [ DEVICE_USERS ]
    exports: [
      {service: "$JS.*.API.>"}
      {service: "$JS.FC.>"}
      {service: "$JSC.R.>"}
      {stream: "hubin.>"}
    ]
  }
"""


def _device_users(n: int, split: bool) -> str:
    """One user per device with the product's kind of permissions: it may publish only its own
    deliveries and replies, and is sent only its own island's API requests. Over a service
    import a request's reply subject becomes ``_R_.<random>``, which `allow_responses` does not
    cover on a leaf connection: `split` needs it allowed."""
    users = []
    for i in range(n):
        publish = [f"hubin.d{i}.>", "$JS.FC.>", "$JSC.R.>", *(["_R_.>"] if split else [])]
        permissions = {
            "publish": {"allow": publish},
            "subscribe": {"allow": [f"$JS.d{i}.API.>", "$JS.FC.>", "$JSC.R.>"]},
            "allow_responses": True,
        }
        users.append(json.dumps({"user": f"d{i}", "password": f"d{i}", "permissions": permissions}))
    return ",\n      ".join(users)


def _hub_config(mode: str, n: int, ports: dict[str, int], store: Path) -> str:
    users = _device_users(n, mode == "split")
    if mode == "split":
        accounts = SPLIT_ACCOUNTS.replace("DEVICE_USERS", users)
    else:
        accounts = (
            f"FLEET: {{ jetstream: enabled, users: [ {{user: op, password: op}}, {users} ] }}"
        )
    return f"""server_name: hub
listen: "127.0.0.1:{ports["client"]}"
http: "127.0.0.1:{ports["monitor"]}"
jetstream {{ domain: hub, store_dir: {json.dumps(str(store))} }}
accounts {{ {accounts} }}
leafnodes {{ listen: "127.0.0.1:{ports["leaf"]}", compression: accept }}
"""


@dataclass
class Result:
    rss_mib: float = 0.0
    fds: int = 0
    idle_cpu_pct: float = 0.0
    resume_s: float = float("nan")
    restart_cpu_s: float = 0.0
    peak_mib: float = 0.0
    max_leafs: int = 0


class Fleet:
    def __init__(self, root: Path, mode: str, n: int, timeout: float) -> None:
        self.root, self.mode, self.n, self.timeout = root, mode, n, timeout
        self.ports = {"client": free_port(), "monitor": free_port(), "leaf": free_port()}
        conf = root / "hub.conf"
        conf.write_text(_hub_config(mode, n, self.ports, root / "hub"))
        self.hub = ServerProcess(conf, f"http://127.0.0.1:{self.ports['monitor']}", env=SERVER_ENV)
        self.islands: list[ServerProcess] = []
        self.island_ncs: list[NATS] = []

    async def start_island(self, i: int) -> None:
        island, nc = await start_island(self.root, i, self.ports["leaf"], ISLAND_LIMITS)
        self.islands.append(island)
        self.island_ncs.append(nc)
        js = nc.jetstream()
        for name in STREAMS:
            await js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))
            consumer = mirror_consumer("HUB", f"hubin.d{i}.{name}", {}, window=1000)
            await js.add_consumer(name, consumer)
            await js.publish(f"{name.lower()}.{i}", b"first")

    async def mirror(self, js: JetStreamContext) -> None:
        api = "$JS.d{}.API" if self.mode == "one" else "DEVJS.d{}.API"
        for i in range(self.n):
            for name, prefix in STREAMS.items():
                source = StreamSource(
                    name=name,
                    external=ExternalStream(api=api.format(i)),
                    consumer=StreamConsumerSource(name="HUB", deliver_subject=f"hubin.d{i}.{name}"),
                )
                await js.add_stream(StreamConfig(name=f"{prefix}{i}", mirror=source))
        sources = [StreamSource(name=f"M{i}") for i in range(self.n)]
        await js.add_stream(StreamConfig(name="AGG", sources=sources))

    async def short_of(self, count: int) -> int:
        """How many mirrors hold fewer than `count` messages, from one monitoring request (a
        request per stream would load the hub being measured)."""
        held = await stream_messages(self.hub.monitor)
        if held is None:
            return self.n * len(STREAMS)
        names = [f"{prefix}{i}" for i in range(self.n) for prefix in STREAMS.values()]
        return sum(held.get(name, 0) < count for name in names)

    async def await_all(self, count: int, what: str) -> float:
        start = time.monotonic()
        while short := await self.short_of(count):
            if time.monotonic() - start > self.timeout:
                raise RuntimeError(
                    f"{self.mode} {what}: {short} mirrors short after {self.timeout} s"
                )
            await asyncio.sleep(0.5)
        return time.monotonic() - start

    async def close(self) -> None:
        for nc in self.island_ncs:
            await nc.close()
        for server in [self.hub, *self.islands]:
            server.kill()


async def count_leafs(fleet: Fleet, result: Result) -> None:
    """The most leaf connections the hub holds at once, every 0.2 s."""
    while True:
        with contextlib.suppress(Exception):
            varz = await fleet.hub.monitor.get("/varz")
            result.max_leafs = max(result.max_leafs, int(varz.get("leafnodes") or 0))
        await asyncio.sleep(0.2)


async def measure(root: Path, mode: str, n: int, idle_s: float, timeout: float) -> Result:
    (root / mode).mkdir()
    fleet = Fleet(root / mode, mode, n, timeout)
    result = Result()
    try:
        await fleet.hub.start()
        gate = asyncio.Semaphore(8)

        async def island(i: int) -> None:
            async with gate:
                await fleet.start_island(i)

        await asyncio.gather(*(island(i) for i in range(n)))
        async with hub_client(fleet.ports["client"]) as js:
            await fleet.mirror(js)
        fill = await fleet.await_all(1, "first fill")
        print(f"{mode}: {n} islands mirrored in {fill:.1f} s", flush=True)
        assert fleet.hub.proc is not None
        pid = fleet.hub.proc.pid
        await asyncio.sleep(5)  # what the fill set going settles
        result.rss_mib, result.fds = proc_rss_mib(pid), proc_fds(pid)
        before = proc_cpu_s(pid)
        await asyncio.sleep(idle_s)
        result.idle_cpu_pct = (proc_cpu_s(pid) - before) / idle_s * 100

        fleet.hub.kill()
        for i, nc in enumerate(fleet.island_ncs):
            for name in STREAMS:
                await nc.jetstream().publish(f"{name.lower()}.{i}", b"second")
        start = time.monotonic()
        await fleet.hub.start()
        assert fleet.hub.proc is not None
        pid = fleet.hub.proc.pid
        sampler = asyncio.create_task(count_leafs(fleet, result))
        try:
            await fleet.await_all(2, "resume")
            result.resume_s = time.monotonic() - start
            result.restart_cpu_s = proc_cpu_s(pid)
            result.peak_mib = proc_rss_mib(pid, "VmHWM")  # since the restart
        finally:
            sampler.cancel()
        print(f"{mode}: {result}", flush=True)
    finally:
        await fleet.close()
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=25)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="leaf-accounts-") as tmp:
        one = await measure(Path(tmp), "one", args.devices, args.idle, args.timeout)
        split = await measure(Path(tmp), "split", args.devices, args.idle, args.timeout)
    n = args.devices
    print(
        f"devices={n} one_resume_s={one.resume_s:.1f} split_resume_s={split.resume_s:.1f} "
        f"resume_ratio={split.resume_s / one.resume_s:.2f} "
        f"one_restart_cpu_s={one.restart_cpu_s:.1f} split_restart_cpu_s={split.restart_cpu_s:.1f} "
        f"one_idle_cpu_pct_per_device={one.idle_cpu_pct / n:.4f} "
        f"split_idle_cpu_pct_per_device={split.idle_cpu_pct / n:.4f} "
        f"one_rss_mib_per_device={one.rss_mib / n:.3f} "
        f"split_rss_mib_per_device={split.rss_mib / n:.3f} "
        f"one_leafs_at_most={one.max_leafs} split_leafs_at_most={split.max_leafs}"
    )


if __name__ == "__main__":
    asyncio.run(main())
