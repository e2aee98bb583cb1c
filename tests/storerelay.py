"""A relay between a router and its Redis on loopback, to play a partition or a late reply."""

from __future__ import annotations

import asyncio
import contextlib


class PartitionRelay:
    """A TCP relay from a loopback port to Redis; partitioned, it holds every byte either way, and
    holding replies only, it passes the commands on and holds what Redis answers (a reply that comes
    too late)."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._passing = asyncio.Event()
        self._passing.set()
        self._replies = asyncio.Event()
        self._replies.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def partition(self) -> None:
        self._passing.clear()

    def hold_replies(self) -> None:
        self._replies.clear()

    def heal(self) -> None:
        self._passing.set()
        self._replies.set()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        for source, sink, gate in ((reader, up_writer, self._passing), (up_reader, writer, self._replies)):
            task = asyncio.get_running_loop().create_task(self._pipe(source, sink, gate))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, gate: asyncio.Event
    ) -> None:
        try:
            while data := await source.read(65536):
                await self._passing.wait()
                await gate.wait()
                sink.write(data)
                await sink.drain()
        finally:
            sink.close()
