"""Loopback ports and bounded waits, shared by the tests and the benchmarks.

Everything listens on 127.0.0.1 on a port the kernel picks. A wait polls until its condition holds
and fails, naming what it waited for, after a generous bound; none asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.01


def free_socket(port: int = 0) -> socket.socket:
    """A listening-ready socket bound to an ephemeral 127.0.0.1 port (or to `port`, to come back on
    the same one); hand it to the server itself so no other process can take the port between
    choosing and binding it."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when the listener's proto
    # says TCP; without it every kept-alive request through a test server waits ~40 ms (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def free_port() -> int:
    """An ephemeral 127.0.0.1 port for a child process that binds it itself (another process could
    take it in between; use free_socket where the server can be handed a socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_answers(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:port now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition", poll_s: float = 0.05
) -> None:
    """Block until predicate() holds; TimeoutError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached after {timeout_s:g} s")
        time.sleep(poll_s)


def wait_for_port(port: int, timeout_s: float = 20.0) -> None:
    """Block until 127.0.0.1:port accepts connections."""
    wait_until(lambda: port_answers(port), timeout_s, f"a listener on 127.0.0.1:{port}")


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout_s: float = 10.0,
    what: str = "condition",
    poll_s: float = POLL_S,
) -> None:
    """Poll until predicate() holds (it may be a coroutine function), failing the test after a
    generous bound. Nothing about timing is asserted."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        held = predicate()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s:g} s")
        await asyncio.sleep(poll_s)


async def eventually_equal(
    read: Callable[[], Awaitable[object]], expected: object, timeout_s: float = 5.0
) -> None:
    """Poll an async read until it returns `expected`; the failure shows the last value read."""
    got: object = None

    async def matches() -> bool:
        nonlocal got
        got = await read()
        return got == expected

    try:
        await eventually(matches, timeout_s)
    except AssertionError:
        raise AssertionError(f"{got!r} != {expected!r} after {timeout_s:g} s") from None
