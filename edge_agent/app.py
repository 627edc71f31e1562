"""Wiring of the agent daemon (``edge-agent run``).

One `asyncio.TaskGroup` holds the island supervisor, the stream reconciler, the link watcher,
the heartbeat, the outbox drainer, the command executor, fast resume and the systemd
watchdog. Signal handlers only set the shutdown event (see `cli`); tests pass their own
event. Shutdown order:

1. ``STOPPING=1``; the executor stops fetching and lets the running command finish within
   ``commands.shutdown_grace`` (then cancels it, recording an error result);
2. flush the outbox (while the island is up, within the same grace);
3. stop the loops (no new heartbeats, no new link polls);
4. drain the NATS connection, so every publish already handed to it is flushed;
5. stop the island, in child mode only: in external mode it keeps serving local producers;
6. close the SQLite file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import asdict
from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from edge_agent import __version__
from edge_agent.commands.executor import CANCEL_WAIT_S, Executor
from edge_agent.commands.fence import CommandFence
from edge_agent.commands.handlers import Handler, builtin_handlers
from edge_agent.commands.hubclock import HubClock
from edge_agent.commands.ledger import Ledger
from edge_agent.commands.origin import consumer_to_bind
from edge_agent.commands.resume import READ_TIMEOUT_S, FastResume
from edge_agent.core.config import Config
from edge_agent.core.errors import OutboxError, ProtocolError, StateDBError
from edge_agent.core.notify import Notifier
from edge_agent.core.statedb import StateDB
from edge_agent.island.compression import LinkCompression
from edge_agent.island.link import LinkTracker, write_clock
from edge_agent.island.packer import Packer
from edge_agent.island.server import STOP_TIMEOUT_S, Island
from edge_agent.island.streams import reconcile
from edge_agent.island.unstall import Unstaller
from edge_agent.island.windows import Windows
from edge_agent.outbox.drain import Drainer
from edge_agent.outbox.store import Outbox
from edge_agent.protocol.errors import StoreTrouble
from edge_agent.protocol.files import write_json
from edge_agent.protocol.monitor import LeafRtt
from edge_agent.protocol.names import EVENTS, OUTBOUND, TELEMETRY, command_stream, inbox_prefix
from edge_agent.protocol.pack import READINGS
from edge_agent.protocol.units import utc_now_iso
from edge_agent.status.health import Status, collect_status, heartbeat_payload, with_drain_rates
from edge_agent.status.metrics import write_textfile
from edge_agent.update.paths import running_file
from edge_agent.update.updater import Updater

log = structlog.get_logger(__name__)


_STRAGGLER_GRACE_S = 5.0  # after the TaskGroup's cancel, before cancelling again
_DRAIN_TIMEOUT_S = 5.0  # nats-py would wait 30 s to drain the island connection


def shutdown_budget(config: Config) -> float:
    """The longest a SIGTERM can take, stage by stage (see the module docstring): the running
    command (grace, then its cancel), the outbox flush (grace), one more cancel round, the
    connection drain and the island's stop. With the defaults: 10+5 + 10 + 5 + 5 + 10 = 45 s,
    inside edge-agent.service's TimeoutStopSec=60s with 15 s to spare."""
    grace = config.commands.shutdown_grace
    return 2 * grace + CANCEL_WAIT_S + _STRAGGLER_GRACE_S + _DRAIN_TIMEOUT_S + STOP_TIMEOUT_S


CLOCK_SYNC_S = 60.0  # while the link is up; and at once whenever it comes up


class _Shutdown(Exception):
    """Raised inside the task group to stop every sibling task."""


async def connect_island(config: Config, name: str = "edge-agent") -> Client:
    """A client connection to the island that never gives up reconnecting."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats_error", error=str(exc) or type(exc).__name__)

    async def on_disconnect() -> None:
        log.info("nats_disconnected")

    async def on_reconnect() -> None:
        log.info("nats_reconnected")

    return await nats.connect(
        config.island.client_url,
        name=name,
        # nats-py stops after 60 attempts (~2 minutes) by default; the island always comes back.
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=2,
        drain_timeout=_DRAIN_TIMEOUT_S,
        # Replies to requests that cross the link come back on a subject only this device
        # may subscribe to at the hub (the default _INBOX.> would see everybody's replies).
        inbox_prefix=inbox_prefix(config.device_id),
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )


class Agent:
    """The device daemon. `run()` returns after `shutdown` is set and everything is closed."""

    def __init__(
        self,
        config: Config,
        shutdown: asyncio.Event | None = None,
        *,
        handlers: Mapping[str, Handler] | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.shutdown = shutdown or asyncio.Event()
        self.island = Island(config, on_up=self._island_came_up)
        self.link = LinkTracker(config, self.island.monitor)
        reload = self._apply_link_mode if self.island.child_mode else None
        self.compression = LinkCompression(config, self.island.monitor, reload)
        self.ready = asyncio.Event()
        self.handlers = builtin_handlers() if handlers is None else handlers
        self.notifier = notifier or Notifier()
        self.restart_requested = False
        self.clock = HubClock()
        self.outbox: Outbox | None = None
        self.drainer: Drainer | None = None
        self.executor: Executor | None = None
        self.packer: Packer | None = None
        self._db: StateDB | None = None
        self._reconcile_needed = asyncio.Event()
        self._island_was_fresh: bool | None = None  # EVENTS created by the first reconcile
        self._nc: Client | None = None
        self._started = time.monotonic()
        self._last_status: Status | None = None  # the previous heartbeat's, for drain rates
        self._resume: FastResume | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._recancel: asyncio.Task[None] | None = None

    async def _island_came_up(self) -> None:
        self._reconcile_needed.set()

    async def _apply_link_mode(self) -> None:
        """A new compression choice: the island reloads with it, and the hub's mirrors get the
        window that goes with it (`edge_agent.island.streams.uplink_window`)."""
        await self.island.reload()
        self._reconcile_needed.set()

    async def run(self) -> None:
        log.info(
            "agent_starting", device_id=self.config.device_id, mode=self.config.island.supervise
        )
        self._db = await StateDB.open(self.config.agent.database)
        self.outbox = Outbox(self._db, self.config.outbox.max_bytes, self.config.island.max_payload)
        failure: ProtocolError | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                self._spawn(tg, self.island.run())
                self._spawn(tg, self._serve(tg))
                self._spawn(tg, self._wait_for_shutdown())
        except* _Shutdown:
            pass
        except* ProtocolError as group:
            # The agent's own errors (a bad seed file, no nats-server) leave the task group
            # once, as themselves: `cli.main` turns them into one line and an exit code.
            failure = group.exceptions[0]  # type: ignore[assignment]
            log.error("agent_failed", device_id=self.config.device_id, error=str(failure))
        finally:
            if self._recancel is not None:
                self._recancel.cancel()
            await self._close()
        if failure is not None:
            raise failure
        log.info("agent_stopped", device_id=self.config.device_id)

    async def _wait_for_shutdown(self) -> None:
        await self.shutdown.wait()
        self.notifier.stopping()
        log.info("agent_stopping", device_id=self.config.device_id)
        grace = self.config.commands.shutdown_grace
        if self.executor is not None:
            await self.executor.stop(grace)
        if self.drainer is not None and self.island.up.is_set():
            # Rows that do not make it stay in SQLite for the next start; nothing is lost.
            await self.drainer.flush(grace)
        self._recancel = asyncio.get_running_loop().create_task(self._cancel_stragglers())
        raise _Shutdown

    def _spawn(self, tg: asyncio.TaskGroup, coro: Coroutine[Any, Any, None]) -> None:
        task = tg.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cancel_stragglers(self) -> None:
        """Cancel the agent's tasks again while any is left after the TaskGroup's cancel.

        On Python 3.11 `asyncio.wait_for` can swallow a cancellation that arrives together
        with the reply it awaited (fixed in 3.12); a loop that lost its one cancel kept the
        agent from ever stopping (seen: fast resume went on to wait for the link to drop).
        """
        while self._tasks:
            await asyncio.sleep(_STRAGGLER_GRACE_S)
            log.warning("shutdown_cancelled_again", tasks=len(self._tasks))
            for task in self._tasks:
                task.cancel()

    async def _serve(self, tg: asyncio.TaskGroup) -> None:
        await self.island.up.wait()
        self._nc = await connect_island(self.config)
        js = self._nc.jetstream()
        assert self._db is not None and self.outbox is not None
        self.drainer = Drainer(self.outbox, js)
        ledger = Ledger(self._db, self.outbox, self.config.device_id)
        fence = CommandFence(self._db, self.config.device_id)
        executor = Executor(
            self.config,
            ledger,
            self.handlers,
            js,
            fence=fence,
            clock=self.clock,
            on_restart=self._restart,
        )
        self.executor = executor
        hub_js = self._nc.jetstream(domain=self.config.hub.domain, timeout=2.0)
        if not await fence.load():
            self._spawn(tg, self._after_ready(lambda: self._learn_fence(fence, js, hub_js)))
        self._spawn(tg, self._reconcile_loop(tg, self._nc, hub_js))
        self._spawn(tg, self._every(self.config.agent.link_poll_interval, self._poll_link))
        self._spawn(tg, self.drainer.run())
        self._spawn(tg, self._every(self.config.agent.heartbeat_interval, self._heartbeat))
        self._spawn(tg, self._sync_clock(self._nc))
        self._spawn(tg, self._after_ready(executor.run))
        if self.config.commands.fast_resume:
            # Its reads of the origin wait longer, asked again meanwhile (`resume`).
            reads = self._nc.jetstream(domain=self.config.hub.domain, timeout=READ_TIMEOUT_S)
            resume = self._resume = FastResume(
                self.config, js, hub_js, self.link, executor, reads=reads
            )
            self._spawn(tg, self._after_ready(lambda: resume.run(island_was_fresh=self._fresh())))
        if self.config.update.enabled:
            updater = Updater(self.config, self._nc, self.link, self.outbox)
            self._spawn(tg, self._after_ready(updater.run))
        if self.notifier.watchdog_interval is not None:
            self._spawn(tg, self._watchdog(self.notifier.watchdog_interval))

    async def _poll_link(self) -> None:
        await self.link.poll()
        await self.compression.step()

    async def _after_ready(self, step: Callable[[], Awaitable[None]]) -> None:
        await self.ready.wait()
        await step()

    def _fresh(self) -> bool:
        assert self._island_was_fresh is not None  # set by the reconcile before `ready`
        return self._island_was_fresh

    async def _learn_fence(
        self, fence: CommandFence, js: JetStreamContext, hub_js: JetStreamContext
    ) -> None:
        await fence.learn(js, hub_js, self.link, self._fresh())

    async def _restart(self) -> None:
        """``agent.restart``: exit (code 75) so that systemd starts the agent again."""
        log.info("agent_restart_requested", device_id=self.config.device_id)
        self.restart_requested = True
        self.shutdown.set()

    async def _reconcile_loop(
        self, tg: asyncio.TaskGroup, nc: Client, hub_js: JetStreamContext
    ) -> None:
        js = nc.jetstream()
        while True:
            await self._reconcile_needed.wait()
            self._reconcile_needed.clear()
            retrying = AsyncRetrying(
                retry=retry_if_exception_type(
                    (APIError, nats.errors.Error, OSError, TimeoutError, StoreTrouble)
                ),
                wait=wait_exponential_jitter(multiplier=0.2, jitter=0.2, max=10.0),
                before_sleep=lambda state: log.warning(
                    "island_streams_retry",
                    error=repr(state.outcome.exception()) if state.outcome else None,
                ),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    await self.island.up.wait()
                    consumer = await consumer_to_bind(js, hub_js, self.config)
                    results = await reconcile(js, self.config, consumer)
            if self._island_was_fresh is None:
                self._island_was_fresh = any(
                    r.name == EVENTS and r.change == "created" for r in results
                )
                unpacked: tuple[str, ...] = OUTBOUND
                rtt = LeafRtt(self.island.monitor)
                if any(r.name == READINGS for r in results):  # telemetry crosses in packs
                    self.packer = Packer(nc, self.config.island.max_payload, rtt)
                    self._spawn(tg, self.packer.run())
                    unpacked = tuple(s for s in OUTBOUND if s != TELEMETRY)
                windows = Windows(nc, rtt, self.config, unpacked)
                self._spawn(tg, windows.run())
                self._spawn(tg, Unstaller(nc, self.config, self.link).run())
            if not self.ready.is_set():
                self.notifier.ready()
                running = {"version": __version__, "pid": os.getpid(), "ready_at": utc_now_iso()}
                write_json(running_file(self.config.agent.state_dir), running, durable=False)
            self.ready.set()
            log.info("agent_ready", device_id=self.config.device_id)

    @staticmethod
    async def _every(interval: float, step: Callable[[], Awaitable[Any]]) -> None:
        while True:
            await step()
            await asyncio.sleep(interval)

    async def _heartbeat(self) -> None:
        await self.ready.wait()
        assert self.outbox is not None
        status = await collect_status(self.config, self.island.monitor)
        status, self._last_status = with_drain_rates(status, self._last_status), status
        if (metrics := self.config.agent.metrics_file) is not None:
            resume = self._resume.figures if self._resume else None
            try:
                await asyncio.to_thread(write_textfile, metrics, status, resume)
            except OSError as exc:
                log.warning("metrics_not_written", path=str(metrics), error=str(exc))
        subject = f"evt.{self.config.device_id}.heartbeat"
        try:
            packer = asdict(self.packer.stats) if self.packer else None
            payload = heartbeat_payload(status, self._started, packer)
            await self.outbox.append(subject, payload, kind="heartbeat")
        except (OutboxError, StateDBError) as exc:  # the next heartbeat tries again
            log.warning("heartbeat_not_queued", error=str(exc))
            return
        log.info("heartbeat_queued", healthy=status.healthy, link_up=status.link.up)

    async def _sync_clock(self, nc: Client) -> None:
        """Learn the hub's time whenever the link comes up, and every minute while it is."""
        subject = (
            f"{self.config.hub.api_prefix}.STREAM.INFO.{command_stream(self.config.device_id)}"
        )
        while True:
            await self.link.is_up.wait()
            try:
                await self.clock.sync(nc, subject)
            except (nats.errors.Error, TimeoutError, ValueError) as exc:
                log.debug("clock_sync_failed", error=repr(exc))
                await asyncio.sleep(1.0)
                continue
            await asyncio.to_thread(write_clock, self.config, self.clock.offset_s)
            log.info("clock_synced", offset_s=self.clock.offset_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.link.is_down.wait(), CLOCK_SYNC_S)

    async def _watchdog(self, interval: float) -> None:
        """``WATCHDOG=1`` only while a real check passes; systemd restarts a hung agent."""
        await self.ready.wait()
        while True:
            healthy = await self._healthy()
            if self.shutdown.is_set():
                return  # STOPPING=1 is the last word; the stop timeout governs from here
            if healthy:
                self.notifier.watchdog()
            else:
                log.warning("watchdog_withheld", device_id=self.config.device_id)
            await asyncio.sleep(interval)

    async def _healthy(self) -> bool:
        assert self.outbox is not None
        try:
            await asyncio.wait_for(self.outbox.stats(), 5.0)
        except (StateDBError, TimeoutError):
            return False
        # A dead child island is ours to restart; restarting the agent would not help.
        return self.island.child_mode or await self.island.monitor.healthy()

    async def _close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(nats.errors.Error, TimeoutError, OSError):
                await self._nc.drain()
        await self.island.stop()
        if self._db is not None:
            await self._db.close()
