"""The measurements at each size and the single-node baselines (enrolment one by one
against in bulk, report and command status against the length of the history)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import nats
import nats.errors

from bench.fleetscale.common import (
    ADDS,
    API_TIMEOUT,
    ATTEMPTS,
    CLUSTER_NODES,
    REPEATS,
    BenchError,
    T,
    track,
)
from bench.fleetscale.fleet import Fleet
from bench.fleetscale.table import line
from edge_agent.protocol.errors import MonitorUnavailable
from hub_ingest.commands.send import command_status, new_envelope, send
from hub_ingest.fleet.admission_figures import read_figures, shared_devices
from hub_ingest.fleet.enrol import Enrolment, enrol, enrol_many
from hub_ingest.fleet.registry import Registry
from hub_ingest.fleet.streams import aggregate_stream_names
from hub_ingest.fleet.trim import trim_hub
from hub_ingest.local.fleet import start_local_hub
from hub_ingest.report.collect import collect_report
from tests.support.cluster import Hub, start_hub
from tests.support.hubcluster import start_cluster_hub


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
    return await tried_twice(partial(timed, call), what, float("nan"))


async def tried_twice(measure: Callable[[], Awaitable[T]], what: str, failed: T) -> T:
    """`measure`, tried twice; `failed` (and a note) when the hub did not answer in time."""
    for _ in range(2):
        try:
            return await measure()
        except (nats.errors.Error, TimeoutError) as exc:
            print(f"note: {what} failed: {exc!r} at {where(exc)}", flush=True)
    return failed


async def start_fleet(mode: str, root: Path, args: argparse.Namespace) -> Fleet:
    compression = args.leaf_compression
    for attempt in range(ATTEMPTS):
        try:
            if mode in CLUSTER_NODES:
                hub: Hub = await start_cluster_hub(
                    root / f"try{attempt}",
                    watching=False,
                    leaf_compression=compression,
                    count=CLUSTER_NODES[mode],
                    admission=args.admission,
                )
            else:
                hub = await start_hub(
                    root / f"try{attempt}",
                    watching=False,
                    leaf_compression=compression,
                    admission=args.admission,
                )
            break
        except MonitorUnavailable:
            # A port taken between `free_port` and the bind (the machine is shared).
            if attempt == ATTEMPTS - 1:
                raise
    # A hub with hundreds of streams (and, on R3, Raft groups) on a busy machine may answer
    # an API request after the client's default 5 s: the bench measures, it does not give up.
    hub.js = hub.nc.jetstream(domain=hub.config.nats.domain, timeout=API_TIMEOUT)
    if hub.config.server.admission == "callout":
        hub.start_admission()
    fleet = Fleet(mode, root, hub, (args.reconnect, args.reconnect_spread), args.compressed)
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
            row: dict[str, float] = {"size": size}
            try:
                await guarded(fleet, measure_size(fleet, row, args), args.max_hub_rss)
                rows.append(row)
            except (BenchError, MonitorUnavailable, nats.errors.Error, TimeoutError) as exc:
                # What a hub could not do at this size is a result too: say it, with what was
                # measured before it, and keep the rest.
                peak = fleet.peak_rss()
                measured = " ".join(f"{k}={v:.3g}" for k, v in row.items() if k != "size")
                print(
                    f"{mode:7} devices={size:4d}+{args.agents} FAILED after "
                    f"{fleet.size} islands started: {exc!r} at {where(exc)}; hub peak RSS "
                    f"{peak:.0f} MiB; measured before: {measured or 'nothing'}",
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


async def measure_size(fleet: Fleet, row: dict[str, float], args: argparse.Namespace) -> None:
    """Fill `row` (whose ``size`` says how many devices) as each measurement is taken."""
    mode = fleet.mode
    row["enrol"], row["attach"] = await fleet.grow(int(row["size"]))
    row["enrol_total"], row["attach_total"] = fleet.enrol_total, fleet.attach_total
    fresh = await fleet.publish_fresh()
    row["ready"] = await fleet.await_fresh(fresh, args.timeout, "fresh message at hub")
    row["pass"] = await fleet.provision_pass()
    before = await fleet.command_mirrors()
    command = await fleet.broadcast(args.timeout)
    row["fanout"] = await fleet.await_command(before, args.timeout)
    row["rss"], row["fds"], row["cpu"] = await fleet.idle(args.idle)
    row["peak"] = fleet.peak_rss()
    # Not counted again (`--rest 0`): nan, not the sending count under the at-rest name.
    row["rest_fds"] = await fleet.fds_at_rest(args.rest) if args.rest > 0 else float("nan")
    devices = await fleet.devices()
    report = partial(collect_report, fleet.hub.nc, fleet.hub.config, devices, silent_after=60)
    # The first report reads the results of the broadcast into the command index; the
    # median of the next calls is what a report costs as an operator runs it again and again.
    nan = float("nan")
    row["report_first"], row["report"] = await tried_twice(
        partial(timed_first, report), f"{mode} report", (nan, nan)
    )
    replicas = fleet.hub.config.replicas
    status = partial(command_status, fleet.hub.js, command, devices, replicas=replicas)
    row["status"] = await timed_or_nan(status, f"{mode} command status")
    row["raft"] = await fleet.raft_groups()
    # One add alone on a loaded machine took anything from 0.4 to 1.4 s (100 devices).
    row["add"] = statistics.median([await fleet.add_one() for _ in range(ADDS)])
    row["up"], row["resume"], row["down"] = await fleet.restart(args.timeout)
    row["restart_peak"] = fleet.peak_rss()  # the servers started afresh: their peak since
    row["leafs"] = fleet.max_leafs
    # Devices the watcher took for a key on two machines (`fleet.shared_keys`): a restart's
    # redials must not look like that. Its figures are written every 10 s, within the resume.
    figures = await read_figures(fleet.hub.js)
    row["shared"] = len(shared_devices(figures, datetime.now(UTC)))
    # Last, as it empties the hub's streams: all taken for archived, as after an ingest that
    # kept up. What it costs is a look at each mirror and a purge of each stream.
    row["trim"] = await tried_twice(partial(trim_everything, fleet), f"{mode} trim", nan)


async def trim_everything(fleet: Fleet) -> float:
    """Seconds `trim_hub` takes to purge every aggregate and mirror of what they hold."""
    hub = fleet.hub
    config = dataclasses.replace(
        hub.config, ingest=dataclasses.replace(hub.config.ingest, keep_on_hub=0.0)
    )
    shards = await aggregate_stream_names(hub.js)
    archived = {name: (await hub.js.stream_info(name)).state.last_seq for name in shards}
    start = time.monotonic()
    devices = await (await Registry.open(hub.js)).list()
    trimmed = await trim_hub(hub.js, hub.nc, config, archived, devices)
    seconds = time.monotonic() - start
    streams = len(trimmed.streams)
    print(f"trim: {trimmed.messages} messages, {streams} streams, {seconds:.2f} s", flush=True)
    return seconds


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
