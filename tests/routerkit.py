"""A real router (its own HTTP/1.1 listener) on a 127.0.0.1 ephemeral port, for tests and their fixtures."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

from prefix_router.router import RouterApp, create_app
from prefix_router.runtime import RouterServer, SideServer, side_config
from prefix_router.settings import Settings, load_settings

from fakebackend import FakeBackend


def free_socket() -> socket.socket:
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when the listener's proto
    # says TCP; without it every kept-alive request through a test router waits ~40 ms (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class RunningRouter:
    def __init__(self, app: RouterApp, server: RouterServer, task: asyncio.Task[int], port: int) -> None:
        self.app = app
        self.server = server
        self.task = task
        self.port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inflight(self) -> dict[str, int]:
        load = self.app.backends.load
        return {b.url: load.inflight(b.url) for b in self.app.backends.backends()}

    async def stop(self) -> None:
        self.server.request_exit()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self.task, 10)


def router_settings(backends: list[FakeBackend] | list[str], **sections: dict[str, Any]) -> Settings:
    urls = [b if isinstance(b, str) else b.url for b in backends]
    overrides: dict[str, Any] = {"backends": [{"url": u} for u in urls]}
    # Tests drive health themselves; a slow prober keeps runs deterministic unless a test asks. Nor
    # do they ask backends for /v1/models unless they say so: a fake backend echoes every path.
    overrides["health"] = {"interval_s": 3600.0}
    # Tests read which backend answered from the header, which is off by default.
    overrides["server"] = {"backend_header": True}
    overrides["models"] = {"probe": False}
    for name, values in sections.items():
        overrides[name] = {**overrides.get(name, {}), **values}
    return load_settings(None, overrides, environ=False)


async def start_router(settings: Settings) -> RunningRouter:
    app = create_app(settings)
    sock = free_socket()
    port = sock.getsockname()[1]
    server = RouterServer(app, [sock])
    task = asyncio.get_running_loop().create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    else:
        raise RuntimeError("router did not start")
    return RunningRouter(app, server, task, port)


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll until predicate() holds, failing after a generous bound (no timing asserted)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def start_side_app(asgi: object, settings: Settings) -> tuple[SideServer, asyncio.Task[None], int]:
    """Serve one of the router's side apps (admin, metrics) on its own loopback port."""
    sock = free_socket()
    port = sock.getsockname()[1]
    server = SideServer(side_config(asgi, settings.server, "127.0.0.1", port))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    for _ in range(500):
        if server.started:
            return server, task, port
        await asyncio.sleep(0.01)
    raise RuntimeError("side app did not start")
