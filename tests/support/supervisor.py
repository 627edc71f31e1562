"""A device laid out as the Ansible role lays it out (``<root>/opt/edge-agent/releases/<v>`` and
``current``), its agent kept running the way systemd's ``Restart=always`` would, from whatever
release ``current`` names when it (re)starts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.protocol.files import read_json
from edge_agent.update.paths import running_file
from hub_ingest.local.link import LinkProxy, Shape
from tests.support.cluster import NATS_SERVER, Hub, free_port
from tests.support.releases import VERSION

RESTART_PAUSE_S = 0.5


@dataclass
class InstalledDevice:
    device_id: str
    root: Path
    config_path: Path
    proxy_port: int
    restarts: int = 0
    _task: asyncio.Task[None] | None = None
    _proc: asyncio.subprocess.Process | None = None
    _stopping: bool = False
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.root / "agent.log"

    @property
    def prefix(self) -> Path:
        return self.root / "opt/edge-agent"

    @property
    def running(self) -> str | None:
        """The version of the agent that last said it was ready."""
        return (read_json(running_file(self.root / "var/lib/edge-agent")) or {}).get("version")

    @property
    def current(self) -> str:
        return os.readlink(self.prefix / "current").rpartition("/")[2]

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise())

    async def _supervise(self) -> None:
        while not self._stopping:
            agent = self.prefix / "current/bin/edge-agent"
            with self.log.open("ab") as out:
                self._proc = await asyncio.create_subprocess_exec(
                    str(agent),
                    "-c",
                    str(self.config_path),
                    "run",
                    stdout=out,
                    stderr=out,
                    start_new_session=True,
                )
            await self._proc.wait()
            self.restarts += 1
            await asyncio.sleep(RESTART_PAUSE_S)

    async def status(self) -> dict[str, Any]:
        """``edge-agent status --json --require-link`` of the current release; raises unless
        healthy with its link up."""
        proc = await asyncio.create_subprocess_exec(
            str(self.prefix / "current/bin/edge-agent"),
            "-c",
            str(self.config_path),
            "status",
            "--json",
            "--require-link",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        if proc.returncode != 0:
            # What status said is the "last" a failed wait shows; the agent log's end too.
            said = (out + err).decode(errors="replace")[-1500:]
            log = self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""
            raise RuntimeError(f"status exit {proc.returncode}: {said}\nagent.log: {log}")
        result: dict[str, Any] = json.loads(out)
        return result

    async def healthy(self) -> bool:
        return bool((await self.status())["healthy"])

    async def close(self) -> None:
        self._stopping = True
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        if self._task is not None:
            await asyncio.wait_for(self._task, 30)
        # An installer the agent started runs in its own session: stop it too.
        pattern = f"{self.config_path} update install"
        subprocess.run(["pkill", "-KILL", "-f", pattern], check=False)


def write_config(
    device: InstalledDevice, hub: Hub, operator_key: str, heartbeat: str = "2s", **update: str
) -> None:
    """The device's agent.toml: a child island, the link through its proxy, pulled updates
    installed by an installer the agent starts itself, restarts by signalling the agent."""
    state = device.root / "var/lib/edge-agent"
    restart = ["pkill", "-TERM", "-f", f"{device.config_path} run$"]
    settings = {
        "operator_key": operator_key,
        "check_interval": "1s",
        "max_rate": "0",
        "prefix": str(device.prefix),
        "python": os.path.realpath(os.sys._base_executable),  # type: ignore[attr-defined]
        "health_deadline": "60s",
        "installer": "spawn",
        **update,
    }
    lines = [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    lines.append(f"restart = {json.dumps(restart)}")
    device.config_path.parent.mkdir(parents=True, exist_ok=True)
    device.config_path.write_text(
        f"""device_id = {json.dumps(device.device_id)}
[agent]
state_dir = {json.dumps(str(state))}
heartbeat_interval = {json.dumps(heartbeat)}
[island]
max_file_store = "256MiB"
client_listen = "127.0.0.1:{free_port()}"
monitor_listen = "127.0.0.1:{free_port()}"
supervise = "child"
nats_server = {json.dumps(NATS_SERVER)}
[hub]
urls = {json.dumps(hub.leaf_urls(device.proxy_port))}
credentials = {json.dumps(str(hub.seed_file(device.device_id)))}
[update]
{chr(10).join(lines)}
"""
    )


async def installed_device(
    hub: Hub,
    base: Path,
    root: Path,
    device_id: str,
    operator_key: str,
    *,
    shape: Shape | None = None,
    heartbeat: str = "2s",
    **update: str,
) -> tuple[InstalledDevice, LinkProxy]:
    """Enrol `device_id`, lay it out under ``root/<id>-root`` with release `VERSION` (a link
    to the venv `base`) current, and start its agent behind a link proxy of `shape`."""
    await hub.register(device_id)
    proxy = await LinkProxy(hub.leaf_port, shape=shape).start(free_port())
    device = InstalledDevice(
        device_id, root / f"{device_id}-root", root / device_id / "agent.toml", proxy.port
    )
    releases = device.prefix / "releases"
    releases.mkdir(parents=True)
    (releases / VERSION).symlink_to(base)
    (device.prefix / "current").symlink_to(f"releases/{VERSION}")
    write_config(device, hub, operator_key, heartbeat, **update)
    device.start()
    return device, proxy
