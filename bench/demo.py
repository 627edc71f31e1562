"""`make demo`: a hub and three devices on loopback, one flaky link, commands, and a check.

Every phase prints progress and ends in a verdict; the demo exits 1 if anything produced on a
device did not reach the hub or a command did not reach its devices. State lives under
./demo-state, removed at the start of the next run.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.logs import configure_logging
from tests.support.cluster import Device, Hub, start_hub, stream_messages

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
    say(f"\n[2/3] telemetry: {READINGS} readings per device, {FLAKY} offline {OUTAGE_S:.0f}s")
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
    say("\n[3/3] commands: a broadcast and one for truck-2, sent while its link is down")
    flaky = devices[FLAKY]
    flaky.proxy.cut()
    await flaky.wait_link(up=False)
    await hub.js.publish("cmd.all.ping", b'{"id": "demo-broadcast"}')
    await hub.js.publish(f"cmd.{FLAKY}.config.get", b'{"id": "demo-direct"}')
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


async def main() -> int:
    configure_logging("warning")
    shutil.rmtree(STATE, ignore_errors=True)
    STATE.mkdir()
    verdict = Verdict()
    started = time.monotonic()
    say(f"[1/3] starting a hub and {len(DEVICES)} devices on loopback (state in ./{STATE})")
    hub = await start_hub(STATE.resolve())
    try:
        devices = {d: await hub.device(d) for d in DEVICES}
        for device_id in devices:
            say(f"  {device_id}: island up, streams reconciled, link through its own proxy")
        await phase_telemetry(hub, devices, verdict)
        await phase_commands(hub, devices, verdict)
    finally:
        await hub.close()
    took = time.monotonic() - started
    if verdict.failures:
        say(f"\ndemo FAILED in {took:.0f}s: {len(verdict.failures)} check(s) failed")
        return 1
    say(f"\ndemo passed in {took:.0f}s: nothing lost, nothing duplicated, every command delivered")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
