"""The durable outbox against a real nats-server that the tests kill and restart."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js.api import StreamConfig

from edge_agent.errors import OutboxFull
from edge_agent.outbox import Drainer, Outbox
from edge_agent.statedb import StateDB
from tests.support.cluster import NatsServer, free_port, run_cli, stream_messages
from tests.support.waiting import eventually


@pytest.fixture
async def island(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A JetStream server standing in for the island, with an EVENTS stream on evt.>."""
    port, http = free_port(), free_port()
    conf = tmp_path / "island.conf"
    conf.write_text(
        f'listen: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{http}"\n'
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
    )
    server = await NatsServer(conf, f"http://127.0.0.1:{http}").start()
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


async def test_rows_held_while_island_is_killed_arrive_once_in_order(
    island: NatsServer, tmp_path: Path
) -> None:
    """SIGKILL the island mid-drain and add rows while it is down: each arrives exactly once."""
    nc = await _connect(island.url)  # type: ignore[attr-defined]
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="EVENTS", subjects=["evt.>"], duplicate_window=120))
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


async def test_rows_wait_while_the_island_refuses_them(island: NatsServer, tmp_path: Path) -> None:
    """A stream that refuses writes (full, discard new) leaves rows in SQLite until it accepts."""
    nc = await _connect(island.url)  # type: ignore[attr-defined]
    js = nc.jetstream()
    full = StreamConfig(name="EVENTS", subjects=["evt.>"], max_msgs=1, discard="new")
    await js.add_stream(full)
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
        await outbox.append("evt.d.x", b"x" * 900)
        with pytest.raises(OutboxFull, match=r"outbox full: 9\d\d of 1000 bytes used"):
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
    full = run_cli("edge_agent", "-c", str(config), "publish", "evt.d.note", "y" * 500)
    assert full.returncode == 1
    assert "outbox full" in full.stderr and "outbox.max_bytes" in full.stderr
    bad = run_cli("edge_agent", "-c", str(config), "publish", "cmd.d.ping", "x")
    assert bad.returncode == 2 and "tele. or evt." in bad.stderr


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
