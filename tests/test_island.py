"""The island under the agent: killed with SIGKILL, it comes back with streams and data."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import nats
import structlog.testing

from edge_agent.app import Agent
from edge_agent.island.server import pid_file
from edge_agent.protocol.monitor import Monitor
from edge_agent.status.health import collect_status
from tests.support.cluster import (
    NATS_SERVER,
    Hub,
    free_port,
    run_cli,
    stream_messages,
    write_agent_config,
)
from tests.support.waiting import RESUME_TIMEOUT, eventually


async def test_killed_island_restarts_with_streams_and_data(hub: Hub) -> None:
    """SIGKILL on the child island: the agent restarts it; stored telemetry is intact."""
    a = await hub.device("a")
    assert a.agent is not None
    for i in range(5):
        await a.js.publish("tele.temp", f"r{i}".encode())
    old_pid = int(pid_file(a.config).read_text())

    os.kill(old_pid, signal.SIGKILL)

    async def restarted() -> bool:
        assert a.agent is not None
        return a.agent.island.restarts == 1 and a.agent.island.up.is_set()

    await eventually(restarted, timeout=30, what="island restarted")
    assert int(pid_file(a.config).read_text()) != old_pid
    ack = await eventually(lambda: a.js.publish("tele.temp", b"after"), timeout=30)
    assert ack.seq == 6
    msgs = await stream_messages(a.js, "TELEMETRY")
    assert [m.data for m in msgs] == [b"r0", b"r1", b"r2", b"r3", b"r4", b"after"]
    names = {info.config.name for info in await a.js.streams_info()}
    assert names == {"TELEMETRY", "EVENTS", "COMMANDS"}


async def test_agent_killed_then_restarted_adopts_its_island(hub: Hub, tmp_path: Path) -> None:
    """kill -9 on the agent leaves the island serving; the next agent adopts it, and a
    SIGTERM to that agent stops both cleanly."""
    a = await hub.device("a")
    await a.stop()  # the in-process agent goes; its state directory and link proxy stay
    config_path = write_agent_config(a, tmp_path / "agent.toml")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    argv = [sys.executable, "-m", "edge_agent", "-c", str(config_path), "run"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        first = subprocess.Popen(argv, env=env)
        procs.append(first)
        await eventually(lambda: _healthy(config_path), timeout=60, what="first agent healthy")
        island_pid = int(pid_file(a.config).read_text())
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert await _alive(island_pid), "the island must outlive a killed agent"

        second_log = tmp_path / "second.log"
        with second_log.open("wb") as out:
            second = subprocess.Popen(argv, env=env, stdout=out)
        procs.append(second)

        async def second_ready() -> bool:
            return "agent_ready" in second_log.read_text()

        await eventually(second_ready, timeout=60, what="second agent ready")
        assert int(pid_file(a.config).read_text()) == island_pid  # adopted, not restarted
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 30) == 0
        await eventually(lambda: _dead(island_pid), timeout=15, what="island stopped")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def _healthy(config_path: Path) -> bool:
    result = await asyncio.to_thread(
        run_cli, "edge_agent", "-c", str(config_path), "status", "--json"
    )
    return result.returncode == 0 and json.loads(result.stdout)["healthy"]


async def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _dead(pid: int) -> bool:
    return not await _alive(pid)


async def test_island_that_cannot_start_is_retried_until_it_can(hub: Hub) -> None:
    """A busy client port makes nats-server exit at once; the agent backs off and retries,
    and comes up as soon as the port is free."""
    a = await hub.device("a")
    await a.stop()
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the old island's TIME_WAIT
    blocker.bind(("127.0.0.1", a.config.island.client_listen.port))
    blocker.listen()
    try:
        agent = Agent(a.config)
        task = asyncio.create_task(agent.run())

        async def retried() -> bool:
            return agent.island.starts >= 2

        await eventually(retried, timeout=30, what="a second start attempt")
        assert not agent.island.up.is_set()
    finally:
        blocker.close()
    await eventually(lambda: _is_set(agent.ready), timeout=60, what="agent ready after retry")
    agent.shutdown.set()
    await task


async def test_a_neighbour_on_the_island_monitor_port_is_never_taken_for_the_island(
    hub: Hub,
) -> None:
    """Another nats-server answering on the island's monitor port (a neighbour on the device,
    or one that took the port while the island was down) is refused with its name, not
    adopted; the agent comes up on its own island once the port is free."""
    a = await hub.device("a")
    await a.stop()
    argv = [NATS_SERVER, "-a", "127.0.0.1", "-p", str(free_port()), "--name", "neighbour"]
    argv += ["-m", str(a.config.island.monitor_listen.port)]
    neighbour = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    try:
        await eventually(Monitor(a.config.island.monitor_url).healthy, timeout=30)
        with structlog.testing.capture_logs() as logs:
            agent = Agent(a.config)
            task = asyncio.create_task(agent.run())

            async def refused() -> bool:
                errors = [e.get("error", "") for e in logs if e["event"] == "island_unavailable"]
                return sum("'neighbour'" in e for e in errors) >= 2

            await eventually(refused, timeout=30, what="the neighbour refused twice")
        assert not agent.island.up.is_set() and not agent.ready.is_set()
        assert neighbour.poll() is None  # left alone: never signalled as if it were the island
    finally:
        neighbour.kill()
        neighbour.wait()
    await eventually(lambda: _is_set(agent.ready), timeout=60, what="agent ready on its island")
    assert (await agent.island.monitor.get("/varz"))["server_name"] == a.config.island.server_name
    agent.shutdown.set()
    await task


async def _is_set(event: asyncio.Event) -> bool:
    return event.is_set()


async def test_a_stream_the_island_cannot_recover_is_set_aside(hub: Hub) -> None:
    """A power cut under an interval sync policy can leave a stream's meta.inf empty, and
    nats-server then stays unhealthy for ever. The agent moves the stream aside (status shows
    it), the island starts, the agent makes the stream again and new readings reach the hub."""
    device = await hub.device("a", register_when_ready=True)
    await device.js.publish("tele.before", b"1")
    await device.stop()
    streams = device.config.island.store_dir / "jetstream" / "$G" / "streams"
    for name in ("TELEMETRY", "COMMANDS"):
        (streams / name / "meta.inf").write_bytes(b"")  # what the cut left of it

    await device.start()

    status = await collect_status(device.config)
    assert sorted(n.split("-")[0] for n in status.quarantined) == ["COMMANDS", "TELEMETRY"]
    assert any("set aside" in p for p in status.problems), status.problems
    assert {"TELEMETRY", "EVENTS", "COMMANDS"} <= set(status.streams)
    await device.js.publish("tele.after", b"2")

    async def after_at_hub() -> bool:
        msgs = await stream_messages(hub.js, "FLEET_TELEMETRY")
        return any(m.subject == "fleet.a.tele.after" for m in msgs)

    await eventually(after_at_hub, timeout=RESUME_TIMEOUT, what="a reading after the repair")


async def test_island_started_with_its_link_closed_joins_the_hub_after_open_link(
    hub: Hub, tmp_path: Path
) -> None:
    """What edge-nats.service does on every start: the island comes up with its link to the
    hub disabled, serves local producers, and `edge-agent open-link` resets the consumers the
    hub reads through and opens the link; the hub then has everything, without a gap."""
    a = await hub.device("a", register_when_ready=True)
    for i in range(5):
        await a.js.publish("tele.temp", f"r{i}".encode())
    mirror = await hub.mirror("a")
    await eventually(lambda: _mirrored(hub, mirror, 5), timeout=RESUME_TIMEOUT, what="5 at hub")
    await a.stop()  # the agent and its child island stop; the store stays
    config_path = write_agent_config(a, tmp_path / "agent.toml")
    island_conf = tmp_path / "island.conf"

    rendered = run_cli(
        "edge_agent", "-c", str(config_path), "render-nats-config", "--link-closed",
        "-o", str(island_conf),
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    assert "disabled: true" in island_conf.read_text()
    island = subprocess.Popen([NATS_SERVER, "-c", str(island_conf)], stderr=subprocess.DEVNULL)
    try:
        local = await nats.connect(a.config.island.client_url, max_reconnect_attempts=-1)
        js = local.jetstream()
        for i in range(5, 10):
            await eventually(functools.partial(js.publish, "tele.temp", b"r%d" % i), timeout=30)
        opened = await asyncio.to_thread(
            run_cli, "edge_agent", "-c", str(config_path), "open-link", "-o", str(island_conf)
        )
        assert opened.returncode == 0, opened.stderr
        assert "disabled" not in island_conf.read_text()
        await eventually(lambda: _mirrored(hub, mirror, 10), timeout=RESUME_TIMEOUT, what="10")
        state = (await hub.js.stream_info(mirror)).state
        assert (state.first_seq, state.last_seq, state.num_deleted or 0) == (1, 10, 0)
        await local.close()
    finally:
        island.terminate()
        await asyncio.to_thread(island.wait, 30)


async def _mirrored(hub: Hub, mirror: str, count: int) -> bool:
    return (await hub.js.stream_info(mirror)).state.messages >= count
