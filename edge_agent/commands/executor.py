"""The command executor: a durable pull consumer on the island's ``COMMANDS`` mirror.

For each message, in order and one at a time:

1. find its ledger key (the envelope ``id``, else the ``Nats-Msg-Id`` header, else
   ``@seq:<n>``) and skip it if the ledger has it: redeliveries, the fast-resume path
   (`edge_agent.commands.resume`) and the mirror all hand in the same commands;
2. validate the envelope ``{id, type, args, issued_at, expires_at}``; an expired command
   gets an ``expired`` result, a malformed, oversized, unknown-type or wrong-device one a
   ``rejected`` result naming the field;
3. otherwise claim it in the ledger, run its handler with the timeout, and record the result
   (ledger row + outbox row, one transaction);
4. ack. A crash before the ack only causes a redelivery, which step 1 drops.

Nothing a message contains can stop the loop: every message ends in a result and an ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_exponential_jitter,
)

from edge_agent.commands.fence import CommandFence
from edge_agent.commands.handlers import Handler, HandlerContext
from edge_agent.commands.hubclock import HubClock
from edge_agent.commands.ledger import Ledger
from edge_agent.commands.parse import (
    Command,
    Incoming,
    check_fence,
    command_id,
    parse_command,
    subject_type,
)
from edge_agent.core.config import Config
from edge_agent.core.errors import CommandFailed, CommandRefused
from edge_agent.protocol.envelope import Result, ResultStatus
from edge_agent.protocol.names import COMMAND_MIRROR
from edge_agent.protocol.units import utc_now_iso

log = structlog.get_logger(__name__)

CONSUMER = "edge-agent"
# After this many deliveries that the agent itself could not process (not the command's
# fault: e.g. a full disk), the message is answered with an error and acked, not retried.
MAX_DELIVERIES = 5
CANCEL_WAIT_S = 5.0  # for a cancelled handler to wind up, at shutdown
_TRANSIENT = (nats.errors.Error, APIError, OSError)


class Executor:
    """Runs commands one at a time, from the mirror consumer and from `FastResume`."""

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        handlers: Mapping[str, Handler],
        js: JetStreamContext,
        *,
        fence: CommandFence,
        clock: HubClock,
        on_restart: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._config = config
        self._ledger = ledger
        self._fence = fence
        self._clock = clock
        self._handlers = handlers
        self._js = js
        self._on_restart = on_restart
        self._restart_requested = False
        self._lock = asyncio.Lock()
        self._stopping = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._handler_task: asyncio.Task[Any] | None = None
        self._mirror_remade = False  # its consumer on the mirror went with the mirror

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def fence(self) -> int:
        """This incarnation's command fence, once known (see `edge_agent.commands.fence`)."""
        await self._fence.known.wait()
        return self._fence.value

    async def recover(self) -> None:
        """Answer commands a crash interrupted; they are not run a second time."""
        async with self._lock:
            for entry in await self._ledger.unfinished():
                now = utc_now_iso()
                result = Result(
                    command_id=None if entry.key.startswith("@") else entry.key,
                    device_id=self._config.device_id,
                    status="error",
                    output=None,
                    error="interrupted: the agent stopped while the command was running; "
                    "it is not run again",
                    started_at=entry.received_at,
                    finished_at=now,
                    type=entry.type,
                    seq=entry.seq,
                )
                await self._ledger.finish(entry.key, entry.seq, result, entry.received_at)
                log.warning("command_interrupted", key=entry.key, seq=entry.seq, type=entry.type)

    def mirror_remade(self) -> None:
        """The mirror was deleted and made again (`edge_agent.commands.origin`): the consumer
        on it is made again, as expected, until that works."""
        self._mirror_remade = True

    async def run(self) -> None:
        """Consume the mirror until `stop()`; transient errors are retried with backoff."""
        await self.recover()
        await self._fence.known.wait()
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(_TRANSIENT),
            wait=wait_exponential_jitter(multiplier=0.2, max=2.0, jitter=0.2),
            before_sleep=self._retrying,
        )
        async for attempt in retrying:
            with attempt:
                await self._consume()

    def _retrying(self, state: RetryCallState) -> None:
        error = repr(state.outcome.exception()) if state.outcome else None
        if self._mirror_remade:
            log.info("command_consumer_remade", error=error)
        else:
            log.warning("command_consumer_retry", error=error)

    async def _consume(self) -> None:
        await self._js.add_consumer(
            COMMAND_MIRROR,
            ConsumerConfig(
                durable_name=CONSUMER,
                deliver_policy=DeliverPolicy.ALL,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self._config.commands.handler_timeout + 30.0,
                max_deliver=-1,
            ),
        )
        self._mirror_remade = False
        sub = await self._js.pull_subscribe_bind(CONSUMER, stream=COMMAND_MIRROR)
        try:
            while not self._stopping:
                try:
                    msgs = await sub.fetch(1, timeout=1.0)
                except TimeoutError:
                    continue  # nothing new
                for msg in msgs:
                    await self._handle(msg)
        finally:
            with contextlib.suppress(*_TRANSIENT):
                await sub.unsubscribe()

    async def _handle(self, msg: Msg) -> None:
        meta = msg.metadata
        item = Incoming(
            meta.sequence.stream,
            msg.subject,
            msg.data,
            msg.headers or {},
            "mirror",
            meta.timestamp,
        )
        async with self._working():
            try:
                done = await self.process(item)
            except Exception as exc:  # the agent's own failure (disk, database): retry a bit
                log.error("command_not_processed", seq=item.seq, error=repr(exc))
                if meta.num_delivered < MAX_DELIVERIES:
                    await msg.nak(delay=min(2.0**meta.num_delivered, 30.0))
                    return
                done = await self._give_up(item, exc)
            if done:
                with contextlib.suppress(*_TRANSIENT, TimeoutError):
                    await msg.ack()  # if lost, the redelivery finds the ledger row
        await self._maybe_restart()

    async def _give_up(self, item: Incoming, exc: Exception) -> bool:
        cid = command_id(item, self._config.commands.max_payload)
        key = cid or f"@seq:{item.seq}"
        now = utc_now_iso()
        result = self._result(
            item,
            cid,
            subject_type(item),
            status="error",
            error=f"not processed: {exc!r}",
            started_at=now,
        )
        try:
            await self._ledger.finish(key, item.seq, result, now)
        except Exception as again:  # the same trouble: the message is redelivered later
            log.error("command_not_answered", seq=item.seq, error=repr(again))
            return False
        return True

    async def process(self, item: Incoming) -> bool:
        """Handle one command message; False when stopping (it stays for the next run)."""
        await self._fence.known.wait()
        async with self._lock, self._working():
            if self._stopping:
                return False
            max_payload = self._config.commands.max_payload
            cid = command_id(item, max_payload)
            key = cid or f"@seq:{item.seq}"
            if await self._ledger.seen(key):
                log.debug("command_duplicate", key=key, seq=item.seq, via=item.via)
                return True
            received = utc_now_iso()
            if item.stored_at is not None:
                self._clock.saw(item.stored_at)
            now = self._clock.now()
            try:
                check_fence(item, self._fence.value)
                command = parse_command(
                    item, self._config.device_id, max_payload, self._handlers, now
                )
            except CommandRefused as refusal:
                result = self._result(
                    item,
                    cid,
                    subject_type(item),
                    status=refusal.status,
                    error=str(refusal),
                    started_at=received,
                )
                await self._ledger.finish(key, item.seq, result, received)
                log.warning(
                    "command_refused",
                    key=key,
                    seq=item.seq,
                    status=refusal.status,
                    reason=str(refusal),
                    via=item.via,
                )
                return True
            await self._ledger.start(key, item.seq, command.type, received)
            started = time.monotonic()
            result = await self._execute(command, item, received)
            await self._ledger.finish(key, item.seq, result, received)
            log.info(
                "command_executed",
                command_id=command.id,
                type=command.type,
                seq=item.seq,
                status=result.status,
                via=item.via,
                duration_s=round(time.monotonic() - started, 3),
            )
        if item.via == "hub":
            await self._maybe_restart()
        return True

    def _result(
        self,
        item: Incoming,
        cid: str | None,
        type_: str | None,
        *,
        status: ResultStatus,
        started_at: str,
        output: Any = None,
        error: str | None = None,
    ) -> Result:
        return Result(
            command_id=cid,
            device_id=self._config.device_id,
            status=status,
            output=output,
            error=error,
            started_at=started_at,
            finished_at=utc_now_iso(),
            type=type_,
            seq=item.seq,
        )

    async def _execute(self, command: Command, item: Incoming, started_at: str) -> Result:
        timeout = self._config.commands.handler_timeout
        ctx = HandlerContext(self._config, command.id, self._request_restart)
        handler = self._handlers[command.type]
        task = asyncio.create_task(asyncio.wait_for(handler(ctx, command.args), timeout))
        self._handler_task = task
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self._handler_task = None
        status: ResultStatus = "ok"
        output: Any = None
        error: str | None = None
        if task.cancelled():
            status, error = "error", "cancelled: the agent stopped before the handler finished"
        elif isinstance(exc := task.exception(), TimeoutError):
            status, error = "error", f"timed out after {timeout:g}s"
        elif isinstance(exc, CommandRefused):
            status, error = exc.status, str(exc)
        elif isinstance(exc, CommandFailed):
            status, output, error = "error", exc.output, str(exc)
        elif exc is not None:
            status, error = "error", f"{type(exc).__name__}: {exc}"
        else:
            output = task.result()
        return self._result(
            item,
            command.id,
            command.type,
            status=status,
            output=output,
            error=error,
            started_at=started_at,
        )

    def _request_restart(self) -> None:
        self._restart_requested = True

    async def _maybe_restart(self) -> None:
        if self._restart_requested and self._on_restart is not None:
            self._restart_requested = False
            await self._on_restart()

    @contextlib.asynccontextmanager
    async def _working(self) -> AsyncIterator[None]:
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def stop(self, grace: float) -> None:
        """Take no new command; let the running one finish within `grace`, then cancel it."""
        self._stopping = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            if self._handler_task is not None:
                log.warning("command_cancelled_at_shutdown", grace_s=grace)
                self._handler_task.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), CANCEL_WAIT_S)
