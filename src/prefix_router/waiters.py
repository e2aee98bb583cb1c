"""The wake-up rule shared by every FIFO of waiting requests (capacity queue, connection pools).

A waiter that gave up (timed out or was cancelled) stays in its queue as a done future; waking must skip
it, or one wake-up is lost and a request behind it waits for nothing.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
K = TypeVar("K")


def wake_first(waiters: deque[asyncio.Future[None]]) -> bool:
    """Wake the first waiter still waiting (the others before it gave up); whether there was one."""
    while waiters:
        fut = waiters.popleft()
        if not fut.done():
            fut.set_result(None)
            return True
    return False


def wake_first_taker(
    waiters: deque[tuple[asyncio.Future[T], K]], takes: Callable[[K], bool], result: T
) -> bool:
    """Wake, with `result`, the first waiter still waiting whose wish (`K`: what it waits for) `takes`
    accepts; the ones that gave up are dropped on the way. Whether there was one."""
    i = 0
    while i < len(waiters):
        fut, wish = waiters[i]
        if fut.done():
            del waiters[i]
            continue
        if takes(wish):
            del waiters[i]
            fut.set_result(result)
            return True
        i += 1
    return False
