"""The durable outbox against a real nats-server that the tests kill and restart."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from edge_agent.commands.ledger import Ledger
from edge_agent.core.errors import OutboxFull
from edge_agent.core.statedb import StateDB
from edge_agent.outbox.drain import Drainer
from edge_agent.outbox.store import Outbox
from edge_agent.protocol.envelope import Result
from edge_agent.protocol.natsserver import ServerProcess
from edge_agent.status.health import collect_status
from hub_ingest.fleet.registry import Registry
from hub_ingest.report.collect import collect_report
from tests.support.cluster import Hub, free_port, run_cli, stream_messages
from tests.support.commands import results, send_command
from tests.support.waiting import eventually


@pytest.fixture
async def island(tmp_path: Path) -> AsyncIterator[ServerProcess]:
    """A JetStream server standing in for the island, with an EVENTS stream on evt.>."""
    port, http = free_port(), free_port()
    conf = tmp_path / "island.conf"
    conf.write_text(
        f'listen: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{http}"\n'
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
    )
    server = await ServerProcess(conf, f"http://127.0.0.1:{http}").start()
    server.url = f"nats://127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        await server.stop()


async def _connect(url: str) -> Client:
    async def quiet(exc: Exception) -> None:
        pass

    return await nats.connect(
        url, max_reconnect_attempts=-1, reconnect_time_wait=0.1, error_cb=quiet
    )


async def _events_stream(island: ServerProcess, **limits: Any) -> tuple[Client, JetStreamContext]:
    """A client of the island and its EVENTS stream on evt.>, with `limits`."""
    nc = await _connect(island.url)  # type: ignore[attr-defined]
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="EVENTS", subjects=["evt.>"], **limits))
    return nc, js


async def test_rows_held_while_island_is_killed_arrive_once_in_order(
    island: ServerProcess, tmp_path: Path
) -> None:
    """SIGKILL the island mid-drain and add rows while it is down: each arrives exactly once."""
    nc, js = await _events_stream(island, duplicate_window=120)
    async with await StateDB.open(tmp_path / "agent.sqlite3") as db:
        outbox = Outbox(db, max_bytes=64 * 1024**2)
        drainer = Drainer(outbox, js, ack_timeout=1.0)
        task = asyncio.create_task(drainer.run())
        try:
            await outbox.append_many((f"evt.d.n{i}", str(i).encode()) for i in range(2000))
            await eventually(lambda: _depth_below(outbox, 2000), timeout=30, what="drain under way")
            island.kill()
            await outbox.append_many((f"evt.d.n{i}", str(i).encode()) for i in range(2000, 2300))
            assert (await outbox.stats()).depth >= 300
            await island.start()
            await eventually(lambda: _depth_below(outbox, 1), timeout=60, what="outbox empty")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    msgs = await stream_messages(js, "EVENTS")
    assert [m.data for m in msgs] == [str(i).encode() for i in range(2300)]
    await nc.close()


async def test_rows_wait_while_the_island_refuses_them(
    island: ServerProcess, tmp_path: Path
) -> None:
    """A stream that refuses writes (full, discard new) leaves rows in SQLite until it accepts."""
    nc, js = await _events_stream(island, max_msgs=1, discard="new")
    await js.publish("evt.d.first", b"first")
    async with await StateDB.open(tmp_path / "agent.sqlite3") as db:
        outbox = Outbox(db, max_bytes=1024**2)
        drainer = Drainer(outbox, js, ack_timeout=1.0)
        await outbox.append_many([("evt.d.a", b"a"), ("evt.d.b", b"b")])
        assert not await drainer.flush(timeout=0.5)
        assert (await outbox.stats()).depth == 2
        await js.update_stream(StreamConfig(name="EVENTS", subjects=["evt.>"], discard="new"))
        assert await drainer.flush(timeout=10)
    assert [m.data for m in await stream_messages(js, "EVENTS")] == [b"first", b"a", b"b"]
    await nc.close()


async def test_full_outbox_refuses_with_the_budget_in_the_message(tmp_path: Path) -> None:
    """Past its budget the outbox raises, and ``edge-agent publish`` exits 1 saying so."""
    async with await StateDB.open(tmp_path / "state" / "agent.sqlite3") as db:
        outbox = Outbox(db, max_bytes=1000)
        await outbox.append("evt.d.x", b"x" * 700)
        # Scripts may fill three quarters: the rest is kept for results and heartbeats.
        with pytest.raises(OutboxFull, match=r"outbox full: 7\d\d of 750 bytes used"):
            await outbox.append("evt.d.x", b"x" * 200)
        assert (await outbox.stats()).depth == 1

    config = tmp_path / "agent.toml"
    config.write_text(
        f'device_id = "d"\n[agent]\nstate_dir = "{tmp_path / "state"}"\n'
        '[island]\nmax_file_store = "1GiB"\n[hub]\nurls = ["nats-leaf://127.0.0.1:7422"]\n'
        "[outbox]\nmax_bytes = 1000\n"
    )
    ok = run_cli("edge_agent", "-c", str(config), "publish", "evt.d.note", "small")
    assert ok.returncode == 0, ok.stderr
    full = run_cli("edge_agent", "-c", str(config), "publish", "evt.d.note", "y" * 700)
    assert full.returncode == 1
    assert "outbox full" in full.stderr and "outbox.max_bytes" in full.stderr
    bad = run_cli("edge_agent", "-c", str(config), "publish", "cmd.d.ping", "x")
    assert bad.returncode == 2 and "tele. or evt." in bad.stderr


async def test_a_transaction_cancelled_while_it_waits_to_begin_leaves_none_open(
    tmp_path: Path,
) -> None:
    """A writer cancelled while its BEGIN waits for another process's write lock (a shutdown,
    a timeout): once the lock is let go, the BEGIN that ran on in aiosqlite's thread is ended,
    and the next transaction on the same connection begins and commits."""
    async with await StateDB.open(tmp_path / "state.sqlite3") as db:
        outbox = Outbox(db, 1 << 20)
        holder = sqlite3.connect(db.path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        waiting = asyncio.create_task(outbox.append("evt.a.x", b"cancelled"))
        await eventually(lambda: _begin_queued(db), timeout=5, what="the append's BEGIN queued")
        waiting.cancel()
        holder.rollback()
        holder.close()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await outbox.append("evt.a.x", b"after")
        assert [row.data for row in await outbox.batch(10, 0)] == [b"after"]


async def _begin_queued(db: StateDB) -> bool:
    """A writer holds the connection's lock: its BEGIN is in aiosqlite's thread."""
    return db._lock.locked()


async def test_message_ids_are_unique_across_recreated_files(tmp_path: Path) -> None:
    """A new SQLite file restarts row ids, but not Nats-Msg-Ids (the island would drop them)."""
    ids = []
    for name in ("one", "two"):
        async with await StateDB.open(tmp_path / name / "agent.sqlite3") as db:
            outbox = Outbox(db, max_bytes=1024)
            ids.append(outbox.msg_id(await outbox.append("evt.d.x", json.dumps(name).encode())))
    assert ids[0] != ids[1]
    assert all(i.endswith("-1") for i in ids)


async def _depth_below(outbox: Outbox, n: int) -> bool:
    return (await outbox.stats()).depth < n


def _agent_toml(tmp_path: Path, extra: str = "") -> Path:
    config = tmp_path / "agent.toml"
    config.write_text(
        f'device_id = "d"\n[agent]\nstate_dir = "{tmp_path / "state"}"\n'
        '[island]\nmax_file_store = "1GiB"\n[hub]\nurls = ["nats-leaf://127.0.0.1:7422"]\n' + extra
    )
    return config


def test_publish_refuses_what_the_island_could_never_take(tmp_path: Path) -> None:
    """Larger than island.max_payload: exit 1 naming the limit, nothing queued; larger than
    the outbox's share: exit 1 naming outbox.max_bytes, without blaming the island."""
    config = _agent_toml(tmp_path, "[outbox]\nmax_bytes = 4000\n")
    big = subprocess.run(
        [sys.executable, "-m", "edge_agent", "-c", str(config), "publish", "evt.d.blob", "-"],
        input=b"x" * (2 * 1024**2),
        capture_output=True,
        check=False,
        timeout=60,
    )
    assert big.returncode == 1
    assert b"island.max_payload" in big.stderr and b"1048576" in big.stderr
    assert b"Traceback" not in big.stderr
    over = run_cli("edge_agent", "-c", str(config), "publish", "evt.d.blob", "y" * 3500)
    assert over.returncode == 1
    assert "outbox.max_bytes" in over.stderr and "island down" not in over.stderr
    ok = run_cli("edge_agent", "-c", str(config), "publish", "evt.d.note", "small")
    assert ok.returncode == 0 and "queued 5 bytes for evt.d.note" in ok.stdout


async def test_rows_the_island_refuses_for_good_are_set_aside_and_the_rest_flow(
    island: ServerProcess, tmp_path: Path
) -> None:
    """A row over the island's max_payload and one over the stream's max_msg_size go to the
    dead letters; the rows behind them arrive; the CLI lists, retries and drops them."""
    nc, js = await _events_stream(island, max_msg_size=4096)
    config = _agent_toml(tmp_path)
    async with await StateDB.open(tmp_path / "state" / "agent.sqlite3") as db:
        outbox = Outbox(db, max_bytes=64 * 1024**2)  # no max_payload: as rows queued earlier
        await outbox.append("evt.d.huge", b"h" * (2 * 1024**2))
        await outbox.append("evt.d.big", b"b" * 8000)
        await outbox.append("evt.d.result", b"after", kind="result")
        await outbox.append("evt.d.heartbeat", b"beat", kind="heartbeat")
        assert await Drainer(outbox, js, ack_timeout=2.0).flush(timeout=20)
        stats = await outbox.stats()
        assert (stats.depth, stats.dead_letters) == (0, 2)

    assert [m.data for m in await stream_messages(js, "EVENTS")] == [b"after", b"beat"]
    listed = run_cli("edge_agent", "-c", str(config), "dead-letter", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [r["subject"] for r in rows] == ["evt.d.huge", "evt.d.big"]
    assert "larger than the island takes" in rows[0]["reason"]
    assert "refused by the island" in rows[1]["reason"]
    unknown = run_cli(
        "edge_agent", "-c", str(config), "dead-letter", "retry", str(rows[1]["id"]), "999"
    )
    assert unknown.returncode == 1 and "no dead letter with id 999" in unknown.stderr
    assert "nothing changed" in unknown.stderr and "Traceback" not in unknown.stderr
    retried = run_cli("edge_agent", "-c", str(config), "dead-letter", "retry", str(rows[1]["id"]))
    assert retried.returncode == 0 and "queued again: 1" in retried.stdout
    assert run_cli("edge_agent", "-c", str(config), "dead-letter", "drop", "999").returncode == 1
    usage = run_cli("edge_agent", "-c", str(config), "dead-letter", "drop")
    assert usage.returncode == 2
    dropped = run_cli("edge_agent", "-c", str(config), "dead-letter", "drop", "--all")
    assert dropped.returncode == 0 and "dropped: 1" in dropped.stdout
    async with await StateDB.open(tmp_path / "state" / "agent.sqlite3") as db:
        stats = await Outbox(db, max_bytes=64 * 1024**2).stats()
        assert (stats.depth, stats.dead_letters) == (1, 0)  # the retried row waits again
    await nc.close()


async def test_a_batch_of_nothing_but_refused_rows_does_not_stop_the_drainer(
    island: ServerProcess, tmp_path: Path
) -> None:
    """Every row of the batch set aside: the drainer goes on (it once crashed the agent)."""
    nc, js = await _events_stream(island)
    async with await StateDB.open(tmp_path / "agent.sqlite3") as db:
        outbox = Outbox(db, max_bytes=64 * 1024**2)
        await outbox.append("evt.d.huge", b"h" * (2 * 1024**2))
        drainer = Drainer(outbox, js, batch=1)
        assert await drainer.flush(timeout=10)
        await outbox.append("evt.d.next", b"n")
        assert await drainer.flush(timeout=10)
        stats = await outbox.stats()
    assert (stats.depth, stats.dead_letters) == (0, 1)
    assert [m.data for m in await stream_messages(js, "EVENTS")] == [b"n"]
    await nc.close()


async def test_a_full_outbox_still_takes_results_and_heartbeats(tmp_path: Path) -> None:
    """Scripts fill their share; a command result is still recorded with its ledger row, and a
    heartbeat replaces the oldest queued heartbeat instead of being lost."""
    async with await StateDB.open(tmp_path / "agent.sqlite3") as db:
        outbox = Outbox(db, max_bytes=2000)
        while True:
            try:
                await outbox.append("evt.d.note", b"n" * 100)
            except OutboxFull:
                break
        ledger = Ledger(db, outbox, "d")
        await ledger.start("c1", 1, "ping", "2026-01-01T00:00:00Z")
        result = Result("c1", "d", "ok", {"pong": True}, None, "t0", "t1", "ping", 1)
        await ledger.finish("c1", 1, result, "2026-01-01T00:00:00Z")
        for i in range(40):
            await outbox.append("evt.d.heartbeat", f"beat {i:02d}".encode() * 4, kind="heartbeat")
        rows = await outbox.batch(1000)
        assert (await ledger.unfinished()) == []
    subjects = [r.subject for r in rows]
    assert subjects.count("evt.d.result") == 1
    beats = [r.data for r in rows if r.subject == "evt.d.heartbeat"]
    assert beats and beats[-1] == b"beat 39" * 4  # the newest kept, older ones replaced
    assert len(beats) < 40


async def test_a_result_too_large_for_the_island_is_recorded_without_its_output(
    tmp_path: Path,
) -> None:
    """A handler's output (and error text) over island.max_payload: the result is still
    recorded with its ledger row, without the output, saying why; never "interrupted"."""
    async with await StateDB.open(tmp_path / "agent.sqlite3") as db:
        outbox = Outbox(db, max_bytes=1024**2, max_payload=4096)
        ledger = Ledger(db, outbox, "d")
        await ledger.start("c1", 1, "exec", "2026-01-01T00:00:00Z")
        big = Result("c1", "d", "error", "o" * 8000, "e" * 8000, "t0", "t1", "exec", 1)
        await ledger.finish("c1", 1, big, "2026-01-01T00:00:00Z")
        assert (await ledger.unfinished()) == []
        (row,) = await outbox.batch(10)
    sent = json.loads(row.data)
    assert (sent["command_id"], sent["status"], sent["output"]) == ("c1", "error", None)
    assert sent["error"].startswith("e" * 1024 + "…") and "island.max_payload" in sent["error"]


async def test_a_dead_letter_degrades_status_and_shows_in_the_fleet_report(hub: Hub) -> None:
    """A row queued before a smaller max_payload (here: written past the CLI's check) is set
    aside by the running agent; the command result behind it still reaches the hub, status
    turns degraded, and the hub's report shows the count from the next heartbeat."""
    a = await hub.device("a", heartbeat_interval="1s")
    async with await StateDB.open(a.config.agent.database) as db:
        await Outbox(db, a.config.outbox.max_bytes).append("evt.a.blob", b"x" * (2 * 1024**2))
    command = await send_command(hub, "a", "ping")
    await eventually(lambda: _answered(hub, command.id), timeout=60, what="the ping's result")

    async def degraded() -> list[str]:
        return [p for p in (await collect_status(a.config)).problems if "dead-letter" in p]

    assert await eventually(degraded, timeout=30, what="status degraded")

    async def reported() -> int | None:
        devices = await (await Registry.open(hub.js)).list()
        report = await collect_report(hub.nc, hub.config, devices, silent_after=3600)
        return report.devices[0].dead_letters

    assert await eventually(reported, timeout=60, what="dead letter in the report") == 1


async def _answered(hub: Hub, command_id: str) -> bool:
    return command_id in await results(hub.js, "FLEET_EVENTS")


async def test_flush_keeps_its_deadline_while_rows_keep_coming(
    island: ServerProcess, tmp_path: Path
) -> None:
    """Shutdown's flush returns at its deadline even though a script never stops publishing."""
    nc, js = await _events_stream(island)
    async with await StateDB.open(tmp_path / "agent.sqlite3") as db:
        outbox = Outbox(db, max_bytes=256 * 1024**2)
        stop = asyncio.Event()

        async def script() -> None:
            while not stop.is_set():
                await outbox.append_many((f"evt.d.n{i}", b"x") for i in range(500))

        producer = asyncio.create_task(script())
        try:
            await eventually(lambda: _depth_at_least(outbox, 1000), timeout=30)
            flushed = await asyncio.wait_for(Drainer(outbox, js).flush(timeout=1.0), 20)
        finally:
            stop.set()
            await producer
    assert flushed is False  # rows were still arriving at the deadline
    await nc.close()


async def _depth_at_least(outbox: Outbox, n: int) -> bool:
    return (await outbox.stats()).depth >= n
