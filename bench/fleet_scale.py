"""How the hub's cost grows with the fleet, on one hub node and on a three-node cluster (R3).

For each mode (``single``: one hub nats-server; ``cluster``: three, every stream R3) one hub
is grown through `--sizes` simulated devices, next to `--agents` real ones (agent + island,
in this process). A simulated device is a bare leaf island: a nats-server with the config
`edge_agent.island.server` renders, its link open, and its streams and the hub's consumers made by
`edge_agent.island.streams.reconcile`, with no agent. At each size:

- ``enrol``: the devices that bring the fleet to the size, enrolled in one `enrol_many` (one
  users-file write, one reload, one provisioning pass); seconds per device added;
- ``attach``: the hub records their incarnations and makes their mirrors (`observe` +
  `provision`, what ``hub-ingest watch`` does when a link comes up); seconds per device added;
- ``ready``: one fresh message published on every island's TELEMETRY and EVENTS until every
  hub mirror holds it (from the end of ``attach``);
- ``fanout``: a broadcast command sent at the hub until every island's COMMANDS mirror has it;
- ``rss``, ``cpu``: the hub's nats-server(s), summed over nodes: VmRSS, and CPU over an idle
  window of `--idle` seconds as percent of one core (utime + stime from /proc/<pid>/stat);
- ``report``, ``status``: ``report --json`` (`collect_report`) and ``command status`` of the
  broadcast (`command_status`), the median of `REPEATS` calls after a first one;
- ``restart``: the hub SIGKILLed and started again (``cluster``: all three nodes killed, then
  all started, as after a power cut of the hub's rack), then a fresh message on every island
  and a broadcast command: ``up`` is until the hub's servers answer healthy, ``resume`` until
  every hub mirror has its device's fresh message, ``down`` until every island has the command.

Two single-node baselines are kept from before: `--compare` devices enrolled one at a time
against as many in bulk, and ``report`` / ``command status`` with `--small` then `--large`
commands in the history (ratio large over small; 1.0: the cost does not grow with history).

    .venv/bin/python bench/fleet_scale.py [--sizes 25,50,100,200] [--modes single,cluster]
    .venv/bin/python bench/fleet_scale.py --sizes 5 --compare 5 --large 200    # quick

Prints one line per (mode, size), the cluster-over-single ratio of each metric at each size,
the fitted cost per device (least-squares slope over the sizes) per mode, and last:
``devices=N enrol_s_per_device=… hub_rss_mb_per_device=… restart_resume_s=… report_s=…``
for the cluster at the largest size asked for (the single node when only it ran): the
per-device keys are fitted slopes over the sizes that completed, the others measured at that
size; more keys follow (``measured_up_to``: the largest size that completed). A size the hub
cannot do (a wait past `--timeout`, the hub's RSS past `--max-hub-rss`, a request it does not
answer) prints a ``FAILED`` line and ends that mode; its values in the last line are nan.
See docs/scaling.md for a run and what it says.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import nats
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from edge_agent.core.config import Config, parse_config
from edge_agent.island.server import write_config
from edge_agent.island.streams import reconcile
from edge_agent.protocol.errors import MonitorUnavailable
from edge_agent.protocol.logs import configure_logging
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.names import COMMAND_MIRROR, EVENTS, OUTBOUND, TELEMETRY
from edge_agent.protocol.natsserver import ServerProcess
from hub_ingest.commands.send import command_status, new_envelope, send
from hub_ingest.fleet.enrol import Enrolment, enrol, enrol_many
from hub_ingest.fleet.provision import mirror_name, provision
from hub_ingest.fleet.registry import Device as Registered
from hub_ingest.fleet.registry import Registry
from hub_ingest.fleet.watch import device_incarnations, record
from hub_ingest.local.fleet import free_port, start_local_hub
from hub_ingest.report.collect import collect_report
from tests.support.cluster import NATS_SERVER, Hub, start_hub
from tests.support.hubcluster import ClusterHub, start_cluster_hub

T = TypeVar("T")

REPEATS = 5  # steady-state calls timed per measurement; the median is kept
ATTEMPTS = 3  # starts of a server whose free port was taken meanwhile
PARALLEL = 16  # hub and island requests in flight at once
STARTING = 8  # islands starting at once (each a nats-server with JetStream)
# Islands started before their links are awaited: a fleet does not come up all at once, and
# hundreds of leaf handshakes at once on this machine's shared cores time out (see docs).
RAMP = 25
LINK_TIMEOUT = 300.0
CONNECT_TIMEOUT = 10.0  # for a client connection to an island that answered healthy
API_TIMEOUT = 30.0  # for the bench's JetStream requests to the hub (default 5 s)
TICKS = os.sysconf("SC_CLK_TCK")
FRESH = {TELEMETRY: "tele.bench.fresh", EVENTS: "evt.bench.fresh"}
METRICS: tuple[str, ...] = ("enrol", "attach", "pass", "ready", "fanout", "rss", "fds", "cpu")
METRICS += ("report", "status", "resume")
# Per device, in these units: the slope of what is measured against the fleet's size.
SLOPES = {
    "enrol": ("enrol_total", "s"),
    "attach": ("attach_total", "s"),
    "pass": ("pass", "s"),
    "rss": ("rss", "MiB"),
    "fds": ("fds", "fds"),
    "cpu": ("cpu", "% core"),
    "ready": ("ready", "s"),
    "fanout": ("fanout", "s"),
    "report": ("report", "s"),
    "status": ("status", "s"),
    "resume": ("resume", "s"),
    "down": ("down", "s"),
}

# Every process this bench started, killed (with its process group) whatever way it ends.
SPAWNED: list[subprocess.Popen[bytes]] = []


class BenchError(Exception):
    """A condition the bench waits for was not reached in time."""


def track(*servers: ServerProcess) -> None:
    for server in servers:
        if server.proc is not None:
            SPAWNED.append(server.proc)


def kill_spawned(root: Path) -> int:
    """SIGKILL every process group the bench started that is still there, and the real
    agents' islands (children of this process, found by their pid files); how many."""
    killed = 0
    for pid_file in root.glob("**/nats-server.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().strip())
            if b"nats-server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
                killed += 1
    for proc in SPAWNED:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed += 1
    SPAWNED.clear()
    return killed


async def limited(calls: Iterable[Callable[[], Awaitable[T]]], limit: int = PARALLEL) -> list[T]:
    """Await every call, at most `limit` at a time; results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await call()

    return list(await asyncio.gather(*(one(c) for c in calls)))


async def await_all(
    probe: Callable[[str], Awaitable[bool]], keys: Iterable[str], timeout: float, what: str
) -> float:
    """Probe every key until each has answered True once; seconds it took. Probes that
    raise a NATS error or time out count as "not yet" (servers restarting, leaders moving)."""
    start = time.monotonic()
    pending = set(keys)
    total = len(pending)

    async def check(key: str) -> bool:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            return await probe(key)
        return False

    while pending:
        order = sorted(pending)
        for key, ok in zip(order, await limited(partial(check, k) for k in order), strict=True):
            if ok:
                pending.discard(key)
        if not pending:
            break
        if time.monotonic() - start > timeout:
            raise BenchError(
                f"{what}: {len(pending)} of {total} not there after {timeout:.0f}s, "
                f"e.g. {sorted(pending)[:3]}"
            )
        await asyncio.sleep(0.2)
    return time.monotonic() - start


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14 and 15


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_rss_mib(pid: int, field: str = "VmRSS") -> float:
    """Resident memory of `pid` in MiB (``VmHWM``: its peak since it started)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise BenchError(f"no {field} for pid {pid}")


@dataclass
class Island:
    """A simulated device: its island and a client connection to it, no agent."""

    config: Config
    server: ServerProcess
    nc: Client | None = None

    @property
    def device_id(self) -> str:
        return self.config.device_id

    @property
    def js(self) -> JetStreamContext:
        assert self.nc is not None
        return self.nc.jetstream()

    @property
    def monitor(self) -> Monitor:
        return self.server.monitor

    async def start(self) -> None:
        await asyncio.to_thread(write_config, self.config)
        await self.server.start(timeout=60)
        track(self.server)
        # A server that lost one of its ports to another process between `free_port` and its
        # bind may answer /healthz before it exits: connect with a deadline, then check it.
        try:
            self.nc = await asyncio.wait_for(
                nats.connect(
                    self.config.island.client_url, max_reconnect_attempts=-1, error_cb=_quiet
                ),
                CONNECT_TIMEOUT,
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise MonitorUnavailable(f"island {self.device_id}: {exc!r}") from exc
        proc = self.server.proc
        if proc is None or proc.poll() is not None:
            raise MonitorUnavailable(f"island {self.device_id} exited after it started")
        # Real devices do not share the hub's cores: here they yield them to it, so what is
        # measured is the hub's cost rather than two cores shared by 200 servers.
        os.setpriority(os.PRIO_PROCESS, proc.pid, ISLAND_NICENESS)
        await reconcile(self.js, self.config)

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(nats.errors.Error):
                await self.nc.close()
        self.server.kill()  # throwaway: nothing to flush


async def _quiet(exc: Exception) -> None:
    """Island clients reconnect on their own; their errors are noise here."""


ISLAND_NICENESS = 19


def new_island(
    root: Path, device_id: str, leaf_urls: list[str], seed: Path, retry: tuple[str, str]
) -> Island:
    reconnect, spread = retry
    home = root / device_id
    data: dict[str, Any] = {
        "device_id": device_id,
        "agent": {"state_dir": str(home)},
        "island": {
            "supervise": "external",
            "max_file_store": "64MiB",
            "max_memory_store": "8MiB",
            "client_listen": f"127.0.0.1:{free_port()}",
            "monitor_listen": f"127.0.0.1:{free_port()}",
            "nats_server": NATS_SERVER,
        },
        "hub": {
            "urls": leaf_urls,
            "credentials": str(seed),
            "reconnect": reconnect,
            "reconnect_spread": spread,
        },
    }
    config = parse_config(data)
    return Island(config, ServerProcess(config.island.config_path, config.island.monitor_url))


@dataclass
class Fleet:
    """A hub (one node or three) grown to more and more simulated devices."""

    mode: str
    root: Path
    hub: Hub
    reconnect: tuple[str, str]  # the islands' hub.reconnect and hub.reconnect_spread
    islands: list[Island] = field(default_factory=list)
    mirrors: dict[str, dict[str, str]] = field(default_factory=dict)  # device -> stream -> name
    enrol_total: float = 0.0
    attach_total: float = 0.0

    @property
    def nodes(self) -> list[ServerProcess]:
        if isinstance(self.hub, ClusterHub):
            return list(self.hub.nodes.values())
        return [self.hub.server]

    def hub_pids(self) -> list[int]:
        pids = [node.proc.pid for node in self.nodes if node.proc is not None]
        if len(pids) != len(self.nodes):
            raise BenchError(f"{self.mode}: a hub server is not running")
        return pids

    @property
    def leaf_urls(self) -> list[str]:
        return [f"nats-leaf://{server.leaf_listen}" for server in self.hub.config.servers]

    def endpoints(self) -> dict[str, JetStreamContext]:
        """Every device's island, by device id: the simulated ones and the real agents'."""
        found = {island.device_id: island.js for island in self.islands}
        found.update({device.id: device.js for device in self.hub.devices})
        return found

    @property
    def size(self) -> int:
        return len(self.islands)

    async def devices(self) -> list[Registered]:
        return await (await Registry.open(self.hub.js)).list()

    async def grow(self, size: int) -> tuple[float, float]:
        """Enrol and start simulated devices up to `size`, and attach them at the hub; the
        seconds per device added of enrolment and of attachment."""
        ids = [f"sim{i:04d}" for i in range(self.size, size)]
        homes = self.root / "devices"
        wanted = [
            Enrolment(d, None, line=n + 1, seed_file=homes / d / "hub.nk")
            for n, d in enumerate(ids)
        ]
        start = time.monotonic()
        registered = await self.enrol(wanted)
        enrol_s = time.monotonic() - start
        if registered != len(ids):
            raise BenchError(f"enrolled {registered} of {len(ids)}")
        for first in range(0, len(ids), RAMP):
            batch = ids[first : first + RAMP]
            await limited((partial(self.start_island, homes, d) for d in batch), STARTING)
            await self.await_links(batch)
        start = time.monotonic()
        await self.attach(set(ids))
        attach_s = time.monotonic() - start
        self.enrol_total += enrol_s
        self.attach_total += attach_s
        return enrol_s / len(ids), attach_s / len(ids)

    async def await_links(self, ids: Sequence[str]) -> float:
        """Until each of `ids`' islands has its leaf link to the hub up."""
        monitors = {i.device_id: i.monitor for i in self.islands if i.device_id in ids}

        async def probe(device_id: str) -> bool:
            return await monitors[device_id].leaf_connected()

        return await await_all(probe, monitors, LINK_TIMEOUT, "island links up")

    async def enrol(self, wanted: list[Enrolment]) -> int:
        """`enrol_many`, run again after a timeout as an operator would (a batch cut short
        is finished by running it again); how many of `wanted` are registered."""
        for _ in range(ATTEMPTS - 1):
            try:
                done = await enrol_many(self.hub.js, self.hub.config, wanted)
                return len(done.enrolled) + len(done.present)
            except (nats.errors.Error, TimeoutError) as exc:
                print(f"note: {self.mode}: enrolment run again after {exc!r}", flush=True)
        done = await enrol_many(self.hub.js, self.hub.config, wanted)
        return len(done.enrolled) + len(done.present)

    async def start_island(self, homes: Path, device_id: str) -> None:
        """Start `device_id`'s island; again on other ports if another process took one of
        its ports between `free_port` and the server's bind (the machine is shared)."""
        for attempt in range(ATTEMPTS):
            seed = homes / device_id / "hub.nk"
            island = new_island(homes, device_id, self.leaf_urls, seed, self.reconnect)
            try:
                await island.start()
            except MonitorUnavailable:
                await island.close()
                if attempt == ATTEMPTS - 1:
                    raise
                continue
            self.islands.append(island)
            return

    async def attach(self, ids: set[str]) -> None:
        """Record the first incarnation of each of `ids` (as `observe` does, asking each
        island through its link) and provision once, until every one has both mirrors."""
        deadline = time.monotonic() + 600
        while True:
            try:
                registry = await Registry.open(self.hub.js)
                await self._record_first(registry, ids)
                await provision(self.hub.js, self.hub.config, await registry.list())
                devices = await registry.list()
            except (nats.errors.Error, TimeoutError) as exc:
                # A hub this busy answers late: try again (what the watcher would do).
                print(f"note: {self.mode}: attachment retried after {exc!r}", flush=True)
                devices = []
            for device in devices:
                names = {s: device.current(s) for s in OUTBOUND}
                found = {s: mirror_name(device.device_id, i) for s, i in names.items() if i}
                if len(found) == len(OUTBOUND):
                    self.mirrors[device.device_id] = found
            if ids <= self.mirrors.keys():
                return
            if time.monotonic() > deadline:
                missing = sorted(ids - self.mirrors.keys())
                raise BenchError(f"no incarnation seen of {len(missing)} devices: {missing[:3]}")
            await asyncio.sleep(0.5)  # links still coming up

    async def _record_first(self, registry: Registry, ids: set[str]) -> None:
        devices = [d for d in await registry.list() if d.device_id in ids]
        seen = await limited(partial(device_incarnations, self.hub.nc, d) for d in devices)
        for device, found in zip(devices, seen, strict=True):
            await record(self.hub.js, registry, device, found)

    async def provision_pass(self) -> float:
        """Seconds of one `provision` of the whole fleet with nothing to change: what each
        ``device add`` and each incarnation `observe` records costs on top of its own work."""
        devices = await self.devices()
        start = time.monotonic()
        await provision(self.hub.js, self.hub.config, devices)
        return time.monotonic() - start

    async def publish_fresh(self) -> dict[str, int]:
        """One new message on each outbound stream of every island; hub mirror -> its seq."""

        async def one(device_id: str, js: JetStreamContext) -> dict[str, int]:
            seqs = {}
            for stream, subject in FRESH.items():
                ack = await js.publish(subject, device_id.encode(), stream=stream, timeout=10)
                seqs[self.mirrors[device_id][stream]] = ack.seq
            return seqs

        found: dict[str, int] = {}
        for seqs in await limited(partial(one, d, js) for d, js in self.endpoints().items()):
            found.update(seqs)
        return found

    async def await_fresh(self, wanted: dict[str, int], timeout: float, what: str) -> float:
        async def probe(name: str) -> bool:
            info = await self.hub.js.stream_info(name)
            return info.state.last_seq >= wanted[name]

        return await await_all(probe, wanted, timeout, what)

    async def command_mirrors(self) -> dict[str, int]:
        """The last sequence of every island's COMMANDS mirror, by device."""
        points = self.endpoints()

        async def last(js: JetStreamContext) -> int:
            return (await js.stream_info(COMMAND_MIRROR)).state.last_seq

        seqs = await limited(partial(last, js) for js in points.values())
        return dict(zip(points, seqs, strict=True))

    async def broadcast(self, timeout: float) -> str:
        """Send a ``ping`` to every device (retried while the hub has no leader); its id."""
        envelope = new_envelope("all", "ping", {}, 3600)
        deadline = time.monotonic() + timeout
        while True:
            try:
                await send(self.hub.js, envelope)
                return envelope.id
            except (nats.errors.Error, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def await_command(self, before: dict[str, int], timeout: float) -> float:
        points = self.endpoints()

        async def probe(device_id: str) -> bool:
            info = await points[device_id].stream_info(COMMAND_MIRROR)
            return info.state.last_seq > before[device_id]

        return await await_all(probe, before, timeout, "broadcast command on every island")

    def live_rss(self) -> float:
        """The hub's RSS now (MiB, summed over the nodes that are running)."""
        total = 0.0
        for node in self.nodes:
            if node.proc is not None:
                with contextlib.suppress(OSError, BenchError):
                    total += proc_rss_mib(node.proc.pid)
        return total

    def peak_rss(self) -> float:
        """The hub's peak RSS (MiB, summed over the running nodes) since its last start."""
        total = 0.0
        for node in self.nodes:
            if node.proc is not None:
                with contextlib.suppress(OSError, BenchError):
                    total += proc_rss_mib(node.proc.pid, "VmHWM")
        return total

    async def idle(self, seconds: float) -> tuple[float, float, float]:
        """Hub RSS (MiB), open file descriptors, both summed over nodes, and CPU over
        `seconds` (% of one core)."""
        pids = self.hub_pids()
        before = sum(proc_cpu_s(p) for p in pids)
        start = time.monotonic()
        await asyncio.sleep(seconds)  # the measurement window itself, not a synchronisation
        used = sum(proc_cpu_s(p) for p in pids) - before
        cpu = 100 * used / (time.monotonic() - start)
        return sum(proc_rss_mib(p) for p in pids), sum(proc_fds(p) for p in pids), cpu

    async def restart(self, timeout: float) -> tuple[float, float, float]:
        """Kill the hub and start it again: seconds until its servers are healthy, until
        every mirror has a message published after the kill, until every island has a
        command sent after it."""
        before = await self.command_mirrors()
        start = time.monotonic()
        # As `Hub.restart` / `ClusterHub.restart` do, with a start deadline of `timeout`:
        # a node of a large R3 hub rebuilds every stream's state after a SIGKILL first.
        for node in self.nodes:
            node.kill()
        await asyncio.gather(*(node.start(timeout=timeout) for node in self.nodes))
        track(*self.nodes)
        up = time.monotonic() - start
        fresh = await self.publish_fresh()
        await self.broadcast(timeout)

        async def since_kill(waited: Awaitable[float]) -> float:
            await waited
            return time.monotonic() - start

        resume, down = await asyncio.gather(
            since_kill(self.await_fresh(fresh, timeout, "fresh message at hub after restart")),
            since_kill(self.await_command(before, timeout)),
        )
        return up, resume, down

    async def close(self) -> None:
        await asyncio.gather(*(island.close() for island in self.islands))
        await self.hub.close()


async def timed(call: Callable[[], Awaitable[object]], repeats: int = REPEATS) -> float:
    """Median seconds of `repeats` calls, after one call that is not counted."""
    await call()
    samples = []
    for _ in range(repeats):
        start = time.monotonic()
        await call()
        samples.append(time.monotonic() - start)
    return statistics.median(samples)


def where(exc: BaseException) -> str:
    """The innermost frame of the project's code an exception passed through."""
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if "/site-packages/" not in f.filename
    ]
    if not frames:
        return "?"
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}"


async def timed_or_nan(call: Callable[[], Awaitable[object]], what: str) -> float:
    """`timed`, tried twice; NaN (and a note) when the hub did not answer in time."""
    for _ in range(2):
        try:
            return await timed(call)
        except (nats.errors.Error, TimeoutError) as exc:
            print(f"note: {what} failed: {exc!r} at {where(exc)}", flush=True)
    return float("nan")


async def start_fleet(mode: str, root: Path, args: argparse.Namespace) -> Fleet:
    compression = args.leaf_compression
    for attempt in range(ATTEMPTS):
        try:
            if mode == "cluster":
                hub: Hub = await start_cluster_hub(
                    root / f"try{attempt}", watching=False, leaf_compression=compression
                )
            else:
                hub = await start_hub(
                    root / f"try{attempt}", watching=False, leaf_compression=compression
                )
            break
        except MonitorUnavailable:
            # A port taken between `free_port` and the bind (the machine is shared).
            if attempt == ATTEMPTS - 1:
                raise
    # A hub with hundreds of streams (and, on R3, Raft groups) on a busy machine may answer
    # an API request after the client's default 5 s: the bench measures, it does not give up.
    hub.js = hub.nc.jetstream(domain=hub.config.nats.domain, timeout=API_TIMEOUT)
    fleet = Fleet(mode, root, hub, (args.reconnect, args.reconnect_spread))
    track(*fleet.nodes)
    try:
        for i in range(args.agents):
            await hub.device(f"agent{i}", register_when_ready=True)
        await fleet.attach({d.id for d in hub.devices})
    except BaseException:
        await fleet.close()
        raise
    return fleet


async def measure_mode(
    mode: str, root: Path, sizes: Sequence[int], args: argparse.Namespace
) -> list[dict[str, float]]:
    fleet = await start_fleet(mode, root, args)
    rows: list[dict[str, float]] = []
    try:
        for size in sizes:
            try:
                rows.append(await guarded(fleet, measure_size(fleet, size, args), args.max_hub_rss))
            except (BenchError, MonitorUnavailable, nats.errors.Error, TimeoutError) as exc:
                # What a hub could not do at this size is a result too: say it, keep the rest.
                peak = fleet.peak_rss()
                print(
                    f"{mode:7} devices={size:4d}+{args.agents} FAILED after "
                    f"{fleet.size} islands started: {exc!r} at {where(exc)}; hub peak RSS "
                    f"{peak:.0f} MiB",
                    flush=True,
                )
                break
            print(line(mode, rows[-1], args.agents), flush=True)
    finally:
        await fleet.close()
    return rows


async def guarded(fleet: Fleet, step: Awaitable[T], cap_mib: float) -> T:
    """Await `step`, cancelled (`BenchError`) if the hub's RSS passes `cap_mib`: a hub in a
    reconnect storm grows by gigabytes a minute, and the machine is shared."""
    task = asyncio.ensure_future(step)
    while True:
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if done:
            return task.result()
        rss = fleet.live_rss()
        if rss > cap_mib:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise BenchError(f"hub RSS {rss:.0f} MiB passed --max-hub-rss {cap_mib:.0f} MiB")


async def measure_size(fleet: Fleet, size: int, args: argparse.Namespace) -> dict[str, float]:
    mode = fleet.mode
    row: dict[str, float] = {"size": size}
    row["enrol"], row["attach"] = await fleet.grow(size)
    row["enrol_total"], row["attach_total"] = fleet.enrol_total, fleet.attach_total
    fresh = await fleet.publish_fresh()
    row["ready"] = await fleet.await_fresh(fresh, args.timeout, "fresh message at hub")
    row["pass"] = await fleet.provision_pass()
    before = await fleet.command_mirrors()
    command = await fleet.broadcast(args.timeout)
    row["fanout"] = await fleet.await_command(before, args.timeout)
    row["rss"], row["fds"], row["cpu"] = await fleet.idle(args.idle)
    row["peak"] = fleet.peak_rss()
    devices = await fleet.devices()
    report = partial(collect_report, fleet.hub.nc, fleet.hub.config, devices, silent_after=60)
    row["report"] = await timed_or_nan(report, f"{mode} report")
    replicas = fleet.hub.config.replicas
    status = partial(command_status, fleet.hub.js, command, devices, replicas=replicas)
    row["status"] = await timed_or_nan(status, f"{mode} command status")
    row["up"], row["resume"], row["down"] = await fleet.restart(args.timeout)
    return row


def line(mode: str, row: dict[str, float], agents: int) -> str:
    return (
        f"{mode:7} devices={int(row['size']):4d}+{agents} "
        f"enrol={row['enrol'] * 1000:.0f}ms/dev attach={row['attach'] * 1000:.0f}ms/dev "
        f"provision_pass={row['pass']:.2f}s "
        f"ready={row['ready']:.1f}s fanout={row['fanout']:.1f}s "
        f"hub_rss={row['rss']:.0f}MiB (peak {row['peak']:.0f}) hub_fds={row['fds']:.0f} "
        f"hub_cpu={row['cpu']:.1f}%core "
        f"report={row['report'] * 1000:.0f}ms status={row['status'] * 1000:.0f}ms "
        f"restart: up={row['up']:.1f}s resume={row['resume']:.1f}s down={row['down']:.1f}s"
    )


def slope(rows: Sequence[dict[str, float]], key: str) -> float:
    """Least-squares slope of `key` against the fleet size (through zero for one size)."""
    xs = [r["size"] for r in rows]
    ys = [r[key] for r in rows]
    if len(rows) == 1:
        return ys[0] / xs[0]
    return statistics.linear_regression(xs, ys).slope


def fitted(mode: str, rows: Sequence[dict[str, float]]) -> dict[str, float]:
    costs = {name: slope(rows, key) for name, (key, _) in SLOPES.items()}
    parts = []
    for name, (_, unit) in SLOPES.items():
        scale, shown = (1000, f"m{unit}") if unit == "s" else (1, unit)
        parts.append(f"{name}={costs[name] * scale:.3g}{shown}")
    print(f"{mode:7} per device (fitted): " + " ".join(parts), flush=True)
    return costs


# The baselines kept from before: bulk against one-by-one enrolment, and a long history.


async def enrol_costs(root: Path, n: int) -> tuple[float, float]:
    """Seconds per device: one `enrol` per device, then one `enrol_many` for as many."""
    hub = await start_local_hub(root / "enrol")
    track(hub.server)
    try:
        start = time.monotonic()
        for i in range(n):
            await enrol(hub.js, hub.config, f"single{i}")
        single = (time.monotonic() - start) / n
        wanted = [Enrolment(f"bulk{i}", None, line=i + 1) for i in range(n)]
        start = time.monotonic()
        outcome = await enrol_many(hub.js, hub.config, wanted)
        bulk = (time.monotonic() - start) / n
        assert len(outcome.enrolled) == n, outcome
    finally:
        await hub.close()
    return single, bulk


async def _answered(hub: Hub, n: int) -> bool:
    info = await hub.js.stream_info("FLEET_EVENTS", subjects_filter="fleet.a.evt.a.result")
    return sum((info.state.subjects or {}).values()) >= n


async def grow_history(hub: Hub, total: int, sent: list[str]) -> None:
    """Send commands to device ``a`` until `total` were sent; wait for every result."""
    while len(sent) < total:
        envelope = new_envelope("a", "ping", {}, 3600)
        await send(hub.js, envelope)
        sent.append(envelope.id)
    deadline = time.monotonic() + 600
    while not await _answered(hub, total):
        if time.monotonic() > deadline:
            raise BenchError(f"the device did not answer {total} commands within 600 s")
        await asyncio.sleep(0.2)


async def timed_first(call: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """Seconds of the first call (it brings the command index up to date), and the median
    of the next `REPEATS`."""
    start = time.monotonic()
    await call()
    first = time.monotonic() - start
    return first, await timed(call, REPEATS)


async def history_costs(root: Path, small: int, large: int) -> dict[str, tuple[float, float]]:
    hub = await start_hub(root / "history")
    track(hub.server)
    sent: list[str] = []
    costs: dict[str, tuple[float, float]] = {}
    try:
        await hub.device("a", register_when_ready=True, heartbeat_interval="1s")
        for label, total in (("small", small), ("large", large)):
            await grow_history(hub, total, sent)
            devices = await (await Registry.open(hub.js)).list()
            middle = sent[len(sent) // 2]
            costs[f"report_{label}"] = await timed_first(
                partial(collect_report, hub.nc, hub.config, devices, silent_after=60)
            )
            costs[f"status_{label}"] = await timed_first(
                partial(command_status, hub.js, middle, devices)
            )
    finally:
        await hub.close()
    return costs


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Send file descriptor 2 to `path`: the real agents' islands are children that log to
    it (hundreds of lines a second); the bench's own lines go to stdout."""
    saved = os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


async def run(root: Path, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    args.baseline = {}
    if args.compare:
        single, bulk = await enrol_costs(root, args.compare)
        print(
            f"baseline enrol {args.compare} devices: {single * 1000:.0f} ms per device one at "
            f"a time, {bulk * 1000:.1f} ms per device in bulk (x{single / bulk:.1f})",
            flush=True,
        )
        args.baseline["enrol_single_ms_per_device"] = single * 1000
        args.baseline["enrol_bulk_ms_per_device"] = bulk * 1000
    if args.large:
        history = await history_costs(root, args.small, args.large)
        for name, (first, steady) in history.items():
            print(f"baseline {name}: first call {first * 1000:.0f} ms, then {steady * 1000:.0f} ms")
        args.baseline["history_report_ratio"] = (
            history["report_large"][1] / history["report_small"][1]
        )
        args.baseline["history_status_ratio"] = (
            history["status_large"][1] / history["status_small"][1]
        )
    results = {}
    for mode in args.modes:
        results[mode] = await measure_mode(mode, root / mode, args.sizes, args)
    return results


def summarise(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    single = {int(r["size"]): r for r in results.get("single", [])}
    cluster = {int(r["size"]): r for r in results.get("cluster", [])}
    for size in sorted(single.keys() & cluster.keys()):
        a, b = single[size], cluster[size]
        ratios = " ".join(f"{m}={b[m] / a[m]:.2f}" for m in METRICS if a[m] > 0)
        print(f"cluster/single devices={size}: {ratios}")
    costs = {mode: fitted(mode, rows) for mode, rows in results.items() if rows}
    # The cluster at the largest size asked for; a size a hub could not do shows as nan.
    mode = "cluster" if "cluster" in args.modes else "single"
    target = max(args.sizes)
    nan = dict.fromkeys((*METRICS, "up", "down", "peak"), float("nan"))
    runs = cluster if mode == "cluster" else single
    last = runs.get(target, nan)
    cost = costs.get(mode, {name: float("nan") for name in SLOPES})
    extra = "".join(f" {k}={v:.2f}" for k, v in args.baseline.items())
    print(
        f"devices={target} enrol_s_per_device={cost['enrol']:.4f} "
        f"hub_rss_mb_per_device={cost['rss']:.3f} restart_resume_s={last['resume']:.1f} "
        f"report_s={last['report']:.3f} mode={mode} measured_up_to={max(runs, default=0)} "
        f"agents={args.agents} leaf_compression={args.leaf_compression} "
        f"reconnect={args.reconnect} reconnect_spread={args.reconnect_spread} "
        f"attach_s_per_device={cost['attach']:.4f} "
        f"provision_pass_s={last['pass']:.2f} hub_rss_mb={last['rss']:.0f} "
        f"hub_cpu_pct_per_device={cost['cpu']:.4f} status_s={last['status']:.3f} "
        f"restart_up_s={last['up']:.1f} restart_down_s={last['down']:.1f} "
        f"fanout_s={last['fanout']:.1f} hub_fds={last['fds']:.0f}{extra}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="25,50,100,200", help="simulated devices, ascending")
    parser.add_argument("--modes", default="single,cluster", help="single, cluster or both")
    parser.add_argument("--agents", type=int, default=2, help="real agents in each fleet")
    parser.add_argument(
        "--leaf-compression",
        default="s2_auto",
        help="the hub's server.leaf_compression (default: the product's, s2_auto)",
    )
    parser.add_argument(
        "--reconnect", default="250ms", help="the islands' hub.reconnect (the product's: 250ms)"
    )
    parser.add_argument(
        "--reconnect-spread",
        default="0s",
        help="the islands' hub.reconnect_spread (the product's: 0s)",
    )
    parser.add_argument("--idle", type=float, default=10.0, help="idle CPU window, seconds")
    parser.add_argument("--timeout", type=float, default=180.0, help="for each awaited state")
    parser.add_argument(
        "--max-hub-rss", type=float, default=4096.0, help="MiB: a size is abandoned above it"
    )
    parser.add_argument(
        "--compare", type=int, default=50, help="baseline: one-by-one enrols (0: skip)"
    )
    parser.add_argument("--small", type=int, default=100, help="baseline: short history")
    parser.add_argument("--large", type=int, default=2000, help="baseline: long history (0: skip)")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    if args.sizes != sorted(set(args.sizes)) or args.sizes[0] < 1:
        parser.error("--sizes: positive and ascending, like 25,50,100,200")
    if not set(args.modes) <= {"single", "cluster"}:
        parser.error("--modes: single, cluster or single,cluster")
    configure_logging("warning")
    root = Path(tempfile.mkdtemp(prefix="bench-fleet-scale-"))
    try:
        with stderr_to(root / "children.log"):
            results = asyncio.run(run(root, args))
    except BaseException:
        log = root / "children.log"
        if log.exists():
            print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
        for hub_log in sorted(root.glob("*/try*/hub/**/*.log")):
            notable = [
                ln for ln in hub_log.read_text(errors="replace").splitlines() if "[INF]" not in ln
            ]
            print(f"--- {hub_log} (not INF, last 30)", *notable[-30:], sep="\n", file=sys.stderr)
        raise
    finally:
        killed = kill_spawned(root)
        if killed:
            print(f"killed {killed} processes left running", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
    summarise(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
