"""The wake-up rule shared by every FIFO of waiting requests (capacity queue, connection pools).

A waiter that gave up (timed out or was cancelled) stays in its queue as a done future; waking must skip
it, or one wake-up is lost and a request behind it waits for nothing.
"""

from __future__ import annotations

import asyncio
from collections import deque


def wake_first(waiters: deque[asyncio.Future[None]]) -> bool:
    """Wake the first waiter still waiting (the others before it gave up); whether there was one."""
    while waiters:
        fut = waiters.popleft()
        if not fut.done():
            fut.set_result(None)
            return True
    return False
