"""A connect the kernel completed is not failed because the router's own event loop was late to see it.

Under load (thousands of streams on one core) the loop stalls for seconds at a time. A connect's
deadline then passes during a stall in which the handshake, on loopback, long finished: timed on the
loop alone, the router answered 502 "connect timed out" and counted a failure against a healthy
backend. The stall is made here by blocking the loop, on the standard asyncio loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from prefix_router.errors import ConnectFailed
from prefix_router.upstream.client import Upstream
from prefix_router.upstream.config import UpstreamConfig
from prefix_router.upstream.http1 import State

from rawbackend import RawBackend, RawConn, RawRequest, ok

CONNECT_TIMEOUT_S = 0.05
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def run_on(loop_name: str, main: Coroutine[Any, Any, None]) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(main)


async def echo_target(req: RawRequest, conn: RawConn) -> bool:
    await conn.send(ok(req.target.encode()))
    return True


async def send_through_a_stall(stall_s: float, backend_url: str | None = None) -> tuple[Upstream, Any]:
    """One request whose connect is under way when the loop blocks for `stall_s`."""
    up = Upstream(UpstreamConfig(connect_timeout_s=CONNECT_TIMEOUT_S))
    await up.start()
    backend = None
    if backend_url is None:
        backend = RawBackend(echo_target)
        await backend.start()
        backend_url = backend.url
    sending = asyncio.ensure_future(up.send("GET", backend_url, b"/after-the-stall", b"", b""))
    pool = up._pool(backend_url)
    while not any(c.state is State.CONNECTING for c in pool.busy):  # noqa: ASYNC110 - one turn at a time
        await asyncio.sleep(0)  # until the request has issued its connect, which the kernel completes
    time.sleep(stall_s)  # the loop stalls past the connect's deadline  # noqa: ASYNC251
    try:
        resp = await asyncio.wait_for(sending, 5.0)
        body = await resp.read()
        resp.finish()
        return up, body
    except ConnectFailed as exc:
        return up, exc
    finally:
        await up.close()
        if backend is not None:
            await backend.stop()


@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_a_connect_completed_during_a_loop_stall_is_used_not_timed_out(loop_name: str) -> None:
    async def main() -> None:
        _, got = await send_through_a_stall(stall_s=10 * CONNECT_TIMEOUT_S)
        assert got == b"/after-the-stall", f"the request failed: {got!r}"

    run_on(loop_name, main())


@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_a_connect_that_never_completes_still_times_out(loop_name: str) -> None:
    """The deadline still holds for a peer that does not answer the handshake at all."""

    async def main() -> None:
        # A listener whose accept queue is full: the kernel drops further SYNs, so a connect hangs.
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(0)
        port = lsock.getsockname()[1]
        fillers = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            fillers.append(s)
        await asyncio.sleep(0.05)
        started = time.monotonic()
        try:
            _, got = await send_through_a_stall(0.0, f"http://127.0.0.1:{port}")
        finally:
            for s in fillers:
                s.close()
            lsock.close()
        assert isinstance(got, ConnectFailed) and "timed out" in str(got)
        assert time.monotonic() - started < 5.0

    run_on(loop_name, main())
