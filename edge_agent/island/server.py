"""The island: the device's own nats-server, a JetStream leaf node with its own domain.

This module renders its configuration, watches it through the monitoring endpoint, and in
``supervise = "child"`` mode runs it as a child process, restarting it with backoff when it
dies. In ``"external"`` mode systemd runs it (``edge-nats.service``) and the agent only watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import nats.errors
import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential_jitter

from edge_agent.core.config import Config
from edge_agent.core.errors import (
    ConfigError,
    IslandError,
    IslandUnavailable,
    StoreDamaged,
    is_retriable,
)
from edge_agent.island.compression import link_mode
from edge_agent.island.streams import reset_hub_consumers
from edge_agent.protocol.errors import MonitorUnavailable, StreamError
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.natsserver import check_version, resolve_nats_server
from edge_agent.protocol.tomlconf import render_sync
from edge_agent.protocol.units import utc_now_iso

log = structlog.get_logger(__name__)

# Subjects that stay on the device: telemetry and events reach the hub only through
# JetStream sourcing, commands only through the mirror. Letting them cross as plain
# messages would store another device's data in this island (same account, same subjects).
LOCAL_ONLY_SUBJECTS = ("tele.>", "evt.>", "cmd.>")


def _q(value: object) -> str:
    """Quote a value for the nats-server config format (JSON strings are accepted)."""
    return json.dumps(str(value))


def _qlist(values: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(_q(v) for v in values) + "]"


def read_seed(path: Path) -> str:
    """The device's NKey seed from its credentials file (written by ``hub-ingest device add``)."""
    try:
        seed = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError("hub.credentials", f"cannot read {path}: {exc.strerror}") from None
    if not (seed.startswith("SU") and len(seed) == 58):
        raise ConfigError("hub.credentials", f"{path} does not hold a NATS user seed (SU...)")
    return seed


STOP_TIMEOUT_S = 10.0  # for a child island to stop on SIGTERM


def pid_file(config: Config) -> Path:
    return config.agent.state_dir / "nats-server.pid"


def render_config(config: Config, *, link_open: bool = True) -> str:
    """The nats-server configuration for this device's island; with `link_open` false its
    leaf remote is disabled until `open_link` (see there for why an island starts so)."""
    isl, hub = config.island, config.hub
    remote = [f"urls: {_qlist(hub.urls)}"]
    if not link_open:
        remote.append("disabled: true")
    if hub.credentials is not None:
        remote.append(f"nkey: {_q(read_seed(hub.credentials))}")
    if hub.tls is not None:
        tls = [
            f"{key}: {_q(value)}"
            for key, value in (
                ("ca_file", hub.tls.ca_file),
                ("cert_file", hub.tls.cert_file),
                ("key_file", hub.tls.key_file),
            )
            if value is not None
        ]
        remote.append("tls {\n        " + "\n        ".join(tls) + "\n      }")
    remote.append(f"compression: {_q(link_mode(config))}")
    remote.append(f"deny_imports: {_qlist(LOCAL_ONLY_SUBJECTS)}")
    remote.append(f"deny_exports: {_qlist(LOCAL_ONLY_SUBJECTS)}")
    remote_block = "\n      ".join(remote)
    source = f" from {config.source}" if config.source else ""
    return f"""\
# Rendered by edge-agent{source}; edit the agent config instead.
server_name: {_q(isl.server_name)}
listen: {_q(isl.client_listen)}
http: {_q(isl.monitor_listen)}
pid_file: {_q(pid_file(config))}
max_payload: {isl.max_payload}

jetstream {{
  domain: {_q(isl.domain)}
  store_dir: {_q(isl.store_dir)}
  max_file_store: {isl.max_file_store}
  max_memory_store: {isl.max_memory_store}
  {render_sync(isl.sync)}
}}

leafnodes {{
  reconnect: {_q(f"{round(leaf_reconnect(config) * 1000)}ms")}
  remotes: [
    {{
      {remote_block}
    }}
  ]
}}
"""


def leaf_reconnect(config: Config) -> float:
    """Seconds between the leaf remote's attempts: `hub.reconnect` plus this device's share
    of `hub.reconnect_spread`, fixed by its id. After a hub restart a fleet then arrives over
    the spread instead of within the same quarter second, which a hub with hundreds of
    devices cannot take (docs/scaling.md)."""
    digest = hashlib.sha256(config.device_id.encode()).digest()
    share = int.from_bytes(digest[:8], "big") / 2**64
    return config.hub.reconnect + share * config.hub.reconnect_spread


def write_config(config: Config, *, link_open: bool = True) -> Path:
    """Render the island config to `island.config_path` and check it with ``nats-server -t``."""
    path = config.island.config_path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    # The file holds the device's NKey seed: readable by its owner only.
    tmp.touch(mode=0o600)
    tmp.chmod(0o600)
    tmp.write_text(render_config(config, link_open=link_open), encoding="utf-8")
    check_config(config.island.nats_server, tmp)
    tmp.replace(path)
    return path


async def open_link(config: Config, pid: int) -> None:
    """Enable the leaf remote of an island started with it disabled, once the consumers the
    hub's mirrors bind to are reset: the config is rewritten and `pid` reloads it.

    nats-server writes a consumer's state asynchronously (up to ten times a second, never
    fsynced), so an island that was killed or lost power restarts those consumers from an
    older delivered position, with the messages after it pending redelivery. A mirror ignores
    redeliveries, and when the next new message's delivery sequence is the one it expects
    while its stream sequence has jumped, it records the jump as deleted: a gap at the hub
    that nothing refills. Reset to its acknowledgement floor, a consumer delivers afresh from
    a point the hub already holds (the hub ignores what it has), so nothing is skipped.
    """
    try:
        nc = await nats.connect(
            config.island.client_url,
            name="edge-agent-open-link",
            connect_timeout=2,
            allow_reconnect=False,
        )
    except (OSError, nats.errors.Error) as exc:
        raise IslandUnavailable(f"island at {config.island.client_url}: {exc}") from exc
    try:
        reset = await reset_hub_consumers(nc)
    except (nats.errors.Error, TimeoutError) as exc:
        raise IslandUnavailable(f"resetting the hub consumers: {exc!r}") from exc
    except StreamError as exc:
        raise IslandError(str(exc)) from exc
    finally:
        await nc.close()
    await asyncio.to_thread(write_config, config)
    os.kill(pid, signal.SIGHUP)
    log.info("island_link_opened", pid=pid, consumers_reset=reset)


def check_config(nats_server: str, path: Path) -> None:
    """Run ``nats-server -t -c path``; raise with its output when it refuses the file, or
    when the binary is older than the oldest release this agent supports."""
    executable = resolve_nats_server(nats_server)
    check_version(executable, "island.nats_server")
    result = subprocess.run(
        [executable, "-t", "-c", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip()
        raise IslandError(f"nats-server rejected {path}: {detail}")


# What /healthz says for a stream whose files a power cut damaged beyond nats-server's own
# repair (an empty meta.inf, for one): the island stays unhealthy until the stream is gone.
_UNRECOVERABLE = re.compile(r"JetStream stream '(\S+) > (\S+)' could not be recovered")


def quarantine_dir(config: Config) -> Path:
    """Where damaged stream directories are set aside (kept for an operator, never read)."""
    return config.agent.state_dir / "quarantine"


def quarantined(config: Config) -> list[str]:
    directory = quarantine_dir(config)
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


async def wait_healthy(
    monitor: Monitor, timeout: float, proc: asyncio.subprocess.Process | None = None
) -> None:
    """Return once the island answers healthy; raise `IslandUnavailable` after `timeout`,
    or as soon as `proc` (the island being started) has exited, and `StoreDamaged` as soon as
    it reports a stream it cannot recover."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            health = await monitor.get("/healthz")
        except MonitorUnavailable:
            health = {}  # not listening yet
        if health.get("status") == "ok":
            return
        if damaged := _UNRECOVERABLE.search(str(health.get("error") or "")):
            raise StoreDamaged(damaged.group(1), damaged.group(2))
        if proc is not None and proc.returncode is not None:
            raise IslandUnavailable(f"nats-server exited with code {proc.returncode} on start-up")
        if time.monotonic() > deadline:
            raise IslandUnavailable(
                f"island not healthy at {monitor.base_url} after {timeout:.0f}s"
            )
        await asyncio.sleep(0.1)


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    wait = state.next_action.sleep if state.next_action else 0.0
    log.warning("island_unavailable", error=str(exc), attempt=state.attempt_number, retry_in_s=wait)


class Island:
    """Keeps the island available: runs it as a child, or watches the external one.

    `run()` returns only when cancelled. `up` is set while the island is healthy. In child mode
    an island left running by an agent that was killed is adopted rather than started twice.
    """

    def __init__(
        self,
        config: Config,
        *,
        start_timeout: float = 30.0,
        stop_timeout: float = STOP_TIMEOUT_S,
        unhealthy_restart_after: float = 10.0,
        on_up: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        self.monitor = Monitor(config.island.monitor_url)
        self.up = asyncio.Event()
        self.restarts = 0
        self.starts = 0
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._unhealthy_restart_after = unhealthy_restart_after
        self._on_up = on_up
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def child_mode(self) -> bool:
        return self.config.island.supervise == "child"

    async def run(self) -> None:
        while True:
            retrying = AsyncRetrying(
                retry=retry_if_exception(is_retriable),
                wait=wait_exponential_jitter(multiplier=0.2, jitter=0.2, max=30.0),
                before_sleep=_log_retry,
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    await self._bring_up()
            self.up.set()
            log.info(
                "island_up", pid=self._proc.pid if self._proc else None, restarts=self.restarts
            )
            if self._on_up is not None:
                await self._on_up()
            await self._watch()
            self.up.clear()
            self.restarts += 1
            log.warning("island_down", restarts=self.restarts)

    async def _bring_up(self) -> None:
        if await self.monitor.healthy():
            # Already running: external mode, or a child adopted after an agent crash, which
            # may have come before its link was opened.
            if self.child_mode:
                await self._check_ours()
                if (pid := self._adopted_pid()) is not None:
                    await open_link(self.config, pid)
            return
        if not self.child_mode:
            raise IslandUnavailable(f"island at {self.monitor.base_url} is not healthy")
        await asyncio.to_thread(write_config, self.config, link_open=False)
        await self._start_child()
        try:
            await wait_healthy(self.monitor, self._start_timeout, self._proc)
            await self._check_ours()
            assert self._proc is not None
            await open_link(self.config, self._proc.pid)
        except StoreDamaged as exc:
            await self._stop_child()
            self._set_aside(exc.account, exc.stream)
            raise
        except IslandError:
            await self._stop_child()
            raise

    async def _check_ours(self) -> None:
        """Refuse a healthy monitor port that is another nats-server's (a neighbour on the
        device, or one that took the port while the island was down): adopting it would point
        the agent at a server that is not its island, and it would wait there for ever."""
        name = (await self.monitor.get("/varz")).get("server_name")
        expected = self.config.island.server_name
        if name != expected:
            raise IslandUnavailable(
                f"{self.monitor.base_url} answers as nats-server {name!r}, not as this "
                f"island ({expected!r}): another server holds the island's monitor port"
            )

    def _set_aside(self, account: str, stream: str) -> None:
        """Move a stream nats-server cannot recover out of the store, so that the island
        starts and the agent makes the stream again (an outbound stream with a new
        incarnation, the command mirror refilled from the hub; the ledger keeps commands from
        running twice). What the damaged stream held that had not reached the hub is lost:
        only ``sync = "always"`` prevents this (README, power cuts)."""
        source = self.config.island.store_dir / "jetstream" / account / "streams" / stream
        stamp = utc_now_iso().replace(":", "")
        target = quarantine_dir(self.config) / f"{stream}-{stamp}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(source, target)
        log.error("island_stream_quarantined", stream=stream, moved_to=str(target))

    async def _start_child(self) -> None:
        exe = resolve_nats_server(self.config.island.nats_server)
        self.starts += 1
        self._proc = await asyncio.create_subprocess_exec(
            exe, "-c", str(self.config.island.config_path), stdin=asyncio.subprocess.DEVNULL
        )
        log.info("island_started", pid=self._proc.pid, config=str(self.config.island.config_path))

    async def _watch(self) -> None:
        """Return when the island stops serving: the child exits, or it stays unhealthy.

        A JetStream store that hit a write error (disk full) stays unavailable after the
        space comes back, until the server restarts: in child mode this restarts it.
        """
        unhealthy_since: float | None = None
        while True:
            proc = self._proc
            if proc is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 1.0)
                if proc.returncode is not None:
                    log.warning("island_exited", pid=proc.pid, code=proc.returncode)
                    self._proc = None
                    return
            else:
                await asyncio.sleep(1.0)
            if await self.monitor.healthy():
                unhealthy_since = None
                continue
            unhealthy_since = unhealthy_since or time.monotonic()
            if time.monotonic() - unhealthy_since >= self._unhealthy_restart_after:
                log.warning("island_unhealthy", restarting=self.child_mode)
                await self.stop()
                return

    async def reload(self) -> None:
        """Render the island's config again and have the running island reload it."""
        pid = self._proc.pid if self._proc is not None else self._adopted_pid()
        if pid is None:
            return
        await asyncio.to_thread(write_config, self.config)
        os.kill(pid, signal.SIGHUP)
        log.info("island_reloaded", pid=pid)

    async def stop(self) -> None:
        """Stop the island if this agent runs it (child mode); leave an external one alone."""
        if not self.child_mode:
            return
        if self._proc is not None:
            await self._stop_child()
            return
        pid = self._adopted_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + self._stop_timeout
            while await self.monitor.healthy() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)

    def _adopted_pid(self) -> int | None:
        try:
            return int(pid_file(self.config).read_text().strip())
        except (OSError, ValueError):
            return None

    async def _stop_child(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), self._stop_timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        log.info("island_stopped", pid=proc.pid, code=proc.returncode)
