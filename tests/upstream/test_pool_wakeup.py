"""The pool's wake-up rule (upstream/pool.py's docstring), tested directly on the upstream client.

Real loopback backends (raw-bytes servers), the client without a router in front: requests made to
wait by a per-backend limit of one connection and a budget of one or two connections over all
backends, then woken by a release, and sometimes cancelled right after being woken, before they ran.
Keep-alive is long (60 s), so a lost wake-up shows as a request still waiting when the test's generous
bound runs out, not as one served late by the idle sweep.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from prefix_router.upstream.client import Upstream, UpstreamResponse
from prefix_router.upstream.config import UpstreamConfig

from rawbackend import RawBackend, RawConn, RawRequest, ok
from routerkit import eventually

BOUND_S = 5.0  # generous: every wake-up here is immediate, a lost one waits 60 s


async def echo_target(req: RawRequest, conn: RawConn) -> bool:
    await conn.send(ok(req.target.encode()))
    return True


@pytest.fixture
async def backends() -> AsyncIterator[Callable[[int], Awaitable[list[RawBackend]]]]:
    started: list[RawBackend] = []

    async def make(n: int) -> list[RawBackend]:
        for _ in range(n):
            backend = RawBackend(echo_target)
            await backend.start()
            started.append(backend)
        return started[-n:]

    yield make
    for backend in started:
        await backend.stop()


@pytest.fixture
async def upstream() -> AsyncIterator[Callable[[int], Awaitable[Upstream]]]:
    made: list[Upstream] = []

    async def make(max_connections: int) -> Upstream:
        config = UpstreamConfig(
            max_connections=max_connections, max_connections_per_backend=1, keepalive_timeout_s=60.0
        )
        up = Upstream(config)
        await up.start()
        made.append(up)
        return up

    yield make
    for up in made:
        await up.close()


async def held(up: Upstream, backend: RawBackend, path: str) -> UpstreamResponse:
    """An answered request whose connection is still checked out (finish() gives it back)."""
    resp = await up.send("GET", backend.url, path.encode(), b"", b"")
    assert await resp.read() == path.encode()
    return resp


async def fetched(up: Upstream, backend: RawBackend, path: str) -> bytes:
    resp = await up.send("GET", backend.url, path.encode(), b"", b"")
    body = await resp.read()
    resp.finish()
    return body


def pending(waiters: deque[asyncio.Future[None]]) -> int:
    """Requests still waiting in a line (one that gave up leaves a done future there)."""
    return sum(1 for fut in waiters if not fut.done())


async def test_a_released_connection_goes_to_the_next_waiter_when_the_woken_one_is_cancelled(
    upstream: Callable[[int], Awaitable[Upstream]], backends: Callable[[int], Awaitable[list[RawBackend]]]
) -> None:
    (a,) = await backends(1)
    up = await upstream(8)
    first = await held(up, a, "/first")
    pool = up._pool(a.url)
    woken = asyncio.create_task(fetched(up, a, "/woken"))
    next_in_line = asyncio.create_task(fetched(up, a, "/next"))
    await eventually(lambda: pending(pool.waiters) == 2)
    first.finish()  # parks the connection and wakes the first waiter (rule 1) ...
    woken.cancel()  # ... which is cancelled before it runs: its wake-up must go on (rule 3)
    assert await asyncio.wait_for(next_in_line, BOUND_S) == b"/next"
    assert woken.cancelled()
    assert len(a.conns) == 1, "the one kept-alive connection served both"


async def test_a_waiter_cancelled_before_it_was_woken_takes_no_wake_up_with_it(
    upstream: Callable[[int], Awaitable[Upstream]], backends: Callable[[int], Awaitable[list[RawBackend]]]
) -> None:
    (a,) = await backends(1)
    up = await upstream(8)
    first = await held(up, a, "/first")
    pool = up._pool(a.url)
    gave_up = asyncio.create_task(fetched(up, a, "/gave-up"))
    next_in_line = asyncio.create_task(fetched(up, a, "/next"))
    await eventually(lambda: pending(pool.waiters) == 2)
    gave_up.cancel()
    await asyncio.sleep(0)
    first.finish()
    assert await asyncio.wait_for(next_in_line, BOUND_S) == b"/next"


async def test_under_a_full_budget_a_request_for_another_backend_closes_an_idle_connection(
    upstream: Callable[[int], Awaitable[Upstream]], backends: Callable[[int], Awaitable[list[RawBackend]]]
) -> None:
    a, b = await backends(2)
    up = await upstream(1)
    assert await fetched(up, a, "/a") == b"/a"
    assert len(up._pool(a.url).idle) == 1, "the budget's one connection is idle in A's pool"
    assert await asyncio.wait_for(fetched(up, b, "/b"), BOUND_S) == b"/b"
    await asyncio.wait_for(a.conns[0].eof.wait(), BOUND_S)  # A's idle connection was closed for B
    assert not up._pool(a.url).idle
    assert up._budget.open == 1


async def test_a_connection_parked_with_nobody_waiting_for_its_backend_wakes_the_budgets_waiter(
    upstream: Callable[[int], Awaitable[Upstream]], backends: Callable[[int], Awaitable[list[RawBackend]]]
) -> None:
    a, b = await backends(2)
    up = await upstream(1)
    first = await held(up, a, "/a")
    for_b = asyncio.create_task(fetched(up, b, "/b"))
    await eventually(lambda: pending(up._budget.waiters) == 1)
    first.finish()  # idle in A's pool, nobody waits there: B's request is woken and evicts it
    assert await asyncio.wait_for(for_b, BOUND_S) == b"/b"
    await asyncio.wait_for(a.conns[0].eof.wait(), BOUND_S)


async def test_a_cancelled_wake_up_in_one_pool_goes_on_to_the_budgets_waiter_when_nobody_else_waits_there(
    upstream: Callable[[int], Awaitable[Upstream]], backends: Callable[[int], Awaitable[list[RawBackend]]]
) -> None:
    a, b = await backends(2)
    up = await upstream(1)
    first = await held(up, a, "/a")
    woken = asyncio.create_task(fetched(up, a, "/woken"))  # A's line: A is at its own limit
    for_b = asyncio.create_task(fetched(up, b, "/b"))  # the budget's line: the budget is full
    await eventually(lambda: pending(up._pool(a.url).waiters) == 1 and pending(up._budget.waiters) == 1)
    first.finish()  # parked in A's pool: A's waiter is woken, not the budget's (rule 1) ...
    woken.cancel()  # ... and cancelled: nobody else waits for A, so B's request may take the room
    assert await asyncio.wait_for(for_b, BOUND_S) == b"/b"
    await asyncio.wait_for(a.conns[0].eof.wait(), BOUND_S)


async def test_a_cancelled_wake_up_in_the_budgets_line_goes_to_its_next_waiter(
    upstream: Callable[[int], Awaitable[Upstream]], backends: Callable[[int], Awaitable[list[RawBackend]]]
) -> None:
    a, b, c = await backends(3)
    up = await upstream(1)
    first = await held(up, a, "/a")
    woken = asyncio.create_task(fetched(up, b, "/b"))
    next_in_line = asyncio.create_task(fetched(up, c, "/c"))
    await eventually(lambda: pending(up._budget.waiters) == 2)
    first.finish()
    woken.cancel()
    assert await asyncio.wait_for(next_in_line, BOUND_S) == b"/c"
    assert not b.conns, "the cancelled request never connected"


async def test_a_closed_connection_frees_room_for_the_budgets_waiter(
    upstream: Callable[[int], Awaitable[Upstream]], backends: Callable[[int], Awaitable[list[RawBackend]]]
) -> None:
    a, b = await backends(2)
    up = await upstream(1)
    first = await held(up, a, "/a")
    for_b = asyncio.create_task(fetched(up, b, "/b"))
    await eventually(lambda: pending(up._budget.waiters) == 1)
    first.abort()  # closed, not parked: a slot of the budget is free (rule 2)
    assert await asyncio.wait_for(for_b, BOUND_S) == b"/b"
    assert up._budget.open == 1
