"""Requests that wait before they are sent: for capacity, or for another request's prefill.

Both waits are bounded in time (and the capacity queue in length), and both wake on events the
relay raises: a released lease, a new load scrape, a prefill's first byte.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from prefix_router.waiters import wake_first


class CapacityWaiters:
    """A bounded FIFO of requests waiting for any backend to drop below max_inflight."""

    __slots__ = ("_max", "_waiters")

    def __init__(self, max_waiting: int) -> None:
        self._max = max_waiting
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, timeout_s: float) -> bool:
        """Wait for a release; False at once when the queue is full, or after the timeout."""
        if len(self._waiters) >= self._max or timeout_s <= 0:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(timeout_s):
                await fut
            return True
        except TimeoutError:
            return False
        finally:
            if not fut.done():
                fut.cancel()
            with contextlib.suppress(ValueError):  # wake_one() already took it
                self._waiters.remove(fut)

    def wake_all(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    def wake_one(self) -> None:
        wake_first(self._waiters)


class PrefillEvents:
    """One event per open prefill ticket (routing/prefill.py), set at the prefill's first byte."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: dict[int, asyncio.Event] = {}

    def open(self, ticket: int) -> None:
        self._events[ticket] = asyncio.Event()

    def close(self, ticket: int) -> bool:
        """Wake the waiters; False if the ticket was already closed."""
        event = self._events.pop(ticket, None)
        if event is None:
            return False
        event.set()
        return True

    async def wait(self, ticket: int, timeout_s: float) -> str | None:
        """'ready' or 'timeout'; None when the ticket is already closed (nothing to wait for)."""
        event = self._events.get(ticket)
        if event is None:
            return None
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            return "timeout"
        return "ready"
