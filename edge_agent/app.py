"""Wiring of the agent daemon (``edge-agent run``).

One `asyncio.TaskGroup` holds the island supervisor, the stream reconciler, the link watcher
and the heartbeat. Signal handlers only set the shutdown event (see `cli`); tests pass their
own event. Shutdown order:

1. stop the loops (no new heartbeats, no new link polls);
2. drain the NATS connection, so every publish already handed to it is flushed;
3. stop the island, in child mode only: in external mode it keeps serving local producers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from edge_agent.config import Config
from edge_agent.health import LinkTracker, collect_status, heartbeat_payload
from edge_agent.island import Island
from edge_agent.streams import reconcile

log = structlog.get_logger(__name__)


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
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )


class Agent:
    """The device daemon. `run()` returns after `shutdown` is set and everything is closed."""

    def __init__(self, config: Config, shutdown: asyncio.Event | None = None) -> None:
        self.config = config
        self.shutdown = shutdown or asyncio.Event()
        self.island = Island(config, on_up=self._island_came_up)
        self.link = LinkTracker(config, self.island.monitor)
        self.ready = asyncio.Event()
        self._reconcile_needed = asyncio.Event()
        self._nc: Client | None = None
        self._started = time.monotonic()

    async def _island_came_up(self) -> None:
        self._reconcile_needed.set()

    async def run(self) -> None:
        log.info(
            "agent_starting", device_id=self.config.device_id, mode=self.config.island.supervise
        )
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.island.run())
                tg.create_task(self._serve(tg))
                tg.create_task(self._wait_for_shutdown())
        except* _Shutdown:
            pass
        finally:
            await self._close()
        log.info("agent_stopped", device_id=self.config.device_id)

    async def _wait_for_shutdown(self) -> None:
        await self.shutdown.wait()
        log.info("agent_stopping", device_id=self.config.device_id)
        raise _Shutdown

    async def _serve(self, tg: asyncio.TaskGroup) -> None:
        await self.island.up.wait()
        self._nc = await connect_island(self.config)
        js = self._nc.jetstream()
        tg.create_task(self._reconcile_loop(js))
        tg.create_task(self._every(self.config.agent.link_poll_interval, self.link.poll))
        tg.create_task(
            self._every(self.config.agent.heartbeat_interval, lambda: self._heartbeat(js))
        )

    async def _reconcile_loop(self, js: JetStreamContext) -> None:
        while True:
            await self._reconcile_needed.wait()
            self._reconcile_needed.clear()
            retrying = AsyncRetrying(
                retry=retry_if_exception_type((APIError, nats.errors.Error, OSError, TimeoutError)),
                wait=wait_exponential_jitter(multiplier=0.2, jitter=0.2, max=10.0),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    await self.island.up.wait()
                    await reconcile(js, self.config)
            self.ready.set()
            log.info("agent_ready", device_id=self.config.device_id)

    @staticmethod
    async def _every(interval: float, step: Callable[[], Awaitable[Any]]) -> None:
        while True:
            await step()
            await asyncio.sleep(interval)

    async def _heartbeat(self, js: JetStreamContext) -> None:
        await self.ready.wait()
        status = await collect_status(self.config, self.island.monitor)
        subject = f"evt.{self.config.device_id}.heartbeat"
        try:
            await js.publish(subject, heartbeat_payload(status, self._started), timeout=2.0)
        except (nats.errors.Error, APIError, TimeoutError) as exc:
            log.warning("heartbeat_not_stored", error=str(exc) or type(exc).__name__)
            return
        log.info("heartbeat_sent", healthy=status.healthy, link_up=status.link.up)

    async def _close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(nats.errors.Error, TimeoutError, OSError):
                await self._nc.drain()
        await self.island.stop()
