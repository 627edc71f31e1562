"""A device's link to the hub on one machine: a TCP proxy on loopback that can be cut,
slowed and restored. The local fleet (`hub_ingest.local.fleet`) and the test bench put one
between each device and the hub to play a flaky cellular link.

Run alone, ``python -m hub_ingest.local.link --listen PORT --target PORT`` forwards until
SIGTERM; SIGUSR1 cuts the link and SIGUSR2 restores it (a kept demo fleet outlives its
launcher this way).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import time
from dataclasses import dataclass
from types import TracebackType

SEGMENT = 1448  # bytes of payload in one TCP segment on a 1500-byte MTU
QUEUE_S = 0.25  # the bottleneck's buffer: reading stops while this much is waiting to send


@dataclass(frozen=True, slots=True)
class Shape:
    """What the link is like, each way: round trip, bandwidth and segment loss.

    A lost segment is resent one retransmission timeout later and holds up everything behind
    it, as TCP delivers in order: the effect packet loss has on a TCP stream.
    """

    rtt: float = 0.0  # seconds
    rate: float = 0.0  # bytes per second each way; 0: unlimited
    loss: float = 0.0  # chance that a segment is lost once
    seed: int = 0

    @property
    def rto(self) -> float:
        return max(0.2, 2 * self.rtt)  # Linux's minimum RTO is 200 ms


class LinkProxy:
    """Forwards 127.0.0.1:`port` to `target_port`.

    `cut()` closes every connection and refuses new ones (they are accepted and closed at
    once, as a dead LTE link looks to a client); `restore()` lets them through again;
    `shape` makes it slow and lossy. `bytes_up` / `bytes_down` count what crossed toward the
    target and back.
    """

    def __init__(
        self, target_port: int, target_host: str = "127.0.0.1", shape: Shape | None = None
    ) -> None:
        self.target = (target_host, target_port)
        self.shape = shape or Shape()
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self._cut = False
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "proxy not started"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def is_cut(self) -> bool:
        return self._cut

    async def start(self, port: int = 0) -> LinkProxy:
        """Listen on `port`. Beside servers whose ports are picked ahead (`free_port`), pick
        this one the same way: a port the kernel hands out (0) may be one picked for a server
        that has not bound it yet, which then never starts."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._drop_all()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> LinkProxy:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def cut(self) -> None:
        self._cut = True
        self._drop_all()

    def restore(self) -> None:
        self._cut = False

    def _drop_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers.update((writer, up_writer))
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer, up=True)),
            asyncio.create_task(self._pipe(up_reader, writer, up=False)),
        ]
        self._pipes.update(pipes)
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for task in pipes:
            task.cancel()
            self._pipes.discard(task)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.transport.abort()

    def _count(self, up: bool, n: int) -> None:
        if up:
            self.bytes_up += n
        else:
            self.bytes_down += n

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            if self.shape == Shape():
                while data := await reader.read(65536):
                    self._count(up, len(data))
                    writer.write(data)
                    await writer.drain()
            else:
                await self._shaped_pipe(reader, writer, up)

    async def _shaped_pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool
    ) -> None:
        """Segments leave at `rate`, arrive half a round trip later, in order; a lost one
        arrives an RTO late. The sleeps here are the simulated link, not synchronisation."""
        shape = self.shape
        rng = random.Random(shape.seed ^ up)
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sent = arrive = time.monotonic()  # when the link is free / the last segment lands

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, segment = item
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                self._count(up, len(segment))
                writer.write(segment)
                await writer.drain()

        delivery = asyncio.create_task(deliver())
        try:
            while data := await reader.read(SEGMENT * 16):
                for i in range(0, len(data), SEGMENT):
                    segment = data[i : i + SEGMENT]
                    now = time.monotonic()
                    sent = max(sent, now) + (len(segment) / shape.rate if shape.rate else 0.0)
                    lost = shape.loss and rng.random() < shape.loss
                    arrive = max(arrive, sent + shape.rtt / 2 + (shape.rto if lost else 0.0))
                    queue.put_nowait((arrive, segment))
                await asyncio.sleep(max(0.0, sent - time.monotonic() - QUEUE_S))
            queue.put_nowait(None)
            await delivery
        finally:
            delivery.cancel()


async def _serve(listen: int, target: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    proxy = await LinkProxy(target).start(listen)
    loop.add_signal_handler(signal.SIGUSR1, proxy.cut)
    loop.add_signal_handler(signal.SIGUSR2, proxy.restore)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        await stop.wait()
    finally:
        await proxy.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hub_ingest.local.link", description=__doc__)
    parser.add_argument("--listen", type=int, required=True, help="loopback port to listen on")
    parser.add_argument("--target", type=int, required=True, help="loopback port to forward to")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.listen, args.target))


if __name__ == "__main__":
    main()
