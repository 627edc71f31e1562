"""The agent as systemd runs it: SIGKILL mid-command, SIGTERM with work in flight, sd_notify."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.app import shutdown_budget
from edge_agent.core.config import load_config
from edge_agent.core.statedb import StateDB
from edge_agent.outbox.store import Outbox
from edge_agent.protocol.natsserver import ServerProcess
from edge_agent.status.health import collect_status
from tests.support.agent_process import AgentProcess
from tests.support.cluster import Hub, run_cli, stream_messages, write_agent_config
from tests.support.commands import counter_program, results, runs, send_command
from tests.support.waiting import eventually


def _commands_section(counter: list[str], grace: str = "10s") -> str:
    return f'[commands]\nexec_allow = [{json.dumps([*counter, "*"])}]\nshutdown_grace = "{grace}"\n'


async def test_agent_killed_mid_handler_does_not_run_it_again(hub: Hub, tmp_path: Path) -> None:
    """SIGKILL (agent, island, handler) while a command runs: after the restart it is not
    run again, and an error result saying why reaches the hub."""
    counter = counter_program(tmp_path)
    ran = tmp_path / "runs"
    a = await hub.device("a", start=False, register_when_ready=True)
    config = write_agent_config(a, tmp_path / "agent.toml", _commands_section(counter))
    first = AgentProcess(config, tmp_path / "first.log").start()
    second = AgentProcess(config, tmp_path / "second.log")
    try:
        await first.wait_event("agent_ready")
        await hub.register("a")
        command = await send_command(hub, "a", "exec", {"argv": [*counter, str(ran), "60"]})
        await eventually(lambda: _ran(ran), timeout=30, what="handler started")
        first.kill()

        second.start()
        await second.wait_event("agent_ready")

        async def at_hub() -> dict[str, object] | None:
            return (await results(hub.js, "FLEET_EVENTS")).get(command.id)

        result = await eventually(at_hub, timeout=90, what="result at the hub")
        assert result["status"] == "error"
        assert "interrupted" in str(result["error"])
        assert runs(ran) == 1
        status = await collect_status(a.config)
        assert status.commands is not None
        assert (status.commands.failed, status.commands.running) == (1, 0)
    finally:
        first.close()
        second.close()


async def _ran(path: Path) -> bool:
    return runs(path) >= 1


async def test_sigterm_lets_the_command_finish_and_flushes_the_outbox(
    hub: Hub, tmp_path: Path
) -> None:
    """``edge-agent run`` gets SIGTERM with a command running and rows queued: it exits 0
    after the command's result and every row are in the island."""
    counter = counter_program(tmp_path)
    ran = tmp_path / "runs"
    a = await hub.device("a", start=False)
    config = write_agent_config(a, tmp_path / "agent.toml", _commands_section(counter, "30s"))
    agent = AgentProcess(config, tmp_path / "agent.log").start()
    try:
        await agent.wait_event("agent_ready")
        command = await send_command(hub, "a", "exec", {"argv": [*counter, str(ran), "2"]})
        await eventually(lambda: _ran(ran), timeout=30, what="handler started")
        cli = run_cli("edge_agent", "-c", str(config), "publish", "evt.a.note", "from-cli")
        assert cli.returncode == 0, cli.stderr
        # Another process appending, as scripts do: the agent only notices by polling.
        async with await StateDB.open(a.config.agent.database) as db:
            await Outbox(db, a.config.outbox.max_bytes).append_many(
                (f"evt.a.n{i}", b"queued") for i in range(500)
            )
        assert await agent.terminate() == 0
    finally:
        agent.close()
    assert agent.events("agent_stopped")
    status = run_cli("edge_agent", "-c", str(config), "status", "--json")
    assert status.returncode == 1  # the island is down with the agent (child mode)
    local = json.loads(status.stdout)
    assert local["outbox"]["depth"] == 0 and local["outbox"]["oldest_age_s"] is None
    assert local["commands"]["executed"] == 1 and local["commands"]["last_seq"] == 1

    island = ServerProcess(a.config.island.config_path, a.config.island.monitor_url)
    await island.start()
    try:
        await a.connect()
        msgs = await stream_messages(a.js, "EVENTS")
        notes = [m for m in msgs if m.subject and m.subject.startswith("evt.a.n")]
        assert len(notes) == 501
        result = (await results(a.js, "EVENTS"))[command.id]
        assert result["status"] == "ok" and result["output"]["output"] == "done\n"
    finally:
        await island.stop()


@pytest.fixture
def notify_socket() -> Iterator[socket.socket]:
    # AF_UNIX paths are limited to ~108 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="sdn") as root:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(Path(root) / "notify"))
        sock.setblocking(False)
        try:
            yield sock
        finally:
            sock.close()


async def test_sd_notify_ready_then_watchdog_then_stopping(
    hub: Hub, notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """READY=1 once up, WATCHDOG=1 only after it, STOPPING=1 last."""
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.getsockname())
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    received: list[str] = []

    async def watchdogs(n: int) -> bool:
        while True:
            try:
                received.append(notify_socket.recv(4096).decode())
            except BlockingIOError:
                break
        return sum(m == "WATCHDOG=1" for m in received) >= n

    a = await hub.device("a")
    await eventually(lambda: watchdogs(3), timeout=30, what="three WATCHDOG=1")
    await a.stop()
    await watchdogs(0)
    assert received[0] == "READY=1\nSTATUS=serving"
    assert received[-1] == "STOPPING=1\nSTATUS=stopping"
    assert set(received[1:-1]) == {"WATCHDOG=1"}


async def test_a_slow_shutdown_fits_the_units_stop_timeout(hub: Hub, tmp_path: Path) -> None:
    """SIGTERM while a handler runs far past its grace and scripts keep publishing: the agent
    still exits 0 within its shutdown budget, which fits systemd's TimeoutStopSec."""
    unit = (Path(__file__).parents[1] / "systemd/edge-agent.service").read_text()
    stop_timeout = float(unit.split("TimeoutStopSec=", 1)[1].split("s", 1)[0])
    counter = counter_program(tmp_path)
    ran = tmp_path / "runs"
    a = await hub.device("a", start=False)
    config = write_agent_config(a, tmp_path / "agent.toml", _commands_section(counter, "2s"))
    budget = shutdown_budget(load_config(config))
    assert budget <= stop_timeout - 10  # a margin for systemd and a slow disk
    agent = AgentProcess(config, tmp_path / "agent.log").start()
    try:
        await agent.wait_event("agent_ready")
        await send_command(hub, "a", "exec", {"argv": [*counter, str(ran), "600"]})
        await eventually(lambda: _ran(ran), timeout=30, what="handler started")
        async with await StateDB.open(a.config.agent.database) as db:
            outbox = Outbox(db, a.config.outbox.max_bytes)
            await outbox.append_many((f"evt.a.n{i}", b"x") for i in range(20000))
            started = time.monotonic()
            code = await agent.terminate(timeout=budget + 5)
        assert code == 0
        assert time.monotonic() - started <= budget
    finally:
        agent.close()


async def test_a_write_lock_held_past_the_busy_timeout_is_waited_out(
    hub: Hub, tmp_path: Path
) -> None:
    """Another process holds the state file's write lock longer than SQLite's busy timeout
    (a large ``edge-agent publish``, an SD card stalling an fsync): the agent keeps running,
    a CLI publish fails with one line naming the file, and once the lock is let go the
    heartbeats resume and the outbox drains."""
    a = await hub.device("a", start=False, heartbeat_interval="1s")
    config = write_agent_config(a, tmp_path / "agent.toml")
    agent = AgentProcess(config, tmp_path / "agent.log").start()
    try:
        await agent.wait_event("heartbeat_queued")
        holder = sqlite3.connect(a.config.agent.database, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            cli = await asyncio.to_thread(
                run_cli, "edge_agent", "-c", str(config), "publish", "evt.a.x", "{}"
            )
            await agent.wait_event("state_db_busy")
            await agent.wait_event("heartbeat_not_queued")
        finally:
            holder.rollback()
            holder.close()
        assert cli.returncode == 1
        assert str(a.config.agent.database) in cli.stderr and "locked" in cli.stderr
        queued = len(agent.events("heartbeat_queued"))
        await agent.wait_event("heartbeat_queued", count=queued + 2)

        async def drained() -> bool:
            status = await collect_status(a.config)
            return status.outbox is not None and status.outbox.depth == 0

        await eventually(drained, timeout=30, what="outbox drained")
        assert agent.proc is not None and agent.proc.poll() is None
    finally:
        agent.close()
