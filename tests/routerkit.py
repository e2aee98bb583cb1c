"""A real router (its own HTTP/1.1 listener) on a 127.0.0.1 ephemeral port, for tests and their fixtures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from prefix_router.router import RouterApp, create_app
from prefix_router.runtime import RouterServer, SideServer, side_config
from prefix_router.settings import Settings, load_settings

from fakebackend import FakeBackend
from loopback import eventually, free_socket

__all__ = [
    "RunningRouter",
    "eventually",
    "free_socket",
    "router_settings",
    "start_router",
    "start_side_app",
]


async def _started(server: RouterServer | SideServer, task: asyncio.Task[Any], what: str) -> None:
    """Until the server says it listens; a server task that fails first raises its error."""

    def started() -> bool:
        if task.done():
            task.result()
        return server.started

    await eventually(started, 5.0, f"{what} started")


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


def router_settings(backends: Sequence[FakeBackend] | Sequence[str], **sections: dict[str, Any]) -> Settings:
    urls = [b if isinstance(b, str) else b.url for b in backends]
    overrides: dict[str, Any] = {"backends": [{"url": u} for u in urls]}
    # Tests drive health themselves; a slow prober keeps runs deterministic unless a test asks. Nor
    # do they ask backends for /v1/models unless they say so: a fake backend echoes every path.
    overrides["health"] = {"interval_s": 3600.0}
    # Tests read which backend answered from the header, which is off by default.
    overrides["server"] = {"backend_header": True}
    overrides["models"] = {"probe": False}
    # Nor for /tokenize: a fake backend counts the requests it gets.
    overrides["routing"] = {"bytes_per_token": 4.0}
    for name, values in sections.items():
        overrides[name] = {**overrides.get(name, {}), **values}
    return load_settings(None, overrides, environ=False)


async def start_router(settings: Settings) -> RunningRouter:
    app = create_app(settings)
    sock = free_socket()
    port = sock.getsockname()[1]
    server = RouterServer(app, [sock])
    task = asyncio.get_running_loop().create_task(server.serve())
    await _started(server, task, "router")
    return RunningRouter(app, server, task, port)


async def start_side_app(asgi: object, settings: Settings) -> tuple[SideServer, asyncio.Task[None], int]:
    """Serve one of the router's side apps (admin, metrics) on its own loopback port."""
    sock = free_socket()
    port = sock.getsockname()[1]
    server = SideServer(side_config(asgi, settings.server, "127.0.0.1", port))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    await _started(server, task, "side app")
    return server, task, port
