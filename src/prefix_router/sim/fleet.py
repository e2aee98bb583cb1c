"""Running simulated backends on sockets: one `SimBackend`, or a `SimFleet` of them in one loop.

Each backend has its own cache, scheduler and metrics registry; they share only the event loop,
which is why the sim sleeps instead of computing.
"""

from __future__ import annotations

from types import TracebackType

from aiohttp import web

from prefix_router.sim.config import SimConfig
from prefix_router.sim.server import SimServer


class SimBackend:
    """One SimServer bound to host:port (port 0 picks a free one); `url` is known once started."""

    def __init__(self, config: SimConfig, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = SimServer(config)
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        if self._runner is None:
            raise RuntimeError("the backend is not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        # handler_cancellation: a client disconnect must cancel the handler, which frees the
        # request's slot and blocks; aiohttp leaves it off by default.
        runner = web.AppRunner(self.server.create_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        for address in runner.addresses:
            if isinstance(address, tuple):
                self.port = int(address[1])
                break

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> SimBackend:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()


class SimFleet:
    """`count` backends with one config, on base_port, base_port + 1, ... (or each on a free port if 0).

    `async with SimFleet(config, count=4) as fleet: fleet.urls`
    """

    def __init__(
        self, config: SimConfig, *, host: str = "127.0.0.1", base_port: int = 0, count: int = 4
    ) -> None:
        if count < 1:
            raise ValueError("count must be at least 1")
        if base_port < 0 or base_port + count - 1 > 65535:
            raise ValueError(f"ports {base_port}..{base_port + count - 1} are out of range")
        self.backends = [
            SimBackend(config, host=host, port=base_port + index if base_port else 0)
            for index in range(count)
        ]

    @property
    def urls(self) -> list[str]:
        return [backend.url for backend in self.backends]

    async def start(self) -> None:
        try:
            for backend in self.backends:
                await backend.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for backend in self.backends:
            await backend.stop()

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()
