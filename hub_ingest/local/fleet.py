"""A whole fleet on one machine, on loopback: the hub's nats-server and watcher, and devices
whose agents run their islands as children, each behind its own cuttable link.

`make demo` runs it, and the test bench starts its hub with `start_local_hub`. It drives the
product's own entry points only (``edge-agent run``, ``hub-ingest watch``, `enrol`,
`render_server_config`), so what it shows is what a fleet runs. Every process logs to a file
under the fleet's root; ``python -m hub_ingest.local.fleet stop <root>`` ends a fleet that its
launcher left running (``--keep``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from edge_agent.protocol.files import write_durably
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.names import COMMAND_MIRROR, TELEMETRY
from edge_agent.protocol.natsserver import ServerProcess, resolve_nats_server
from edge_agent.protocol.tomlconf import format_sync
from hub_ingest.core.config import HubConfig, parse_hub_config
from hub_ingest.core.connect import close_quietly
from hub_ingest.core.errors import LocalFleetError
from hub_ingest.fleet.auth import write_auth
from hub_ingest.fleet.enrol import enrol
from hub_ingest.fleet.provision import provision
from hub_ingest.fleet.server import SERVER_ENV, render_server_config

FLEET_FILE = "fleet.json"  # the pids of a running fleet, for `stop`


_HANDED_OUT: set[int] = set()
# [index, count]: this process hands out ports p with p // 64 % count == index (blocks, not
# parity: Linux gives bind() odd ports only, as long as it has some).
_PORT_SHARE = [0, 1]


def share_ports(index: int, count: int) -> None:
    """Hand out only every `count`-th port from now on, so that `count` processes picking
    ports side by side (parallel test workers) never pick one another's."""
    _PORT_SHARE[:] = [index, count]


def free_port() -> int:
    """A port free right now on loopback (configs need fixed ports that survive restarts).
    Never the same port twice in one process: the kernel may hand a closed ephemeral port out
    again before the server it was meant for has bound it (seen: two islands of one test got
    one monitor port, and the second agent took the first's island for its own)."""
    index, count = _PORT_SHARE
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port // 64 % count == index and port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


async def stream_messages(js: JetStreamContext, stream: str) -> list[RawStreamMsg]:
    """Every message in `stream`, in order; gaps (filtered mirrors, deletes) are skipped."""
    info = await js.stream_info(stream)
    msgs: list[RawStreamMsg] = []
    seq = info.state.first_seq
    while info.state.messages and seq <= info.state.last_seq:
        msg = await js.get_msg(stream, seq, next=True, subject=">")
        assert msg.seq is not None
        msgs.append(msg)
        seq = msg.seq + 1
    return msgs


async def _quiet(exc: Exception) -> None:
    """Local clients reconnect through server restarts on purpose; their errors are noise."""


def loopback_hub_config(
    root: Path,
    *,
    leaf_compression: str = "accept",
    leaf_tls: dict[str, Any] | None = None,
    admission: str | None = None,
    max_file_store: str = "1GiB",
    **aggregates: Any,
) -> HubConfig:
    """A hub under ``root/hub`` listening on free loopback ports (`leaf_tls`: the
    ``[server.leaf_tls]`` table; `admission`: ``server.admission``, None for the default)."""
    client = f"127.0.0.1:{free_port()}"
    return parse_hub_config(
        {
            "state_dir": str(root / "hub"),
            "nats": {"servers": [f"nats://{client}"]},
            "aggregates": aggregates,
            "commands": {"max_bytes": "64MiB"},
            "ingest": {"archive": str(root / "archive"), "checkpoint": str(root / "checkpoint")},
            "server": {
                "listen": client,
                "monitor_listen": f"127.0.0.1:{free_port()}",
                "leaf_listen": f"127.0.0.1:{free_port()}",
                "leaf_compression": leaf_compression,
                "max_file_store": max_file_store,
                **({"admission": admission} if admission else {}),
                **({"leaf_tls": leaf_tls} if leaf_tls else {}),
            },
        }
    )


def _toml_values(section: Any) -> str:
    """The fields of `section` that are set, as TOML lines (JSON writes TOML's strings,
    numbers and booleans)."""
    values = ((f.name, getattr(section, f.name)) for f in fields(section))
    return "\n".join(
        f"{name} = {json.dumps(str(v) if isinstance(v, Path) else v)}"
        for name, v in values
        if v is not None
    )


def write_hub_toml(config: HubConfig, path: Path) -> Path:
    """`config` as a hub.toml, for the ``hub-ingest`` commands."""
    srv = config.server
    path.write_text(
        f"""state_dir = {json.dumps(str(config.state_dir))}
[nats]
servers = {json.dumps(list(config.nats.servers))}
domain = {json.dumps(config.nats.domain)}
credentials = {json.dumps(str(config.nats.credentials))}
[server]
server_name = {json.dumps(srv.server_name)}
listen = {json.dumps(srv.listen)}
monitor_listen = {json.dumps(srv.monitor_listen)}
leaf_listen = {json.dumps(srv.leaf_listen)}
leaf_compression = {json.dumps(srv.leaf_compression)}
store_dir = {json.dumps(str(srv.store_dir))}
max_file_store = {srv.max_file_store}
max_memory_store = {srv.max_memory_store}
sync = {json.dumps(format_sync(srv.sync))}
admission = {json.dumps(srv.admission)}
link_life = {srv.link_life}
shared_key_hold = {srv.shared_key_hold}
max_incarnations = {srv.max_incarnations}
[commands]
max_bytes = {config.commands.max_bytes}
max_age = {config.commands.max_age}
[aggregates]
max_sources_per_stream = {config.aggregates.max_sources_per_stream}
[ingest]
{_toml_values(config.ingest)}
""",
        encoding="utf-8",
    )
    return path


@dataclass
class LocalHub:
    """The hub's nats-server, provisioned, with an admin connection."""

    config: HubConfig
    server: ServerProcess
    nc: Client
    js: JetStreamContext

    @property
    def leaf_port(self) -> int:
        return int(self.config.server.leaf_listen.rsplit(":", 1)[1])

    async def close(self) -> None:
        await close_quietly(self.nc)
        await self.server.stop()


async def start_local_hub(
    root: Path,
    *,
    leaf_compression: str = "accept",
    leaf_tls: dict[str, Any] | None = None,
    admission: str | None = None,
    max_file_store: str = "1GiB",
    **aggregates: Any,
) -> LocalHub:
    """Render, start and provision a hub under ``root/hub`` (see `loopback_hub_config`)."""
    config = loopback_hub_config(
        root,
        leaf_compression=leaf_compression,
        leaf_tls=leaf_tls,
        admission=admission,
        max_file_store=max_file_store,
        **aggregates,
    )
    conf = config.server.config_file
    write_auth(config, [])
    write_durably(conf, render_server_config(config))
    monitor = f"http://{config.server.monitor_listen}"
    server = await ServerProcess(conf, monitor, env=SERVER_ENV).start()
    nc: Client | None = None
    try:
        nc, js = await admin_connection(config)
        await provision(js, config, [])
    except BaseException:  # left running, they would outlive the caller
        if nc is not None:
            await nc.close()
        server.kill()
        raise
    return LocalHub(config, server, nc, js)


async def admin_connection(config: HubConfig) -> tuple[Client, JetStreamContext]:
    """The operators' connection to a local hub (any of its servers), reconnecting for ever."""
    nc = await nats.connect(
        list(config.nats.servers),
        nkeys_seed=str(config.nats.credentials),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        error_cb=_quiet,
    )
    return nc, nc.jetstream(domain=config.nats.domain)


@dataclass
class Child:
    """``python -m <module> <args>`` in its own session, logging to `log_path`."""

    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)


@dataclass
class LocalDevice:
    """A device: its agent (and, as the agent's child, its island) behind its own link."""

    device_id: str
    home: Path
    link_port: int
    client_port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    agent: Child | None = None
    link: Child | None = None

    @property
    def config_path(self) -> Path:
        return self.home / "agent.toml"

    @property
    def seed_file(self) -> Path:
        return self.home / "hub.nk"

    @property
    def client_url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def monitor(self) -> Monitor:
        return Monitor(f"http://127.0.0.1:{self.monitor_port}")

    def write_config(self) -> Path:
        """Its agent.toml: the island runs as the agent's child, on loopback."""
        self.config_path.write_text(
            f"""device_id = {json.dumps(self.device_id)}
[agent]
state_dir = {json.dumps(str(self.home / "state"))}
heartbeat_interval = "2s"
[island]
supervise = "child"
max_file_store = "256MiB"
client_listen = "127.0.0.1:{self.client_port}"
monitor_listen = "127.0.0.1:{self.monitor_port}"
nats_server = {json.dumps(resolve_nats_server("nats-server"))}
[hub]
urls = ["nats-leaf://127.0.0.1:{self.link_port}"]
credentials = {json.dumps(str(self.seed_file))}
""",
            encoding="utf-8",
        )
        return self.config_path

    def cut(self) -> None:
        assert self.link is not None, "not started"
        self.link.signal(signal.SIGUSR1)

    def restore(self) -> None:
        assert self.link is not None, "not started"
        self.link.signal(signal.SIGUSR2)


@dataclass
class LocalFleet:
    """A hub, its watcher and devices started by `start`; `stop` ends them all."""

    root: Path
    hub: LocalHub
    hub_toml: Path
    watch: Child
    devices: dict[str, LocalDevice] = field(default_factory=dict)

    @classmethod
    async def start(cls, root: Path) -> LocalFleet:
        hub = await start_local_hub(root)
        hub_toml = write_hub_toml(hub.config, root / "hub.toml")
        watch = Child(["hub_ingest", "-c", str(hub_toml), "watch"], root / "hub-watch.log").start()
        fleet = cls(root, hub, hub_toml, watch)
        fleet.save()
        return fleet

    async def add_device(self, device_id: str, timeout: float = 60) -> LocalDevice:
        """Enrol `device_id`, give it a link and start its agent; return once its island has
        its streams."""
        device = LocalDevice(device_id, self.root / device_id, link_port=free_port())
        device.home.mkdir(parents=True, exist_ok=True)
        await enrol(self.hub.js, self.hub.config, device_id, seed_file=device.seed_file)
        target = str(self.hub.leaf_port)
        device.link = Child(
            ["hub_ingest.local.link", "--listen", str(device.link_port), "--target", target],
            device.home / "link.log",
        ).start()
        config = str(device.write_config())
        device.agent = Child(["edge_agent", "-c", config, "run"], device.home / "agent.log")
        device.agent.start()
        self.devices[device_id] = device
        self.save()
        await _island_ready(device, timeout)
        return device

    def logs(self) -> list[Path]:
        """Every log file of the fleet: the processes' and the nats-servers'."""
        return sorted(self.root.glob("**/*.log"))

    def save(self) -> None:
        # Agents first (their last results and heartbeats still cross), the hub last.
        children = [d.agent for d in self.devices.values()]
        children += [d.link for d in self.devices.values()] + [self.watch]
        pids = [c.pid for c in children if c is not None]
        assert self.hub.server.proc is not None
        pids.append(self.hub.server.proc.pid)
        (self.root / FLEET_FILE).write_text(json.dumps({"pids": pids}))

    async def stop(self) -> None:
        await close_quietly(self.hub.nc)
        await asyncio.to_thread(stop_fleet, self.root)


async def _island_ready(device: LocalDevice, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        agent = device.agent
        if agent is not None and agent.proc is not None and agent.proc.poll() is not None:
            raise LocalFleetError(f"{device.device_id}: agent exited; see {agent.log_path}")
        with contextlib.suppress(OSError, nats.errors.Error, NotFoundError):
            nc = await nats.connect(device.client_url, connect_timeout=1, allow_reconnect=False)
            try:
                js = nc.jetstream()
                await js.stream_info(TELEMETRY)
                await js.stream_info(COMMAND_MIRROR)
                return
            finally:
                await nc.close()
        if time.monotonic() > deadline:
            raise LocalFleetError(f"{device.device_id}: island not ready after {timeout:.0f}s")
        await asyncio.sleep(0.3)


def stop_fleet(root: Path, timeout: float = 60) -> int:
    """SIGTERM every process of the fleet under `root`, in order, each waited for; SIGKILL
    what is still there after `timeout`. Returns how many were running."""
    path = root / FLEET_FILE
    if not path.exists():
        return 0
    pids: list[int] = json.loads(path.read_text())["pids"]
    running = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        running += 1
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    path.unlink()
    return running


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hub_ingest.local.fleet", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop", help="stop the fleet whose state is under ROOT")
    stop.add_argument("root", type=Path)
    args = parser.parse_args(argv)
    stopped = stop_fleet(args.root)
    print(f"stopped {stopped} processes of the fleet in {args.root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
