"""Bare islands and a plain hub, for the benches that weigh nats-server's own shapes
(`bench/leaf_accounts.py`, `bench/device_shapes.py`): island `d<i>` is a nats-server with
JetStream domain ``d<i>``, linked to the hub as user ``d<i>``, at niceness 19 (devices have
CPUs of their own)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.natsserver import ServerProcess
from hub_ingest.local.fleet import free_port


async def start_island(
    root: Path, i: int, leaf: int, jetstream_limits: str, cpus: Iterable[int] | None = None
) -> tuple[ServerProcess, NATS]:
    """Island `i` under `root`, linking to the hub's `leaf` port, and a client of it."""
    client, monitor = free_port(), free_port()
    conf = root / f"d{i}.conf"
    store = json.dumps(str(root / f"d{i}"))
    conf.write_text(f"""server_name: d{i}
listen: "127.0.0.1:{client}"
http: "127.0.0.1:{monitor}"
jetstream {{ domain: d{i}, store_dir: {store}, {jetstream_limits} }}
leafnodes {{ remotes: [ {{ url: "nats-leaf://d{i}:d{i}@127.0.0.1:{leaf}", compression: off }} ] }}
""")
    island = await ServerProcess(conf, f"http://127.0.0.1:{monitor}").start(timeout=120)
    assert island.proc is not None
    os.setpriority(os.PRIO_PROCESS, island.proc.pid, 19)
    if cpus is not None:
        os.sched_setaffinity(island.proc.pid, cpus)
    return island, await nats.connect(f"nats://127.0.0.1:{client}")


@contextlib.asynccontextmanager
async def hub_client(client_port: int) -> AsyncIterator[JetStreamContext]:
    """The hub's JetStream as its operator ``op``, reconnecting however long it is away."""
    nc = await nats.connect(f"nats://op:op@127.0.0.1:{client_port}", max_reconnect_attempts=-1)
    try:
        yield nc.jetstream(timeout=10)
    finally:
        await nc.close()


async def stream_messages(monitor: Monitor) -> dict[str, int] | None:
    """Messages in each of the hub's ``FLEET`` streams, from one monitoring request (a
    request per stream would load the hub being measured); None while it does not answer."""
    try:
        jsz = await monitor.get("/jsz?acc=FLEET&streams=true")
    except Exception:  # a hub starting answers late or not at all
        return None
    return {
        stream["name"]: stream["state"]["messages"]
        for account in jsz.get("account_details") or []
        for stream in account.get("stream_detail") or []
    }
