"""`make demo`: a hub and three devices on loopback, one flaky link, commands, and a check.

Every phase prints progress and ends in a verdict; the demo exits 1 if anything produced on a
device did not reach the hub (and the archive, exactly once) or a command did not reach its
devices. State lives under ./demo-state, removed at the start of the next run.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.protocol.logs import configure_logging
from hub_ingest.audit import read_archive
from hub_ingest.commands import BROADCAST, ResultReader, describe, event_streams, new_envelope, send
from hub_ingest.registry import Registry
from tests.support.cluster import Device, Hub, start_hub, stream_messages
from tests.support.hub_config import write_hub_config

STATE = Path("demo-state")
DEVICES = ("gateway-1", "truck-2", "kiosk-3")
FLAKY = "truck-2"
READINGS = 60  # per device
OUTAGE_S = 15.0


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)

    def check(self, ok: bool, message: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {message}", flush=True)
        if not ok:
            self.failures.append(message)


def say(text: str) -> None:
    print(text, flush=True)


async def wait_for(
    what: str, probe: Callable[[], Awaitable[tuple[bool, str]]], timeout: float
) -> bool:
    """Poll `probe` (returns done, progress text) until done or `timeout`; print progress."""
    start = time.monotonic()
    last_print = 0.0
    while True:
        done, progress = await probe()
        elapsed = time.monotonic() - start
        if done or elapsed > timeout or elapsed - last_print >= 3:
            say(f"  … {what}: {progress} ({elapsed:.0f}s)")
            last_print = elapsed
        if done:
            return True
        if elapsed > timeout:
            return False
        await asyncio.sleep(0.5)


async def at_hub(hub: Hub, device_id: str) -> int:
    info = await hub.js.stream_info("FLEET_TELEMETRY", subjects_filter=f"fleet.{device_id}.tele.>")
    return sum((info.state.subjects or {}).values())


async def produce(device: Device, count: int, interval: float) -> None:
    for i in range(count):
        await device.js.publish(f"tele.{device.id}.temperature", f'{{"n": {i}}}'.encode())
        await asyncio.sleep(interval)  # a sensor's sampling rate


async def phase_telemetry(hub: Hub, devices: dict[str, Device], verdict: Verdict) -> None:
    say(f"\n[2/5] telemetry: {READINGS} readings per device, {FLAKY} offline {OUTAGE_S:.0f}s")
    flaky = devices[FLAKY]
    producers = [
        asyncio.create_task(produce(d, READINGS, OUTAGE_S / READINGS * 1.5))
        for d in devices.values()
    ]
    flaky.proxy.cut()
    say(f"  link of {FLAKY} cut")
    await asyncio.gather(*producers)
    flaky.proxy.restore()
    say(f"  link of {FLAKY} restored; buffered readings now flow to the hub")

    async def all_arrived() -> tuple[bool, str]:
        counts = {d: await at_hub(hub, d) for d in devices}
        text = ", ".join(f"{d} {n}/{READINGS}" for d, n in counts.items())
        return all(n >= READINGS for n in counts.values()), text

    await wait_for("readings at the hub", all_arrived, timeout=120)
    say(f"  {'device':<12}{'produced':>10}{'at hub':>9}{'missing':>9}{'dupes':>7}")
    for device_id, device in devices.items():
        produced = (await device.js.stream_info("TELEMETRY")).state.messages
        rows = await stream_messages(hub.js, "FLEET_TELEMETRY")
        mine = [m for m in rows if (m.subject or "").startswith(f"fleet.{device_id}.")]
        seqs = [int((m.headers or {})["Nats-Stream-Source"].split()[1]) for m in mine]
        missing = len(set(range(1, produced + 1)) - set(seqs))
        dupes = len(seqs) - len(set(seqs))
        say(f"  {device_id:<12}{produced:>10}{len(mine):>9}{missing:>9}{dupes:>7}")
        verdict.check(
            produced == READINGS and missing == 0 and dupes == 0 and seqs == sorted(seqs),
            f"{device_id}: every reading at the hub once, in order",
        )


async def phase_commands(hub: Hub, devices: dict[str, Device], verdict: Verdict) -> None:
    say("\n[3/5] commands: a broadcast and one for truck-2, sent while its link is down")
    flaky = devices[FLAKY]
    flaky.proxy.cut()
    await flaky.wait_link(up=False)
    await send(hub.js, new_envelope(BROADCAST, "ping", {}, ttl=600))
    await send(hub.js, new_envelope(FLAKY, "config.get", {"key": "device_id"}, ttl=600))
    flaky.proxy.restore()
    expected = {
        d: ["cmd.all.ping"] + ([f"cmd.{FLAKY}.config.get"] if d == FLAKY else []) for d in devices
    }

    async def mirrored() -> tuple[bool, str]:
        got = {
            d: [m.subject for m in await stream_messages(dev.js, "COMMANDS")]
            for d, dev in devices.items()
        }
        text = ", ".join(f"{d} {len(got[d])}/{len(expected[d])}" for d in devices)
        return got == expected, text

    await wait_for("commands in device mirrors", mirrored, timeout=120)
    for device_id, device in devices.items():
        subjects = [m.subject for m in await stream_messages(device.js, "COMMANDS")]
        verdict.check(
            subjects == expected[device_id],
            f"{device_id}: command mirror holds {subjects}",
        )


async def phase_round_trip(hub: Hub, devices: dict[str, Device], verdict: Verdict) -> None:
    say("\n[4/5] command round trip: config.get sent to every device, results back at the hub")
    registered = await (await Registry.open(hub.js)).list()
    results: dict[str, dict[str, Any]] = {}
    async with ResultReader.open(hub.js, event_streams(registered), since=None) as reader:
        envelope = new_envelope(BROADCAST, "config.get", {"key": "island.domain"}, ttl=600)
        started = time.monotonic()
        await send(hub.js, envelope)
        say(f"  sent {envelope.subject} id {envelope.id}")

        async def answered() -> tuple[bool, str]:
            for sender, result in await reader.read(timeout=0.5):
                if result.get("command_id") == envelope.id and sender.trusted:
                    results.setdefault(str(sender.device_id), result)
            return len(results) == len(devices), f"{len(results)}/{len(devices)} results"

        await wait_for("results at the hub", answered, timeout=120)
    took = time.monotonic() - started
    for device_id in devices:
        result = results.get(device_id)
        if result is not None:
            say(f"  {device_id}: {result['status']} {describe(result)}")
        verdict.check(
            result is not None
            and result["status"] == "ok"
            and result["output"] == f"edge-{device_id}",
            f"{device_id}: config.get result at the hub",
        )
    say(f"  round trip for all devices: {took:.1f}s")


async def phase_ingest(hub: Hub, devices: dict[str, Device], verdict: Verdict) -> None:
    say(
        f"\n[5/5] ingest: hub-ingest run --once (Spark local[*]) into ./{STATE}/archive, then audit"
    )
    config = replace(
        hub.config,
        ingest=replace(
            hub.config.ingest,
            archive=STATE.resolve() / "archive",
            checkpoint=STATE.resolve() / "checkpoint",
        ),
    )
    toml = write_hub_config(config, STATE / "hub.toml")
    log_path = STATE / "ingest.log"
    say(f"  Spark takes ~20 s to start; its log goes to ./{log_path}")
    with log_path.open("wb") as log:
        job = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hub_ingest",
            "run",
            "--once",
            "--config",
            str(toml),
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
        )
        code = await job.wait()
    for line in log_path.read_text(errors="replace").splitlines():
        if '"batch_archived"' in line:
            batch = json.loads(line)
            say(f"  batch {batch['batch_id']}: {batch['rows']} rows, {batch['rows_per_s']} rows/s")
    verdict.check(code == 0, f"hub-ingest run --once exited {code}")
    audit = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hub_ingest",
        "audit",
        "--config",
        str(toml),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await audit.communicate()
    for line in out.decode(errors="replace").splitlines():
        say(f"  {line}")
    verdict.check(audit.returncode == 0, "audit: no duplicates, no unexplained gaps")
    rows = read_archive(config.ingest.archive, ["device_id", "subject"])
    for device_id in devices:
        archived = (
            0
            if rows is None
            else sum(
                1
                for r in rows.to_pylist()
                if r["device_id"] == device_id and r["subject"].startswith("tele.")
            )
        )
        verdict.check(archived == READINGS, f"{device_id}: {archived}/{READINGS} readings archived")


async def main() -> int:
    configure_logging("warning")
    shutil.rmtree(STATE, ignore_errors=True)
    STATE.mkdir()
    verdict = Verdict()
    started = time.monotonic()
    say(f"[1/5] starting a hub and {len(DEVICES)} devices on loopback (state in ./{STATE})")
    hub = await start_hub(STATE.resolve())
    try:
        devices = {d: await hub.device(d) for d in DEVICES}
        for device_id in devices:
            say(f"  {device_id}: island up, streams reconciled, link through its own proxy")
        await phase_telemetry(hub, devices, verdict)
        await phase_commands(hub, devices, verdict)
        await phase_round_trip(hub, devices, verdict)
        await phase_ingest(hub, devices, verdict)
    finally:
        await hub.close()
    took = time.monotonic() - started
    if verdict.failures:
        say(f"\ndemo FAILED in {took:.0f}s: {len(verdict.failures)} check(s) failed")
        return 1
    say(
        f"\ndemo passed in {took:.0f}s: nothing lost, nothing duplicated, every command "
        "delivered, the archive complete"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
