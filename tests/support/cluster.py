"""Real nats-servers on loopback: a hub, and devices whose agents run their islands as children.

Every device reaches the hub through its own `LinkProxy`, so a test can cut one link at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from tenacity import retry, retry_if_exception_type, stop_after_attempt

from edge_agent.app import Agent
from edge_agent.commands.handlers import Handler
from edge_agent.core.config import Config, parse_config
from edge_agent.island.streams import consumer_request, incarnations
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.names import TELEMETRY, hub_consumer
from edge_agent.protocol.natsserver import resolve_nats_server
from edge_agent.protocol.pack import PACK_HEADER, PACK_SUBJECT, Reading, decode
from edge_agent.protocol.tomlconf import format_sync
from hub_ingest.core.connect import close_quietly
from hub_ingest.fleet.admission import Admission
from hub_ingest.fleet.enrol import enrol
from hub_ingest.fleet.provision import provision, provision_commands
from hub_ingest.fleet.registry import Registry
from hub_ingest.fleet.streams import mirror_name
from hub_ingest.fleet.watch import observe, watch
from hub_ingest.local.fleet import LocalHub, free_port, start_local_hub, stream_messages
from hub_ingest.local.link import LinkProxy
from tests.support.waiting import eventually

NATS_SERVER = resolve_nats_server("nats-server")
# `sections` for a device whose telemetry crosses in packs, and for one whose telemetry
# crosses reading by reading (`Hub.device`'s own default): tests of one path's own mechanism
# name it.
PACKED: dict[str, dict[str, Any]] = {"hub": {"pack": True}}
UNPACKED: dict[str, dict[str, Any]] = {"hub": {"pack": False}}


async def _quiet(exc: Exception) -> None:
    """Test clients reconnect through island restarts on purpose; their errors are noise."""


@dataclass
class Hub(LocalHub):
    """The local fleet's hub, with the watcher run in-process and devices whose agents run
    in this process too."""

    root: Path
    devices: list[Device] = field(default_factory=list)
    stop_watch: asyncio.Event = field(default_factory=asyncio.Event)
    watchers: list[asyncio.Task[None]] = field(default_factory=list)

    def start_watch(self) -> None:
        """Run `hub-ingest watch`'s loop, as the hub's service does: new incarnations are
        mirrored within a second of the device's link coming up (and, under the auth callout,
        devices let in)."""
        monitor = Monitor(f"http://{self.config.server.monitor_listen}")
        self.stop_watch.clear()
        self.watchers.append(
            asyncio.create_task(
                watch(self.js, self.nc, self.config, monitor, self.stop_watch, interval=0.2)
            )
        )

    def start_admission(self) -> None:
        """Answer the hub's auth callout as the watcher does, without the rest of its loop
        (`bench/fleet_scale.py` attaches its devices itself, and times it)."""
        admission = Admission(self.js, self.config)
        self.stop_watch.clear()
        self.watchers.append(asyncio.create_task(admission.run(self.nc, self.stop_watch)))

    async def stop_watching(self) -> None:
        self.stop_watch.set()
        await asyncio.wait_for(asyncio.gather(*self.watchers), 30)
        self.watchers.clear()

    async def look_away(self) -> None:
        """Stop the watcher's rounds (incarnations, gaps, rollouts) for a test of what happens
        without them. Under the auth callout devices are still let in, as another node's
        watcher would."""
        await self.stop_watching()
        if self.config.server.admission == "callout":
            self.start_admission()

    @property
    def url(self) -> str:
        return self.config.nats.servers[0]

    def leaf_urls(self, proxy_port: int) -> list[str]:
        """What a device dials: the hub, through its link proxy."""
        return [f"nats-leaf://127.0.0.1:{proxy_port}"]

    def seed_file(self, device_id: str) -> Path:
        return self.root / device_id / "hub.nk"

    # A loaded cluster may keep a JetStream request past nats-py's 5 s (seen in enrolment's
    # name check, before anything changes); asked again, a registered device is provisioned.
    @retry(
        retry=retry_if_exception_type(nats.errors.TimeoutError),
        stop=stop_after_attempt(3),
        reraise=True,
    )
    async def register(self, device_id: str, *, streams: bool = True) -> None:
        """Enrol the device (key, users file, reload) unless it is; provision the streams.

        With ``streams=False`` only its ``CMD_<id>`` is created: the hub's mirrors of its
        streams are left for `provision`, once the device's streams exist.
        """
        registry = await Registry.open(self.js)
        if device_id not in {d.device_id for d in await registry.list()}:
            seed = self.seed_file(device_id)
            await enrol(self.js, self.config, device_id, seed_file=seed, streams=streams)
        elif streams:
            await self.provision()
        if not streams:
            device = await registry.get(device_id)
            await provision_commands(self.js, self.config, device)

    async def provision(self) -> None:
        registry = await Registry.open(self.js)
        await observe(self.js, self.nc, self.config, await registry.list())
        await provision(self.js, self.config, await registry.list())

    async def mirror(self, device_id: str, stream: str = "TELEMETRY") -> str:
        """The hub's mirror of the current incarnation of a device stream."""
        device = await (await Registry.open(self.js)).get(device_id)
        current = device.current(stream)
        assert current is not None, f"the hub has seen no incarnation of {device_id}'s {stream}"
        return mirror_name(device_id, current)

    async def restart(self) -> None:
        """SIGKILL the hub server and start it again on the same ports and store."""
        self.server.kill()
        await self.server.start()

    async def device(
        self,
        device_id: str,
        *,
        sections: dict[str, dict[str, Any]] | None = None,
        handlers: Mapping[str, Handler] | None = None,
        start: bool = True,
        register_when_ready: bool = False,
        **agent_overrides: Any,
    ) -> Device:
        """Register `device_id`, then start its agent (child-mode island) behind a proxy.

        `sections` adds config keys (``{"commands": {...}}``), `handlers` replaces the
        built-in command handlers; with ``start=False`` the agent is left for the test to
        run (e.g. as a subprocess). With `register_when_ready` the hub's mirrors of the
        device's streams are made once those exist: they then start at once instead of 10-40 s
        later (with ``start=False`` too, the test then calls `register` itself).
        """
        # Enrolled up front: the hub admits no leaf connection without a registered key.
        await self.register(device_id, streams=not register_when_ready)
        proxy = await LinkProxy(self.leaf_port).start(free_port())
        state = self.root / device_id
        data: dict[str, Any] = {
            "device_id": device_id,
            "agent": {"state_dir": str(state), "heartbeat_interval": "2s", **agent_overrides},
            "island": {
                "supervise": "child",
                "max_file_store": "256MiB",
                "client_listen": f"127.0.0.1:{free_port()}",
                "monitor_listen": f"127.0.0.1:{free_port()}",
                "nats_server": NATS_SERVER,
            },
            "hub": {
                "urls": self.leaf_urls(proxy.port),
                "credentials": str(self.seed_file(device_id)),
                # Reading by reading unless a test says `PACKED` (the product packs by
                # default): most tests count the hub's messages as readings. Packing devices
                # meet the chaos runs (`tests/chaos`) and `tests/test_pack.py`.
                "pack": False,
            },
        }
        for name, table in (sections or {}).items():
            data[name] = {**data.get(name, {}), **table}
        device = Device(parse_config(data), proxy, handlers=handlers)
        if start:
            await device.start()
        if register_when_ready and start:
            # Provision sees a device's streams through its link: under the auth callout the
            # first try can be refused while the watcher's registry read lags the enrolment.
            await device.wait_link()
            await self.provision()
        self.devices.append(device)
        return device

    async def copy_of(self, device: Device, urls: list[str] | None = None) -> Device:
        """A second machine whose disk is a copy of stopped `device`'s: its key, its state and
        its island's store, with ports and a link proxy of its own (which `urls` replaces);
        started."""
        state = self.root / f"{device.id}-copy"
        shutil.copytree(device.config.agent.state_dir, state)
        proxy = await LinkProxy(self.leaf_port).start(free_port())
        c = device.config
        island = replace(
            c.island,
            store_dir=state / c.island.store_dir.relative_to(c.agent.state_dir),
            config_path=state / c.island.config_path.relative_to(c.agent.state_dir),
            client_listen=replace(c.island.client_listen, port=free_port()),
            monitor_listen=replace(c.island.monitor_listen, port=free_port()),
        )
        config = replace(
            c,
            island=island,
            agent=replace(c.agent, state_dir=state),
            hub=replace(c.hub, urls=tuple(urls or self.leaf_urls(proxy.port))),
        )
        copy = Device(config, proxy, handlers=device.handlers)
        await copy.start()
        self.devices.append(copy)
        return copy

    async def aggregate_messages(self, stream: str) -> list[RawStreamMsg]:
        return await stream_messages(self.js, stream)

    async def close(self) -> None:
        """Stop the watcher, every device and the hub, each even when one before it failed.

        A `CancelledError` not aimed at this task (one a client library leaked) is reported as
        a `RuntimeError`: pytest stops tearing a test down on a `BaseException`, and the next
        test would then be handed this one's fixtures (its `tmp_path`, with a hub's state in it).
        """
        try:
            async with contextlib.AsyncExitStack() as stack:
                stack.push_async_callback(super().close)
                for device in self.devices:
                    stack.push_async_callback(device.proxy.close)
                    stack.push_async_callback(device.stop)
                stack.push_async_callback(self.stop_watching)
        except asyncio.CancelledError as exc:
            if (task := asyncio.current_task()) is not None and task.cancelling():
                raise
            raise RuntimeError("closing the hub was cancelled from within") from exc


@dataclass
class Device:
    config: Config
    proxy: LinkProxy
    handlers: Mapping[str, Handler] | None = None
    agent: Agent | None = None
    task: asyncio.Task[None] | None = None
    nc: Client | None = None

    @property
    def id(self) -> str:
        return self.config.device_id

    @property
    def monitor(self) -> Monitor:
        return Monitor(self.config.island.monitor_url)

    @property
    def js(self) -> JetStreamContext:
        assert self.nc is not None
        return self.nc.jetstream()

    async def start(self) -> None:
        self.agent = Agent(self.config, handlers=self.handlers)
        self.task = asyncio.create_task(self.agent.run())
        ready = asyncio.create_task(self.agent.ready.wait())
        done, _ = await asyncio.wait({ready, self.task}, timeout=60, return_when="FIRST_COMPLETED")
        if self.task in done:
            ready.cancel()
            self.task.result()
        assert ready in done, f"agent {self.id} not ready within 60s"
        await self.connect()

    async def connect(self) -> None:
        """Connect `nc` to the island (done by `start`; call it when the agent is a subprocess)."""
        if self.nc is None:
            self.nc = await nats.connect(
                self.config.island.client_url,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.2,
                error_cb=_quiet,
            )

    async def stop(self) -> None:
        if self.agent is not None and self.task is not None:
            self.agent.shutdown.set()
            await asyncio.wait_for(self.task, 60)
        self.agent = self.task = None
        if self.nc is not None:
            await close_quietly(self.nc)
            self.nc = None

    async def reimage(self) -> None:
        """Stop the agent and its island, wipe the store and the agent's state (keeping only
        the device's key, as a re-imaged device with the same credentials), and start again."""
        await self.stop()
        for item in self.config.agent.state_dir.iterdir():
            if item.is_dir():
                shutil.rmtree(item)
            elif item != self.config.hub.credentials:
                item.unlink()
        await self.start()

    async def link_up(self) -> bool:
        return await self.monitor.leaf_connected()

    async def link_id(self) -> int | None:
        """The id its island gives its link to the hub (a new one each time it links); None
        while it has none."""
        links = (await self.monitor.get("/leafz"))["leafs"] or []
        return int(links[0]["id"]) if len(links) == 1 else None

    async def wait_link(self, up: bool = True, timeout: float = 30) -> None:
        async def probe() -> bool:
            return await self.link_up() == up

        await eventually(probe, timeout=timeout, what=f"{self.id} link {'up' if up else 'down'}")


async def start_hub(
    root: Path,
    *,
    watching: bool = True,
    leaf_compression: str = "accept",
    leaf_tls: dict[str, Any] | None = None,
    admission: str | None = None,
    max_file_store: str = "1GiB",
    **aggregates: Any,
) -> Hub:
    local = await start_local_hub(
        root,
        leaf_compression=leaf_compression,
        leaf_tls=leaf_tls,
        admission=admission,
        max_file_store=max_file_store,
        **aggregates,
    )
    hub = Hub(local.config, local.server, local.nc, local.js, root)
    if watching:
        hub.start_watch()
    return hub


async def signs_in(url: str, seed: str) -> bool:
    """Whether a client signing in with `seed` is let in (the auth callout asks about clients
    as about leaf connections)."""
    nc = Client()
    try:
        await nc.connect(url, nkeys_seed_str=seed, allow_reconnect=False, connect_timeout=5)
    except nats.errors.Error as exc:
        assert "authorization violation" in str(exc).lower(), exc
        return False
    finally:
        await nc.close()  # refused too: nats-py leaves the socket of a refused connection open
    return True


async def mirror_silent_for(js: JetStreamContext, stream: str, seconds: float) -> bool:
    """Whether mirror `stream` last heard from its origin over `seconds` ago (False if never)."""
    info = await js.stream_info(stream)
    active = info.mirror.active if info.mirror else None
    return active is not None and active > seconds * 1e9


async def mirror_live(js: JetStreamContext, stream: str) -> bool:
    """Whether mirror `stream` heard from its origin in the last two seconds."""
    info = await js.stream_info(stream)
    active = info.mirror.active if info.mirror else None
    return active is not None and 0 <= active < 2e9


def packed_readings(msgs: Iterable[RawStreamMsg]) -> list[Reading]:
    """The readings the packs (`hub.pack`) among `msgs` hold, in order."""
    return [r for m in msgs if PACK_HEADER in (m.headers or {}) for r in decode(m.data or b"")]


async def hub_readings(
    js: JetStreamContext, device_id: str, subject: str, stream: str = "FLEET_TELEMETRY"
) -> list[bytes]:
    """The bodies of `device_id`'s readings published on `subject` in the telemetry
    aggregate (its first shard unless `stream` names another), in its order: each alone, or
    in the device's packs (`hub.pack`)."""
    alone, packs = f"fleet.{device_id}.{subject}", f"fleet.{device_id}.{PACK_SUBJECT}"
    bodies: list[bytes] = []
    for msg in await stream_messages(js, stream):
        if msg.subject == alone:
            bodies.append(msg.data or b"")
        elif msg.subject == packs:
            bodies += [r.data for r in packed_readings([msg]) if r.subject == subject]
    return bodies


async def reset_uplink(device: Device, seq: int) -> None:
    """Move the consumer the hub's mirror reads the device's TELEMETRY through back (or on)
    to `seq`, as the engine does when a mirror binds; the island must take it."""
    incarnation = (await incarnations(device.js))[TELEMETRY]
    assert incarnation is not None and device.nc is not None
    body = json.dumps({"seq": seq}).encode()
    error = await consumer_request(device.nc, "RESET", TELEMETRY, hub_consumer(incarnation), body)
    assert error is None, error


async def stream_has(js: JetStreamContext, stream: str, subject: str) -> bool:
    """Whether `stream` holds a message on `subject` (a filter: wildcards match)."""
    return bool((await js.stream_info(stream, subjects_filter=subject)).state.subjects)


async def hub_has_reading(
    js: JetStreamContext, device_id: str, subject: str, stream: str = "FLEET_TELEMETRY"
) -> bool:
    """Whether the telemetry aggregate (`stream`, its first shard by default) holds a reading
    of `device_id` published on `subject`, alone or in a pack (`hub.pack`)."""
    if await stream_has(js, stream, f"fleet.{device_id}.{subject}"):
        return True
    return bool(await hub_readings(js, device_id, subject, stream))


def run_cli(module: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module args`` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


async def provisioned(hub: LocalHub) -> bool:
    """Provision once the meta leader answers (right after start a cluster may have none)."""
    with contextlib.suppress(Exception):
        await provision(hub.js, hub.config, [])
        return True
    return False


def write_agent_config(device: Device, path: Path, extra: str = "") -> Path:
    """The device's config as TOML, for tests that drive the CLI; `extra` is appended."""
    cfg = device.config
    path.write_text(
        f"""device_id = {json.dumps(cfg.device_id)}
[agent]
state_dir = {json.dumps(str(cfg.agent.state_dir))}
heartbeat_interval = "{cfg.agent.heartbeat_interval:g}s"
[island]
max_file_store = {cfg.island.max_file_store}
client_listen = {json.dumps(str(cfg.island.client_listen))}
monitor_listen = {json.dumps(str(cfg.island.monitor_listen))}
supervise = "child"
nats_server = {json.dumps(cfg.island.nats_server)}
sync = {json.dumps(format_sync(cfg.island.sync))}
[hub]
urls = {json.dumps(list(cfg.hub.urls))}
credentials = {json.dumps(str(cfg.hub.credentials))}
pack = {json.dumps(cfg.hub.pack)}
{extra}"""
    )
    return path


__all__ = [
    "PACKED",
    "UNPACKED",
    "Device",
    "Hub",
    "free_port",
    "hub_has_reading",
    "mirror_live",
    "mirror_silent_for",
    "run_cli",
    "start_hub",
    "stream_messages",
]
