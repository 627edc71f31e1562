"""What the fleet-scale bench's parts share: its limits, its error, and the readings of
a process's CPU, descriptors and memory from /proc."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TypeVar

import nats
import nats.errors

from edge_agent.protocol.names import EVENTS, TELEMETRY
from edge_agent.protocol.natsserver import ServerProcess

T = TypeVar("T")

REPEATS = 5  # steady-state calls timed per measurement; the median is kept
ADDS = 3  # devices added one after the other to time adding one (the median is kept)
ATTEMPTS = 3  # starts of a server whose free port was taken meanwhile
PARALLEL = 16  # hub and island requests in flight at once
STARTING = 8  # islands starting at once (each a nats-server with JetStream)
# Islands started before their links are awaited: a fleet does not come up all at once, and
# hundreds of leaf handshakes at once on this machine's shared cores time out (see docs).
RAMP = 25
LINK_TIMEOUT = 300.0
CONNECT_TIMEOUT = 10.0  # for a client connection to an island that answered healthy
# The cluster modes and their nodes (every stream R3 in each); ``single`` is one node.
CLUSTER_NODES = {"cluster": 3, "cluster5": 5}
API_TIMEOUT = 30.0  # for the bench's JetStream requests to the hub (default 5 s)
TICKS = os.sysconf("SC_CLK_TCK")
FRESH = {TELEMETRY: "tele.bench.fresh", EVENTS: "evt.bench.fresh"}
METRICS: tuple[str, ...] = ("enrol", "attach", "pass", "ready", "fanout", "rss", "fds", "cpu")
METRICS += ("rest_fds", "report", "status", "raft", "add", "resume", "trim")
# Per device, in these units: the slope of what is measured against the fleet's size.
SLOPES = {
    "enrol": ("enrol_total", "s"),
    "attach": ("attach_total", "s"),
    "pass": ("pass", "s"),
    "rss": ("rss", "MiB"),
    "fds": ("fds", "fds"),
    "rest_fds": ("rest_fds", "fds"),
    "cpu": ("cpu", "% core"),
    "ready": ("ready", "s"),
    "fanout": ("fanout", "s"),
    "report": ("report", "s"),
    "status": ("status", "s"),
    "raft": ("raft", "groups"),
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
