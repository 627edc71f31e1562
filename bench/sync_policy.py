"""What each JetStream sync policy costs a device: PubAck rate, outbox drain rate, disk writes.

For each policy an island-like nats-server is started with its store on this machine's disk
(``--dir``; not tmpfs, where nothing reaches a device and fsync is free), then:

- ``publish_per_s``: an app publishing 200-byte JSON readings one by one, each awaiting its
  PubAck (what `edge-agent publish` and most apps do);
- ``drain_per_s``: the agent's outbox draining rows to the island (the real `Drainer`,
  pipelined in batches of 1024);
- ``bytes_per_msg``: bytes the nats-server process wrote to the block device per message
  (``write_bytes`` of ``/proc/<pid>/io``, over both phases): the flash wear.

The baseline is nats-server's own default (``2m``), run in the same process; ratios are the
policy's figure ÷ the baseline's.

    .venv/bin/python bench/sync_policy.py [--policies always,1s,2m] [--publish 1000] [--drain 20000]

Last line: ``always_publish_per_s=… always_drain_per_s=… always_bytes_per_msg=… …`` for each
policy, then ``always_publish_ratio=…`` and ``always_drain_ratio=…``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.js.api import StorageType, StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.core.statedb import StateDB
from edge_agent.outbox.drain import Drainer
from edge_agent.outbox.store import Outbox
from edge_agent.protocol.natsserver import ServerProcess
from edge_agent.protocol.tomlconf import render_sync, sync_policy
from hub_ingest.local.fleet import free_port

BASELINE = "2m"  # nats-server's default sync_interval


@dataclass(frozen=True)
class Cost:
    policy: str
    publish_per_s: float
    drain_per_s: float
    bytes_per_msg: float


def _reading(n: int) -> bytes:
    return json.dumps({"n": n, "t": time.time(), "temp": 21.5, "pad": "x" * 140}).encode()


def _written(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/io has no write_bytes")


async def start_store(
    home: Path, policy: str, max_file_store: str = "4GiB"
) -> tuple[ServerProcess, str]:
    """A bare JetStream nats-server on loopback storing under `home` with sync `policy`, and
    its client URL."""
    client, monitor = free_port(), free_port()
    conf = home / "nats-server.conf"
    conf.write_text(
        f"""listen: "127.0.0.1:{client}"
http: "127.0.0.1:{monitor}"
jetstream {{
  store_dir: {json.dumps(str(home / "jetstream"))}
  max_file_store: {max_file_store}
  {render_sync(sync_policy(policy))}
}}
"""
    )
    server = await ServerProcess(conf, f"http://127.0.0.1:{monitor}").start()
    return server, f"nats://127.0.0.1:{client}"


async def measure(policy: str, root: Path, publishes: int, rows: int) -> Cost:
    home = root / policy
    home.mkdir(parents=True)
    server, url = await start_store(home, policy)
    assert server.proc is not None
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(name="TELEMETRY", subjects=["tele.>"], storage=StorageType.FILE)
        )
        before = _written(server.proc.pid)
        start = time.perf_counter()
        for n in range(publishes):
            await js.publish("tele.app", _reading(n))
        publish_s = time.perf_counter() - start

        async with await StateDB.open(home / "agent.sqlite3") as db:
            outbox = Outbox(db, max_bytes=1024**3)
            await outbox.append_many(("tele.agent", _reading(n)) for n in range(rows))
            start = time.perf_counter()
            drained = await Drainer(outbox, js).drain()
            drain_s = time.perf_counter() - start
        assert drained == rows, f"drained {drained} of {rows}"
        written = _written(server.proc.pid) - before
    finally:
        await nc.close()
        await server.stop()
    return Cost(policy, publishes / publish_s, rows / drain_s, written / (publishes + rows))


async def main(policies: list[str], directory: Path, publishes: int, rows: int) -> None:
    costs: dict[str, Cost] = {}
    with tempfile.TemporaryDirectory(prefix="sync-policy-", dir=directory) as tmp:
        for policy in [*policies, BASELINE] if BASELINE not in policies else policies:
            cost = await measure(policy, Path(tmp), publishes, rows)
            costs[policy] = cost
            print(
                f"{policy:>7}: publish with PubAck {cost.publish_per_s:8.0f}/s  "
                f"outbox drain {cost.drain_per_s:8.0f}/s  "
                f"disk writes {cost.bytes_per_msg:7.0f} B/msg",
                flush=True,
            )
    base = costs[BASELINE]
    figures = []
    for c in costs.values():
        figures += [
            f"{c.policy}_publish_per_s={c.publish_per_s:.0f}",
            f"{c.policy}_drain_per_s={c.drain_per_s:.0f}",
            f"{c.policy}_bytes_per_msg={c.bytes_per_msg:.0f}",
        ]
    for c in costs.values():
        if c.policy != BASELINE:
            figures += [
                f"{c.policy}_publish_ratio={c.publish_per_s / base.publish_per_s:.2f}",
                f"{c.policy}_drain_ratio={c.drain_per_s / base.drain_per_s:.2f}",
            ]
    print(" ".join(figures))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--policies", default="always,1s", help="comma-separated")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="on the disk to test")
    parser.add_argument("--publish", type=int, default=1000)
    parser.add_argument("--drain", type=int, default=20000)
    args = parser.parse_args()
    asyncio.run(main(args.policies.split(","), args.dir, args.publish, args.drain))
