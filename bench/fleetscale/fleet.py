"""The fleet the bench grows: a hub (one node or a cluster) with bare leaf islands as simulated
devices and a few real agents, and what it does to them (enrol, attach, publish, restart)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from bench.fleetscale.common import (
    ATTEMPTS,
    CONNECT_TIMEOUT,
    FRESH,
    LINK_TIMEOUT,
    RAMP,
    STARTING,
    BenchError,
    await_all,
    limited,
    proc_cpu_s,
    proc_fds,
    proc_rss_mib,
    track,
)
from edge_agent.core.config import Config, parse_config
from edge_agent.island.server import write_config
from edge_agent.island.streams import reconcile
from edge_agent.protocol.errors import MonitorUnavailable
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.names import COMMAND_MIRROR, OUTBOUND
from edge_agent.protocol.natsserver import ServerProcess
from edge_agent.protocol.tomlconf import BY_RTT
from hub_ingest.commands.send import new_envelope, send
from hub_ingest.fleet.auth import ACCOUNT
from hub_ingest.fleet.enrol import Enrolment, enrol_many
from hub_ingest.fleet.provision import provision
from hub_ingest.fleet.registry import Device as Registered
from hub_ingest.fleet.registry import Registry
from hub_ingest.fleet.streams import mirror_name
from hub_ingest.fleet.watch import device_incarnations, record
from hub_ingest.local.fleet import free_port
from tests.support.cluster import NATS_SERVER, Hub, _quiet
from tests.support.hubcluster import ClusterHub


@dataclass
class Island:
    """A simulated device: its island and a client connection to it, no agent."""

    config: Config
    server: ServerProcess
    # The hub's consumer its command mirror binds to: an agent learns it at its first link
    # (`edge_agent.commands.origin`), a bare island is told.
    command_consumer: str
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
        await reconcile(self.js, self.config, self.command_consumer)

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(nats.errors.Error):
                await self.nc.close()
        self.server.kill()  # throwaway: nothing to flush


ISLAND_NICENESS = 19


def new_island(
    root: Path,
    device_id: str,
    leaf_urls: list[str],
    seed: Path,
    retry: tuple[str, str],
    *,
    command_consumer: str,
    compression: str = BY_RTT,
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
            "compression": compression,
            # No agent packs here: the bench publishes one plain reading to each stream.
            "pack": False,
        },
    }
    config = parse_config(data)
    server = ServerProcess(config.island.config_path, config.island.monitor_url)
    return Island(config, server, command_consumer)


@dataclass
class Fleet:
    """A hub (one node or a cluster) grown to more and more simulated devices."""

    mode: str
    root: Path
    hub: Hub
    reconnect: tuple[str, str]  # the islands' hub.reconnect and hub.reconnect_spread
    compressed: float = 0.0  # the share of islands whose link is compressed (slow links)
    islands: list[Island] = field(default_factory=list)
    mirrors: dict[str, dict[str, str]] = field(default_factory=dict)  # device -> stream -> name
    enrol_total: float = 0.0
    attach_total: float = 0.0
    max_leafs: int = 0  # the most leaf connections at once during the last restart

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
        attach_s = 0.0
        consumers = {d.device_id: d.command_consumer for d in await self.devices()}
        for first in range(0, len(ids), RAMP):
            # A batch at a time, as devices come online: attaching hundreds in one round asks
            # every island across its link at once, on a machine whose cores they share.
            batch = ids[first : first + RAMP]
            starts = (partial(self.start_island, homes, d, consumers[d]) for d in batch)
            await limited(starts, STARTING)
            await self.await_links(batch)
            start = time.monotonic()
            await self.attach(set(batch))
            attach_s += time.monotonic() - start
        self.enrol_total += enrol_s
        self.attach_total += attach_s
        return enrol_s / len(ids), attach_s / len(ids)

    async def add_one(self) -> float:
        """Seconds the hub spends adding one device to the fleet as it is: its enrolment
        (users file, reload, its streams) and its attachment once its link is up."""
        device_id = f"one{self.size:04d}"
        homes = self.root / "devices"
        wanted = [Enrolment(device_id, None, line=1, seed_file=homes / device_id / "hub.nk")]
        start = time.monotonic()
        await self.enrol(wanted)
        enrolled = time.monotonic() - start
        device = await (await Registry.open(self.hub.js)).get(device_id)
        await self.start_island(homes, device_id, device.command_consumer)
        await self.await_links([device_id])
        start = time.monotonic()
        await self.attach({device_id})
        return enrolled + time.monotonic() - start

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

    async def start_island(self, homes: Path, device_id: str, command_consumer: str) -> None:
        """Start `device_id`'s island; again on other ports if another process took one of
        its ports between `free_port` and the server's bind (the machine is shared)."""
        for attempt in range(ATTEMPTS):
            seed = homes / device_id / "hub.nk"
            n = len(self.islands)
            slow = int((n + 1) * self.compressed) > int(n * self.compressed)
            compression = "s2_auto" if slow else BY_RTT
            island = new_island(
                homes,
                device_id,
                self.leaf_urls,
                seed,
                self.reconnect,
                command_consumer=command_consumer,
                compression=compression,
            )
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
                await provision(self.hub.js, self.hub.config, await registry.list(), only=ids)
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
            await record(self.hub.js, registry, self.hub.config, device, found, via_shard=True)

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

    async def fds_at_rest(self, seconds: float) -> float:
        """The hub's open file descriptors (summed over nodes) after `seconds` with nothing
        written. nats-server closes a stream's block file once it has not been written for
        30 s, which it checks at each sync (every 2 min): 150 s after the last write, only
        the connections and the files of streams still written are open."""
        await asyncio.sleep(seconds)  # the quiet the measurement is about, not a synchronisation
        return float(sum(proc_fds(p) for p in self.hub_pids()))

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
        sampler = asyncio.create_task(self._sample_leafs())
        try:
            fresh = await self.publish_fresh()
            await self.broadcast(timeout)

            async def since_kill(waited: Awaitable[float]) -> float:
                await waited
                return time.monotonic() - start

            resume, down = await asyncio.gather(
                since_kill(self.await_fresh(fresh, timeout, "fresh message at hub after restart")),
                since_kill(self.await_command(before, timeout)),
            )
        finally:
            sampler.cancel()
        return up, resume, down

    async def _sample_leafs(self) -> None:
        """The most leaf connections the hub held at once (`max_leafs`), every 0.2 s."""
        self.max_leafs = 0
        while True:
            total = 0
            for node in self.nodes:
                with contextlib.suppress(MonitorUnavailable):
                    total += int((await node.monitor.get("/varz")).get("leafnodes") or 0)
            self.max_leafs = max(self.max_leafs, total)
            await asyncio.sleep(0.2)  # a sampling period, not a synchronisation

    async def raft_groups(self) -> int:
        """Raft groups of the fleet's account (streams and consumers; the meta group is the
        system account's), counted once each across the nodes (``/raftz``)."""
        groups: set[str] = set()
        for node in self.nodes:
            with contextlib.suppress(MonitorUnavailable):
                raftz = await node.monitor.get(f"/raftz?acc={ACCOUNT}")
                groups.update(raftz.get(ACCOUNT) or {})
        return len(groups)

    async def close(self) -> None:
        await asyncio.gather(*(island.close() for island in self.islands))
        await self.hub.close()
