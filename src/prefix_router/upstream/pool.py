"""Kept-alive connections to backends: one pool per origin, under one process-wide connection budget.

The wake-up rule, all of it. Requests wait in two lines:
- `Pool.waiters`: requests for this origin, waiting because the pool has `limit` connections open;
- `ConnectionBudget.waiters`: requests below their own pool's limit, waiting because the budget's `limit`
  connections are open over all pools and none of them is idle in a pool nobody waits on.

A wake-up is a hint, never a hand-over: the woken request runs `Pool.acquire` again from the top. If
another request got there first, it goes back to the front of the line it now belongs to, so being
woken never costs a request its place. What frees something wakes exactly this:

1. A connection is released reusable and parks idle (`Pool.release` → `Pool._offer`): this pool's first
   waiter, who takes it; if nobody waits here, the budget's first waiter, who closes it to make room for
   its own origin (cross-pool eviction: `ConnectionBudget.has_room` closes the longest-idle connection of
   any pool nobody waits on).
2. A connection closes (`Connection.close` → `Pool.forget`): this pool's first waiter (a slot of the pool
   is free) and, if it counted against the budget, the budget's first waiter (a slot of the budget is
   free). A connection the budget closed to make room wakes nobody for that room: it is the caller's.
3. A request woken and then cancelled before it ran hands its wake-up on, so none is lost with it: one
   woken from the pool's line as in (1), one woken from the budget's line to the budget's next waiter.
   A request cancelled while still waiting was never woken: it leaves a done future in its line, which
   waking skips (`waiters.wake_first`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from dataclasses import dataclass, field
from typing import Any

from prefix_router.errors import ConnectFailed
from prefix_router.upstream.http1 import Connection, Origin, State
from prefix_router.waiters import wake_first

# After a connect's deadline: a timer this short still fires only after the loop has polled its sockets
# once more, so a handshake that finished during a stall is seen before the connect is failed.
CONNECT_GRACE_S = 0.01


def abandon(task: asyncio.Future[Any]) -> None:
    """Give up on `task`: cancel it if it still runs, and take its outcome whenever it comes. A task
    given up on in the turn it failed (a connect refused as shutdown cancels the caller) would
    otherwise have its error logged by asyncio, with a traceback, as never retrieved."""
    if task.done():
        _take_outcome(task)
    else:
        task.cancel()
        task.add_done_callback(_take_outcome)


def _take_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


@dataclass(slots=True)
class ConnectionBudget:
    """The process-wide bound on open upstream connections (upstream.max_connections), over all pools."""

    limit: int
    pools: list[Pool] = field(default_factory=list)
    waiters: collections.deque[asyncio.Future[None]] = field(default_factory=collections.deque)
    counted: set[Connection] = field(default_factory=set)  # open and counted against the limit

    @property
    def open(self) -> int:
        return len(self.counted)

    def has_room(self) -> bool:
        """Room for one more connection, closing the longest-idle one of any pool if need be."""
        if len(self.counted) < self.limit:
            return True
        # Not from a pool someone waits on: its idle connection is theirs.
        holders = [p for p in self.pools if p.idle and not p.has_waiters()]
        if holders:
            conn = min(holders, key=lambda p: p.idle[0].idle_since).idle.popleft()
            self.counted.discard(conn)  # the room is the caller's: its close wakes nobody for it (rule 2)
            conn.close()
        return len(self.counted) < self.limit

    def opened(self, conn: Connection) -> None:
        self.counted.add(conn)

    def closed(self, conn: Connection) -> None:
        if conn in self.counted:
            self.counted.remove(conn)
            self.wake_one()

    def wake_one(self) -> None:
        wake_first(self.waiters)


@dataclass(slots=True)
class Pool:
    """Kept-alive connections to one origin; at most `limit` open at once."""

    origin: Origin
    loop: asyncio.AbstractEventLoop
    limit: int
    keepalive_s: float
    connect_timeout_s: float
    ssl_context: ssl.SSLContext | None
    budget: ConnectionBudget
    idle: collections.deque[Connection] = field(default_factory=collections.deque)
    busy: set[Connection] = field(default_factory=set)
    waiters: collections.deque[asyncio.Future[None]] = field(default_factory=collections.deque)
    retired: bool = False  # its backend left the fleet: connections close when their request ends
    _sweep: asyncio.TimerHandle | None = None

    @property
    def open(self) -> int:
        return len(self.idle) + len(self.busy)

    def has_waiters(self) -> bool:
        return any(not fut.done() for fut in self.waiters)

    async def acquire(self, fresh: bool = False, side: bool = False) -> Connection:
        """A connection for one request. `side` (health probes, load scrapes) is never made to wait
        for room: a router busy at its limits must not read as a fleet of failing backends."""
        woken = False
        while True:
            now = self.loop.time()
            while self.idle and not fresh:
                conn = self.idle.pop()
                if conn.is_closed() or now - conn.idle_since > self.keepalive_s:
                    conn.close()
                    continue
                self.busy.add(conn)
                return conn
            if fresh and self.idle and self.open >= self.limit:
                self.idle.popleft().close()  # a fresh connection may take the place of an idle one
            if side:
                return await self._connect(counted=False)
            below_own = self.open < self.limit
            if below_own and self.budget.has_room():
                return await self._connect()
            fut = self.loop.create_future()
            queue = self.budget.waiters if below_own else self.waiters
            if woken:
                queue.appendleft(fut)  # woken and beaten to it: keep the place in the line
            else:
                queue.append(fut)
            woken = True
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    # Woken, then cancelled before it ran: the wake-up goes on (rule 3).
                    if below_own:
                        self.budget.wake_one()
                    else:
                        self._offer()
                fut.cancel()
                raise

    async def _connect(self, counted: bool = True) -> Connection:
        o = self.origin
        conn = Connection(self.loop, o, self.forget)
        self.busy.add(conn)  # counts against the limits while connecting
        if counted:
            self.budget.opened(conn)
        connecting = self.loop.create_task(
            self.loop.create_connection(
                lambda: conn,
                o.host,
                o.port,
                ssl=self.ssl_context,
                server_hostname=o.host if self.ssl_context is not None else None,
            )
        )
        try:
            await asyncio.wait((connecting,), timeout=self.connect_timeout_s)
            if not connecting.done():
                # The deadline is read on this loop's clock, which a busy loop reads late: the timer
                # can fire in the same turn that brings a handshake finished long before. One more
                # turn lets that connect be seen, rather than failed (a 502, and a failure held against
                # a healthy backend) for the router's own lag.
                await asyncio.sleep(CONNECT_GRACE_S)
            if not connecting.done() and conn.state is State.CONNECTING:
                raise ConnectFailed("connect timed out")
            await connecting
        except (OSError, ssl.SSLError) as exc:
            conn.close()
            raise ConnectFailed(f"connect failed: {type(exc).__name__}") from exc
        except BaseException:
            abandon(connecting)
            conn.close()
            raise
        return conn

    def release(self, conn: Connection) -> None:
        """The request on `conn` is over: parked idle if it can carry another (rule 1), else closed
        (rule 2; a connection that closed already woke its waiters then)."""
        self.busy.discard(conn)
        if conn.is_reusable() and not self.retired:
            conn.park(self.loop.time())
            self.idle.append(conn)
            if self._sweep is None:
                self._sweep = self.loop.call_later(self.keepalive_s, self._close_expired)
            self._offer()
        else:
            conn.close()

    def _offer(self) -> None:
        """An idle connection is here for the taking: this pool's first waiter, else the budget's (rule 1)."""
        if not wake_first(self.waiters) and self.idle:
            self.budget.wake_one()

    def forget(self, conn: Connection) -> None:
        """A connection closed: it leaves the pool, wherever it was (rule 2)."""
        self.busy.discard(conn)
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)
        self.budget.closed(conn)
        wake_first(self.waiters)

    def _close_expired(self) -> None:
        """Idle connections past keepalive_s are closed, oldest first, not left for the backend to."""
        self._sweep = None
        now = self.loop.time()
        while self.idle and now - self.idle[0].idle_since >= self.keepalive_s:
            self.idle.popleft().close()
        if self.idle:
            self._sweep = self.loop.call_at(self.idle[0].idle_since + self.keepalive_s, self._close_expired)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self.idle) + list(self.busy):
            conn.close()
        self.idle.clear()
        self.busy.clear()
