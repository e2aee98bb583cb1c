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
from storerelay import PartitionRelay


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
