"""Power cuts: a device's disk, and the hub's, lose power again and again under load.

The device's agent state (SQLite) and island store live on a `PowerFS` disk, and so does the
hub's whole state directory (its JetStream store, users file, config). While an app publishes
numbered readings and waits for each PubAck, and the hub sends commands that the agent runs,
a seeded schedule cuts the power of one disk or the other at random moments: every process
using it is frozen, every write it had not fsynced is dropped (half the time the last page
written is torn instead), the processes are killed, and they are started again. The agent's
command handlers die with it, as they would.

The hub's ingest (``hub-ingest run``, Spark) archives all along, with its checkpoint and
archive on the hub's disk: it loses power with the hub and starts again with it.

After the last cut, once everything has caught up, the checks are the chaos suite's: the hub
has every reading the app had a PubAck for, exactly once and in order (the device packs its
telemetry, as by default, unless told otherwise); no command ran twice;
every command has its result at the hub. And a last ``hub-ingest run --once`` leaves every
such reading in the archive exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from hub_ingest.archive import table as archive_table
from hub_ingest.local.fleet import Child, write_hub_toml
from tests.chaos.runner import MARKER, Chaos, Node, Outcome
from tests.support.cluster import PACKED, UNPACKED, Hub, start_hub, write_agent_config
from tests.support.powerswitch import PowerCut

DEVICE = "p"
COMMAND_PACE = (0.3, 1.5)  # seconds between commands: a few run during most cuts
BETWEEN_CUTS = (0.5, 3.0)  # seconds of load between two cuts


class PowerCuts(Chaos):
    def __init__(
        self,
        hub: Hub,
        root: Path,
        seed: int,
        *,
        device_disk: PowerCut,
        hub_disk: PowerCut,
        device_cuts: int,
        hub_cuts: int,
        sync: str = "always",
        packed: bool = True,
    ) -> None:
        super().__init__(hub, root, seed, faults=0)
        self.rng = random.Random(seed)
        # The commands' pace has its own generator: drawn concurrently with the cuts, a shared
        # one would make the cut schedule depend on timing, and a seed would not replay it.
        self.pace = random.Random(seed + 1)
        self.device_disk, self.hub_disk = device_disk, hub_disk
        self.plan = ["device_cut"] * device_cuts + ["hub_cut"] * hub_cuts
        self.rng.shuffle(self.plan)
        self.sync = sync
        self.packing = PACKED if packed else UNPACKED
        self.ingests: list[Child] = []

    async def setup(self) -> None:
        state = self.hub_disk.mount / "ingest"
        ingest = dataclasses.replace(
            self.hub.config.ingest,
            archive=state / "archive",
            checkpoint=state / "checkpoint",
            trigger_interval=1.0,
        )
        self.ingest_config = dataclasses.replace(self.hub.config, ingest=ingest)
        self.hub_toml = write_hub_toml(self.ingest_config, self.root / "hub.toml")
        self.marker.write_text(MARKER)
        allow = json.dumps([sys.executable, str(self.marker), "*"])
        section = f'[commands]\nexec_allow = [{allow}]\nshutdown_grace = "5s"\n'
        device = await self.hub.device(
            DEVICE,
            start=False,
            register_when_ready=True,
            state_dir=str(self.device_disk.mount),
            sections={"island": {"sync": self.sync}, **self.packing},
        )
        config = write_agent_config(device, self.root / f"{DEVICE}.toml", section)
        node = Node(device, config, self.root)
        self.nodes[DEVICE] = node
        node.start_agent()
        await node.agent.wait_event("agent_ready")
        await device.connect()
        await self.hub.register(DEVICE)
        self._start_ingest()

    def _start_ingest(self, *extra: str) -> subprocess.Popen[bytes]:
        argv = ["hub_ingest", "-c", str(self.hub_toml), "run", *extra]
        ingest = Child(argv, self.root / f"ingest-{len(self.ingests)}.log").start()
        self.ingests.append(ingest)
        assert ingest.proc is not None
        return ingest.proc

    def _kill_ingest(self) -> None:
        """SIGKILL every ingest's process group: the Python driver and Spark's JVM."""
        for ingest in self.ingests:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(ingest.pid, signal.SIGKILL)
            if ingest.proc is not None:
                ingest.proc.wait()

    def close(self) -> None:
        self._kill_ingest()
        super().close()

    async def run(self) -> Outcome:
        started = time.monotonic()
        node = self.nodes[DEVICE]
        stop = asyncio.Event()
        load = [asyncio.create_task(node.produce(stop)), asyncio.create_task(self._commands(stop))]
        try:
            for fault in self.plan:
                await asyncio.sleep(self.rng.uniform(*BETWEEN_CUTS))  # the schedule's clock
                torn = self.rng.random() < 0.5
                if fault == "device_cut":
                    await self._cut_device(node, torn)
                else:
                    await self._cut_hub(torn)
                self.outcome.faults[fault] += 1
                self.outcome.faults["torn"] += torn
        finally:
            stop.set()
            await asyncio.gather(*load)
        self.outcome.produced = {DEVICE: node.produced}
        try:
            await self._settle()
        except AssertionError as exc:  # still counted: `_verify` says what the hub lacks
            self.outcome.unsettled = str(exc)
        await self._verify()
        await self._verify_archive()
        self.outcome.wall_s = time.monotonic() - started
        return self.outcome

    async def _cut_device(self, node: Node, torn: bool) -> None:
        seed = self.rng.randrange(2**32)
        await asyncio.to_thread(self.device_disk.cut, torn=torn, seed=seed)
        node.agent.close()  # a handler still running had no file on the disk: it loses power too
        node.start_agent()
        await node.agent.wait_event("agent_ready", timeout=120)

    async def _cut_hub(self, torn: bool) -> None:
        seed = self.rng.randrange(2**32)
        await asyncio.to_thread(self.hub_disk.cut, torn=torn, seed=seed)
        self.hub.server.kill()  # reaps it: the cut has killed it already
        self._kill_ingest()  # Spark's JVM may have had no file open at that moment
        await self.hub.server.start(timeout=120)
        self._start_ingest()

    async def _verify_archive(self) -> None:
        """Stop the running ingest, archive the rest once, and count the readings."""
        running = self.ingests[-1]
        running.signal(signal.SIGTERM)
        assert running.proc is not None
        await asyncio.to_thread(running.proc.wait, 120)
        once = self._start_ingest("--once")
        code = await asyncio.to_thread(once.wait, 600)
        assert code == 0, f"hub-ingest run --once exited {code}: see {self.root}"
        table = archive_table.read(self.ingest_config.ingest, ["payload"], "subject = 'tele.chaos'")
        got = [int(p) for p in table.column("payload").to_pylist()] if table else []
        want = set(range(1, self.outcome.produced[DEVICE] + 1))
        self.outcome.archived = len(got)
        self.outcome.archive_losses = len(want - set(got))
        self.outcome.archive_duplicates = len(got) - len(set(got))

    async def _commands(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._command(DEVICE)
            await asyncio.sleep(self.pace.uniform(*COMMAND_PACE))  # the schedule's clock


async def run_power_cuts(
    root: Path,
    seed: int,
    *,
    device_cuts: int,
    hub_cuts: int,
    sync: str = "always",
    packed: bool = True,
) -> Outcome:
    """One power-cut run under `root`: the disks, the hub, the device (packing its telemetry
    unless `packed` is false), the schedule."""
    device_disk = PowerCut(root / "device-disk", root / "device").start()
    hub_disk = PowerCut(root / "hub-disk", root / "hub").start()
    hub: Hub | None = None
    chaos: PowerCuts | None = None
    try:
        hub = await start_hub(root)
        # Its log from the first restart on is kept off the disk that loses power: a failing
        # run can then be read.
        hub.server.log_path = root / "hub-nats.log"
        chaos = PowerCuts(
            hub,
            root,
            seed,
            device_disk=device_disk,
            hub_disk=hub_disk,
            device_cuts=device_cuts,
            hub_cuts=hub_cuts,
            sync=sync,
            packed=packed,
        )
        await chaos.setup()
        return await chaos.run()
    finally:
        if chaos is not None:
            chaos.close()
        if hub is not None:
            await hub.close()
        device_disk.stop()
        hub_disk.stop()


__all__ = ["PowerCuts", "run_power_cuts"]
