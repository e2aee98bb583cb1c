"""A probe or side fetch given up on (timed out, or its caller cancelled at shutdown) never leaves its
failure for asyncio to log as "Task exception was never retrieved": that line, with a traceback, is
what an operator saw on stderr after Ctrl-C on a router whose backend refused connections."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from prefix_router.errors import ConnectFailed
from prefix_router.upstream.client import wait_for_awake


def unretrieved(loop: asyncio.AbstractEventLoop) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    return seen


async def test_a_failure_that_lands_as_the_caller_is_cancelled_is_taken() -> None:
    loop = asyncio.get_running_loop()
    seen = unretrieved(loop)
    fetch: asyncio.Future[int] = loop.create_future()
    waiting = asyncio.ensure_future(wait_for_awake(fetch, 10.0))
    await asyncio.sleep(0)  # the caller is now waiting on the fetch
    fetch.set_exception(ConnectFailed("connect failed: ConnectionRefusedError"))
    waiting.cancel()  # shutdown cancels the caller in the same turn the fetch fails
    with pytest.raises(asyncio.CancelledError):
        await waiting
    del fetch, waiting
    gc.collect()
    await asyncio.sleep(0)
    assert seen == []


async def test_a_fetch_that_fails_while_being_cancelled_is_taken() -> None:
    loop = asyncio.get_running_loop()
    seen = unretrieved(loop)

    async def connect_that_fails_on_cancel() -> int:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ConnectFailed("connect failed: ConnectionRefusedError") from None
        return 0

    fetch = asyncio.ensure_future(connect_that_fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        await wait_for_awake(fetch, 0.05)
    await asyncio.sleep(0)
    assert fetch.done() and not fetch.cancelled()  # it ended with its own error, not a cancel
    del fetch
    gc.collect()
    await asyncio.sleep(0)
    assert seen == []


async def test_a_fetch_that_answers_in_time_gives_its_answer() -> None:
    async def answer() -> int:
        await asyncio.sleep(0.01)
        return 200

    assert await wait_for_awake(asyncio.ensure_future(answer()), 5.0) == 200


async def test_a_fetch_that_fails_in_time_raises_its_own_error() -> None:
    async def refused() -> int:
        raise ConnectFailed("connect failed: ConnectionRefusedError")

    with pytest.raises(ConnectFailed):
        await wait_for_awake(asyncio.ensure_future(refused()), 5.0)
