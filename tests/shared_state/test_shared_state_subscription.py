"""The `prefilled` subscription on a connection that dies without a word: a partition between the
router and Redis, played by a relay on loopback that stops passing bytes and keeps its connections
open. The subscription is pinged while quiet, found lost, and the requests held for another
replica's prefill are let go at once rather than after prefill_wait_s."""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry

from prefix_router.fleet.shared_state import SharedPlacement

from redisserver import RedisServer
from routerkit import eventually


class PartitionRelay:
    """A TCP relay from a loopback port to Redis; partitioned, it holds every byte either way."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._passing = asyncio.Event()
        self._passing.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def partition(self) -> None:
        self._passing.clear()

    def heal(self) -> None:
        self._passing.set()

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
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pipe(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                await self._passing.wait()
                sink.write(data)
                await sink.drain()
        finally:
            sink.close()


async def test_a_subscription_gone_quiet_without_a_word_is_found_lost_and_lets_its_waiters_go(
    redis_server: RedisServer,
) -> None:
    relay = PartitionRelay(redis_server.port)
    await relay.start()
    shared = SharedPlacement(
        f"redis://127.0.0.1:{relay.port}/0",
        2.0,
        CollectorRegistry(),
        prefill_wait_s=30.0,
        reconnect_interval_s=0.1,
        subscription_ping_s=0.2,
    )
    task = asyncio.get_running_loop().create_task(shared.run())
    try:
        await eventually(lambda: shared.can_wait)
        relay.partition()
        waiting = asyncio.create_task(shared.wait_prefilled("another-replica:1", 30.0))
        # Nobody could say when that prefill ends: let go well before prefill_wait_s.
        assert await asyncio.wait_for(waiting, timeout=10.0) is None
        assert not shared.can_wait
        relay.heal()
        await eventually(lambda: shared.can_wait, timeout_s=10.0)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await shared.close()
        await relay.stop()
