"""A TCP proxy on loopback that tests cut, delay and restore: the flaky link of the bench."""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType


class TcpProxy:
    """Forwards 127.0.0.1:`port` to `target_port`.

    `cut()` closes every connection and refuses new ones (they are accepted and closed at
    once, as a dead LTE link looks to a client); `restore()` lets them through again;
    `delay` adds latency to every chunk in both directions.
    """

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.delay = 0.0
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

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._drop_all()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> TcpProxy:
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
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ]
        self._pipes.update(pipes)
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for task in pipes:
            task.cancel()
            self._pipes.discard(task)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if self.delay:
                    await asyncio.sleep(self.delay)  # simulated latency, not synchronisation
                writer.write(data)
                await writer.drain()
