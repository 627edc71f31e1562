"""Runs a chaos schedule against a real hub and three agents run as subprocesses.

Each device has a producer publishing numbered telemetry to its island (``tele.chaos``,
payload ``n``, ``Nats-Msg-Id`` ``<id>-<n>``), retrying each number until the island
acknowledges it; ``produced`` counts acknowledged numbers, so the hub must end up with exactly
``1..produced`` for each device. Device ``b`` packs its telemetry (``hub.pack``), ``a`` and
``c`` send it reading by reading: a fleet where both kinds meet the same faults. Commands
run a marker program that appends ``<device> <tag>`` to a shared file, so runs can be counted
per device.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import APIError

from edge_agent.island.server import pid_file
from edge_agent.island.streams import consumer_request, incarnations
from edge_agent.protocol.names import COMMAND_MIRROR, TELEMETRY, command_stream, hub_consumer
from edge_agent.protocol.pack import PACK_HEADER, decode
from edge_agent.status.health import collect_status
from hub_ingest.commands.send import Envelope, new_envelope, send
from hub_ingest.fleet.gaps import REFILL_HEADER
from hub_ingest.fleet.registry import Registry
from hub_ingest.report.collect import collect_report
from hub_ingest.report.hub import HubApi
from tests.chaos.schedule import Action, draw_schedule
from tests.support.agent_process import AgentProcess
from tests.support.cluster import PACKED, UNPACKED, Device, Hub, write_agent_config
from tests.support.hubcluster import NODES, ClusterHub
from tests.support.scan import scan
from tests.support.waiting import eventually

MARKER = """\
import os, sys
with open(sys.argv[1], "a") as f:
    f.write(os.environ["CHAOS_DEVICE"] + " " + sys.argv[2] + "\\n")
"""
PUBLISH_PACE = 0.05  # between telemetry publishes: ~20 readings/s per device
PACKING = ("b",)  # devices whose telemetry crosses in packs
_TRANSIENT = (nats.errors.Error, APIError, OSError, TimeoutError)


@dataclass
class Node:
    """One device: its agent incarnations and its telemetry producer."""

    device: Device
    config_path: Path
    log_dir: Path
    processes: list[AgentProcess] = field(default_factory=list)
    produced: int = 0

    @property
    def id(self) -> str:
        return self.device.id

    @property
    def agent(self) -> AgentProcess:
        return self.processes[-1]

    def start_agent(self) -> AgentProcess:
        log = self.log_dir / f"{self.id}-{len(self.processes)}.log"
        process = AgentProcess(self.config_path, log).start(env={"CHAOS_DEVICE": self.id})
        self.processes.append(process)
        return process

    def kill_island(self) -> bool:
        """SIGKILL the agent's own island (its child, checked); False if none is running."""
        assert self.agent.proc is not None
        try:
            pid = int(pid_file(self.device.config).read_text().strip())
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError):
            return False
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent != self.agent.proc.pid:
            return False  # a stale pid file: that process is not ours to kill
        os.kill(pid, signal.SIGKILL)
        return True

    async def produce(self, stop: asyncio.Event) -> None:
        """Publish 1, 2, 3… until `stop`; each number is retried until the island stores it."""
        js = self.device.js
        while not stop.is_set():
            n = self.produced + 1
            headers = {"Nats-Msg-Id": f"{self.id}-{n}"}
            while True:
                try:
                    await js.publish("tele.chaos", str(n).encode(), timeout=2.0, headers=headers)
                    break
                except _TRANSIENT:
                    await asyncio.sleep(0.2)  # back off while the island is away
            self.produced = n
            await asyncio.sleep(PUBLISH_PACE)  # pacing, not synchronisation

    def close(self) -> None:
        for process in self.processes:
            process.close()


@dataclass
class Outcome:
    seed: int
    faults: Counter[str] = field(default_factory=Counter)
    produced: dict[str, int] = field(default_factory=dict)
    at_hub: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    # Each reading at the hub more than once: its device and number, and each copy's origin
    # (the mirror's sequence, and whether it was refilled), so that a failure says which path.
    twice: list[str] = field(default_factory=list)
    losses: int = 0
    out_of_order: int = 0
    commands_sent: int = 0
    expected_runs: int = 0
    runs: int = 0
    double_runs: int = 0
    results: int = 0
    missing_results: int = 0
    extra_results: int = 0
    wall_s: float = 0.0
    unsettled: str = ""  # what never caught up (power-cut runs report it instead of raising)
    # Power-cut runs also archive: rows of acknowledged readings in the archive, and how many
    # readings are missing from it or there more than once.
    archived: int = 0
    archive_losses: int = 0
    archive_duplicates: int = 0
    reports: int = 0  # fleet reports that listed every device, taken while a hub node was down
    refilled: int = 0  # readings the hub's mirrors skipped, refilled from the islands
    packs: int = 0  # messages of packed readings in the telemetry aggregate
    mirror_rebuilds: int = 0  # island command mirrors made again: their hub origin was replaced

    def assert_exact(self) -> None:
        """The chaos suite's promise: the hub has every reading the app had a PubAck for, once
        and in order; commands were sent, none ran twice, each has exactly one result."""
        summary = self.summary()
        assert self.produced == self.at_hub and min(self.produced.values()) > 0, summary
        assert (self.duplicates, self.losses, self.out_of_order) == (0, 0, 0), summary
        assert self.commands_sent > 0 and self.double_runs == 0, summary
        assert (self.missing_results, self.extra_results) == (0, 0), summary

    def summary(self) -> str:
        return (
            f"chaos seed={self.seed} faults={sum(self.faults.values())} {dict(self.faults)} "
            f"produced={sum(self.produced.values())} at_hub={sum(self.at_hub.values())} "
            f"duplicates={self.duplicates} losses={self.losses} "
            f"out_of_order={self.out_of_order} commands sent={self.commands_sent} "
            f"expected_runs={self.expected_runs} ran={self.runs} ran_twice={self.double_runs} "
            f"results={self.results} missing_results={self.missing_results} "
            f"reports_with_a_node_down={self.reports} refilled={self.refilled} packs={self.packs} "
            f"command_mirror_rebuilds={self.mirror_rebuilds} "
            f"duplicate_results={self.extra_results} wall={self.wall_s:.0f}s "
            f"(replay: CHAOS_SEED={self.seed})" + (f" twice: {self.twice}" if self.twice else "")
        )


class Chaos:
    def __init__(
        self,
        hub: Hub,
        root: Path,
        seed: int,
        *,
        faults: int,
        schedule: list[Action] | None = None,
        skip_every: int = 0,
    ) -> None:
        self.hub = hub
        self.root = root
        self.seed = seed
        nodes = NODES if isinstance(hub, ClusterHub) else ()
        self.schedule = schedule or draw_schedule(
            seed, ["a", "b", "c"], faults=faults, nodes=nodes, skip_every=skip_every
        )
        self.nodes: dict[str, Node] = {}
        self.marker = root / "marker.py"
        self.runs_file = root / "runs.txt"
        self.sent: list[Envelope] = []
        self.outcome = Outcome(seed)

    async def setup(self) -> None:
        self.marker.write_text(MARKER)
        allow = json.dumps([sys.executable, str(self.marker), "*"])
        section = f'[commands]\nexec_allow = [{allow}]\nshutdown_grace = "5s"\n'
        for device_id in ("a", "b", "c"):
            device = await self.hub.device(
                device_id,
                start=False,
                register_when_ready=True,
                sections=PACKED if device_id in PACKING else UNPACKED,
            )
            config = write_agent_config(device, self.root / f"{device_id}.toml", section)
            node = Node(device, config, self.root)
            node.start_agent()
            self.nodes[device_id] = node
        for node in self.nodes.values():
            await node.agent.wait_event("agent_ready")
            await node.device.connect()
            # Registered once its streams exist, so the hub's sources start at once.
            await self.hub.register(node.id)

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()

    async def run(self) -> Outcome:
        started = time.monotonic()
        stop = asyncio.Event()
        producers = [asyncio.create_task(n.produce(stop)) for n in self.nodes.values()]
        pending: list[asyncio.Task[None]] = []
        try:
            for action in self.schedule:
                delay = started + action.at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # the schedule's clock, not synchronisation
                pending.append(asyncio.create_task(self._act(action)))
            await asyncio.gather(*pending)
        finally:
            stop.set()
            await asyncio.gather(*producers)
            for task in pending:
                task.cancel()
        self.outcome.produced = {n.id: n.produced for n in self.nodes.values()}
        await self._settle()
        await self._verify()
        self.outcome.wall_s = time.monotonic() - started
        return self.outcome

    async def _act(self, action: Action) -> None:
        if action.kind == "command":
            await self._command(action.target)
            return
        if action.kind == "hub_restart":
            await self.hub.restart()
            self.outcome.faults[action.kind] += 1
            return
        if action.kind in ("node_kill", "node_wipe", "rolling_restart"):
            await self._hub_node_fault(action)
            return
        node = self.nodes[action.target]
        if action.kind == "cut":
            node.device.proxy.cut()
            self.outcome.faults[action.kind] += 1
            await asyncio.sleep(action.duration)  # the length of the outage
            node.device.proxy.restore()
        elif action.kind == "skip":
            node.device.proxy.cut()
            await asyncio.sleep(action.duration)  # the length of the outage
            self.outcome.faults["skip" if await _skip_stored(node) else "cut"] += 1
            node.device.proxy.restore()
        elif action.kind == "agent_kill":
            node.agent.kill()
            self.outcome.faults[action.kind] += 1
            await asyncio.sleep(action.duration)  # the device stays dead this long
            node.start_agent()
        elif action.kind == "island_kill" and node.kill_island():
            self.outcome.faults[action.kind] += 1

    async def _hub_node_fault(self, action: Action) -> None:
        """A hub node SIGKILLed for `duration` (the fleet report is taken while it is down),
        or every node stopped and started in turn as an upgrade would, each back in the
        cluster before the next goes."""
        assert isinstance(self.hub, ClusterHub)
        hub = self.hub
        self.outcome.faults[action.kind] += 1
        if action.kind == "node_kill":
            node = action.target
            if node == "leader":  # of the telemetry aggregate, looked up now
                cluster = (await hub.js.stream_info("FLEET_TELEMETRY")).cluster
                assert cluster is not None and cluster.leader is not None
                node = cluster.leader
            await hub.kill(node)
            back_at = time.monotonic() + action.duration
            # The first requests after a kill may wait out a leader election (a few seconds).
            await eventually(self._report, timeout=30, interval=0.5, what="fleet report")
            self.outcome.reports += 1
            await asyncio.sleep(max(0.0, back_at - time.monotonic()))  # the node stays dead
            await hub.start(node)
            return
        if action.kind == "node_wipe":
            await hub.wipe(await self._holder(action.target), down_for=action.duration)
            return
        for node in NODES:
            await hub.stop(node)
            await hub.start(node)
            await eventually(hub.current, timeout=120, interval=0.5, what=f"{node} current")

    async def _holder(self, target: str) -> str:
        """The node holding one of a device's own streams (one replica each): `target` is
        ``<device>:commands`` (its ``CMD_<id>``) or ``<device>:telemetry`` (its mirror).
        Asked until the cluster answers: after an earlier fault it may be electing leaders
        (the registry's read answered 503 once)."""
        device, stream = target.split(":")

        async def leader() -> str | None:
            name = command_stream(device) if stream == "commands" else await self.hub.mirror(device)
            cluster = (await self.hub.js.stream_info(name)).cluster
            return cluster.leader if cluster is not None else None

        return await eventually(leader, timeout=30, interval=0.5, what=f"{target}'s holder")

    async def _report(self) -> bool:
        """The fleet report, as `hub-ingest report` makes it: it must list every device, each
        linked (to one of the nodes still up)."""
        registry = await Registry.open(self.hub.js)
        report = await collect_report(
            self.hub.nc, self.hub.config, await registry.list(), silent_after=3600
        )
        listed = {d.device_id for d in report.devices} == set(self.nodes)
        return listed and all(d.link_connected for d in report.devices)

    async def _command(self, target: str) -> None:
        envelope = new_envelope(target, "exec", {}, ttl=3600)
        argv = [sys.executable, str(self.marker), str(self.runs_file), envelope.id]
        envelope = dataclasses.replace(envelope, args={"argv": argv})

        async def sent() -> bool:
            await send(self.hub.js, envelope)  # retries are dropped by the hub by Nats-Msg-Id
            return True

        await eventually(sent, timeout=90, interval=0.5, what=f"command {envelope.id} sent")
        self.sent.append(envelope)

    def _expected_runs(self) -> set[tuple[str, str]]:
        return {
            (device_id, e.id)
            for e in self.sent
            for device_id in self.nodes
            if e.device_id in (device_id, "all")
        }

    async def _settle(self) -> None:
        """Await (with deadlines) the hub catching up, results arriving, outboxes emptying."""
        for node in self.nodes.values():
            await eventually(
                functools.partial(self._caught_up, node),
                timeout=180,
                interval=1.0,
                what=f"{node.id}'s {node.produced} readings at the hub ({self.outcome.summary()})",
            )
        expected = self._expected_runs()

        async def answered() -> bool:
            missing = expected - set(await self._results())
            if missing:
                raise AssertionError(await self._unanswered(missing))
            return True

        await eventually(answered, timeout=120, interval=1.0, what="every command's result")
        for node in self.nodes.values():
            await eventually(
                functools.partial(_outbox_empty, node),
                timeout=60,
                what=f"{node.id}'s outbox empty",
            )

    async def _unanswered(self, missing: set[tuple[str, str]]) -> str:
        """Shown if the deadline passes: each command without a result, whether it ran, and
        where its device's command streams stand (hub origin, island mirror)."""
        ran = set(tuple(line.split()) for line in self.runs_file.read_text().splitlines())
        lines = [f"{d} {c} ran={(d, c) in ran}" for d, c in sorted(missing)]
        for device_id in sorted({d for d, _ in missing}):
            origin = (await self.hub.js.stream_info(command_stream(device_id))).state
            mirror = (await self.nodes[device_id].device.js.stream_info(COMMAND_MIRROR)).state
            events = (await self.nodes[device_id].device.js.stream_info("EVENTS")).state
            name = await self.hub.mirror(device_id, "EVENTS")
            hub_mirror = await self.hub.js.stream_info(name)
            aggregate = await self.hub.js.stream_info(
                "FLEET_EVENTS", subjects_filter=f"fleet.{device_id}.evt.>"
            )
            sourced = [s for s in aggregate.sources or [] if s.name == name]
            in_aggregate = sum((aggregate.state.subjects or {}).values())
            lines.append(
                f"{device_id}: origin {origin.first_seq}..{origin.last_seq} "
                f"({origin.messages}), island mirror {mirror.first_seq}..{mirror.last_seq} "
                f"({mirror.messages}); island EVENTS {events.first_seq}..{events.last_seq}, "
                f"{name} {hub_mirror.state.first_seq}..{hub_mirror.state.last_seq} "
                f"({hub_mirror.state.messages}, {hub_mirror.mirror}, leader "
                f"{hub_mirror.cluster and hub_mirror.cluster.leader}), FLEET_EVENTS holds "
                f"{in_aggregate} of it, its source: {sourced}"
            )
        return "; ".join(lines)

    async def _caught_up(self, node: Node) -> bool:
        name = await self.hub.mirror(node.id)
        mirror = await self.hub.js.stream_info(name)
        in_aggregate = await _aggregated(self.hub, node)
        # What the mirror skipped reaches the aggregate through the refill, not the mirror: a
        # skip at its tail leaves the mirror short for as long as the device stays quiet.
        if in_aggregate >= node.produced:
            return True
        # Shown if the deadline passes: where the readings stopped, and the mirror's own view.
        api = HubApi(self.hub.nc, self.hub.config.nats.domain)
        info = await api.request(f"STREAM.INFO.{name}", {"deleted_details": True}) or {}
        raise AssertionError(
            f"{name} holds {mirror.state.messages} (last seq {mirror.state.last_seq}, "
            f"deleted {info.get('state', {}).get('deleted')}), the aggregate {in_aggregate}; "
            f"leader {info.get('cluster', {}).get('leader')}; mirror: {mirror.mirror}; "
            f"island: {await _island_side(node)}"
        )

    async def _results(self) -> list[tuple[str, str]]:
        msgs = await scan(self.hub.js, "FLEET_EVENTS", "fleet.*.evt.*.result")
        return [(m.subject.split(".")[1], json.loads(m.data)["command_id"]) for m in msgs]

    async def _verify(self) -> None:
        out = self.outcome
        for node in self.nodes.values():
            want = list(range(1, node.produced + 1))
            aggregate = await scan(self.hub.js, "FLEET_TELEMETRY", f"fleet.{node.id}.>")
            mirror = await scan(self.hub.js, await self.hub.mirror(node.id), ">")
            origins: list[tuple[int, bool]] = []
            got: list[int] = []
            # Each reading's message: its device (island) sequence and its aggregate sequence.
            carried_by: list[tuple[int, int]] = []
            out.packs += sum(PACK_HEADER in (msg.headers or {}) for msg in aggregate)
            for msg in aggregate:
                origin, refilled = _origin(msg)
                for seq, n in _readings(msg, origin):
                    origins.append((seq, refilled))
                    got.append(n)
                    carried_by.append((origin, msg.metadata.sequence.stream))
            out.at_hub[node.id] = len(got)
            out.duplicates += len(got) - len(set(got))
            for n, copies in Counter(got).items():
                if copies > 1:
                    # Two island messages: packed twice; one: the aggregate took it twice.
                    copies_of = zip(origins, carried_by, got, strict=True)
                    how = [(*o, *c) for o, c, m in copies_of if m == n]
                    out.twice.append(
                        f"{node.id} reading {n} as (seq, refilled, island seq, aggregate seq) {how}"
                    )
            out.losses += len(set(want) - set(got))
            # Reading n is device message n, whichever way it came; refilled readings come
            # after the rest, which keep the device's order.
            out.out_of_order += sum(1 for (seq, _), n in zip(origins, got, strict=True) if seq != n)
            sourced = [seq for seq, refilled in origins if not refilled]
            out.out_of_order += sum(1 for x, y in itertools.pairwise(sourced) if y <= x)
            refilled = {seq for seq, was in origins if was}
            out.refilled += len(refilled)
            # The mirror keeps the device's sequence; what it skipped was refilled.
            mirrored = [r for m in mirror for r in _readings(m, m.metadata.sequence.stream)]
            # A mirror made again (its node lost its disk) starts where the island's consumer
            # stood: what came before is in the aggregate, checked above.
            first = mirrored[0][0] if mirrored else 1
            out.losses += len({n for n in want if n >= first} - {n for _, n in mirrored} - refilled)
            out.out_of_order += sum(1 for seq, n in mirrored if seq != n)
        expected = self._expected_runs()
        results = Counter(await self._results())
        runs = Counter(tuple(line.split()) for line in self.runs_file.read_text().splitlines())
        out.commands_sent = len(self.sent)
        out.expected_runs = len(expected)
        out.runs = sum(runs.values())
        out.double_runs = sum(1 for count in runs.values() if count > 1)
        out.results = sum(results.values())
        out.missing_results = len(expected - set(results))
        out.extra_results = sum(count - 1 for count in results.values() if count > 1)
        out.mirror_rebuilds = sum(
            len(p.events("command_mirror_rebuilt"))
            for n in self.nodes.values()
            for p in n.processes
        )


async def _skip_stored(node: Node) -> bool:
    """Move the floor of the consumer the hub's telemetry mirror reads through past what the
    island holds: when the mirror binds again it takes that floor as what it already has, and
    skips the rest for good (the engine's own gap, here on purpose). False if the island did
    not answer (it may be restarting)."""
    try:
        incarnation = (await incarnations(node.device.js))[TELEMETRY]
        last = (await node.device.js.stream_info(TELEMETRY)).state.last_seq
        assert node.device.nc is not None and incarnation is not None
        name = hub_consumer(incarnation)
        body = json.dumps({"seq": last + 1}).encode()
        error = await consumer_request(node.device.nc, "RESET", TELEMETRY, name, body)
    except _TRANSIENT:
        return False
    return error is None


async def _island_side(node: Node) -> str:
    """The island's telemetry and the consumer the hub's mirror reads it through, as the
    island sees them (a mirror that stops short of the island shows why here)."""
    try:
        js = node.device.js
        incarnation = (await incarnations(js))[TELEMETRY]
        last = (await js.stream_info(TELEMETRY)).state.last_seq
        assert incarnation is not None
        consumer = await js.consumer_info(TELEMETRY, hub_consumer(incarnation))
    except (*_TRANSIENT, AssertionError) as exc:
        return f"not read ({exc!r})"
    return (
        f"TELEMETRY last seq {last}; {consumer.name} delivered {consumer.delivered}, "
        f"ack floor {consumer.ack_floor}, {consumer.num_ack_pending} unacknowledged, "
        f"{consumer.num_pending} undelivered, push bound {consumer.push_bound}"
    )


async def _aggregated(hub: Hub, node: Node) -> int:
    """The device's readings in the telemetry aggregate (a pack counts its readings)."""
    if node.device.config.hub.pack:
        aggregate = await scan(hub.js, "FLEET_TELEMETRY", f"fleet.{node.id}.>")
        return sum(len(_readings(msg, 0)) for msg in aggregate)
    info = await hub.js.stream_info("FLEET_TELEMETRY", subjects_filter=f"fleet.{node.id}.tele.>")
    return sum((info.state.subjects or {}).values())


def _readings(msg: Msg, seq: int) -> list[tuple[int, int]]:
    """(device sequence, number) of each reading in a message of the hub's: a pack's by their
    ``READINGS`` sequences, a lone reading's `seq` (where the message says it came from)."""
    if PACK_HEADER in (msg.headers or {}):
        return [(reading.seq, int(reading.data)) for reading in decode(msg.data)]
    return [(seq, int(msg.data))]


def _origin(msg: Msg) -> tuple[int, bool]:
    """The device's sequence of an aggregated message, and whether it was refilled:
    ``Nats-Stream-Source`` (or ``Edge-Refill-Of``) is ``<mirror> <seq> …``."""
    headers = msg.headers or {}
    refilled = REFILL_HEADER in headers
    origin = headers[REFILL_HEADER] if refilled else headers["Nats-Stream-Source"]
    return int(origin.split()[1]), refilled


async def _outbox_empty(node: Node) -> bool:
    status = await collect_status(node.device.config)
    return status.outbox is not None and status.outbox.depth == 0


__all__ = ["Chaos", "Outcome"]
