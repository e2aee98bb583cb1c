"""Run a RouterApp: the main listener (frontend.http1.Listener) and the optional metrics and admin
listeners (uvicorn + FastAPI), in one event loop; SIGTERM fails /readyz at once, stops accepting, and
drains in-flight requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import signal
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import uvicorn

from prefix_router.frontend.http1 import Listener, ListenerLimits
from prefix_router.router import RouterApp
from prefix_router.settings import ServerSettings

log = logging.getLogger("prefix_router")


class SideServer(uvicorn.Server):
    """A uvicorn server for a side port that leaves signal handling to `serve`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def side_config(asgi: Any, s: ServerSettings, host: str, port: int) -> uvicorn.Config:
    """A side listener (metrics, admin): FastAPI under uvicorn, off the data path."""
    return uvicorn.Config(
        asgi,
        host=host,
        port=port,
        lifespan="off",
        access_log=False,
        log_level=s.log_level,
        timeout_graceful_shutdown=1,
        timeout_keep_alive=int(s.keepalive_timeout_s),
        server_header=False,
        proxy_headers=False,
    )


def listener_limits(s: ServerSettings) -> ListenerLimits:
    return ListenerLimits(
        max_head_bytes=s.max_header_bytes,
        head_timeout_s=s.header_timeout_s,
        max_body_bytes=s.max_body_bytes,
        body_timeout_s=s.body_timeout_s,
        send_timeout_s=s.send_timeout_s,
        keepalive_timeout_s=s.keepalive_timeout_s,
        max_buffered_body_bytes=s.max_buffered_body_bytes,
        max_connections=s.max_connections,
        underscores_in_headers=s.underscores_in_headers,
    )


class RouterServer:
    """The main port and the side ports, started and stopped together with the app's resources."""

    def __init__(
        self,
        app: RouterApp,
        sockets: list[socket.socket] | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self._sockets = sockets
        self._on_started = on_started
        self.started = False
        self.force_exit = False
        self._exit: asyncio.Event | None = None
        self.listener: Listener | None = None  # the main port's, once serving (tests look at its state)

    @property
    def should_exit(self) -> bool:
        return self._exit is not None and self._exit.is_set()

    def request_exit(self) -> None:
        if self._exit is None:
            self._exit = asyncio.Event()
        self._exit.set()

    async def serve(self) -> int:
        """Serve until request_exit(); 1 if the main port could not be opened."""
        if self._exit is None:
            self._exit = asyncio.Event()
        app, s = self.app, self.app.settings.server
        await app.start()
        listener = Listener(app.handle, app.render_error, listener_limits(s), app.access_log)
        self.listener = listener
        try:
            if self._sockets:
                for sock in self._sockets:
                    await listener.listen(sock=sock)
            else:
                await listener.listen(s.host, s.port)
        except OSError as exc:
            log.error("cannot listen on %s:%s: %s", s.host, s.port, exc)
            await app.stop()
            return 1
        side: list[SideServer] = []
        if s.metrics_port is not None:
            side.append(SideServer(side_config(app.metrics_app, s, s.host, s.metrics_port)))
        if s.admin_port is not None:
            side.append(SideServer(side_config(app.admin_app, s, s.admin_host, s.admin_port)))
        loop = asyncio.get_running_loop()
        side_tasks = [loop.create_task(server.serve()) for server in side]
        self.started = True
        log.info("prefix-router listening on %s", listener.addresses())
        if self._on_started is not None:
            self._on_started()
        try:
            await self._exit.wait()
            await listener.shut_down(s.drain_timeout_s, lambda: self.force_exit)
        finally:
            for server in side:
                server.should_exit = True
            await asyncio.gather(*side_tasks, return_exceptions=True)
            await app.stop()
        return 0


class PortInUse(OSError):
    """The listen port is taken; `suggestion` is a nearby free port, when one was found."""

    def __init__(self, port: int, suggestion: int | None) -> None:
        super().__init__(errno.EADDRINUSE, f"port {port} is in use")
        self.port = port
        self.suggestion = suggestion

    def describe(self) -> str:
        hint = f"; try --port {self.suggestion}" if self.suggestion is not None else ""
        return f"port {self.port} is in use{hint}"


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for host:port, bound now, as loop.create_server would bind them (every address
    the host resolves to, SO_REUSEADDR, IPv6 sockets v6-only), so a taken port is known before anything
    is printed or started. Raises PortInUse, or OSError for an address that cannot be bound."""
    try:
        return _bind(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(port, free_port_near(host, port)) from exc
        raise


def _bind(host: str, port: int) -> list[socket.socket]:
    infos = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], port, *address[2:]))
            if port == 0:  # every address of the host gets the port the first one was given
                port = sock.getsockname()[1]
            sock.listen(2048)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def free_port_near(host: str, port: int, tries: int = 100) -> int | None:
    """The first port above `port` that host can bind now (for a "try --port N" hint), or None."""
    for candidate in range(port + 1, min(port + 1 + tries, 65536)):
        try:
            for sock in _bind(host, candidate):
                sock.close()
        except OSError:
            continue
        return candidate
    return None


# Every proxied request allocates a few hundred objects; at CPython's default gen-0 threshold (700)
# the collector ran several times per batch of requests. Measured with benchmarks/soak.py on this
# machine: /healthz p99 during a 150k-request soak 55 -> 21 ms (main port), 22 -> 20 ms (metrics
# port); --quick: 1,389 -> 1,731 req/s (one run each; the proxy_throughput figures did not move).
GC_GEN0_THRESHOLD = 50_000


def tune_gc() -> None:
    """Freeze what start-up allocated (it lives for the process) and collect young objects less often."""
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


async def serve(
    app: RouterApp,
    sockets: list[socket.socket] | None = None,
    on_started: Callable[[], None] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code. `on_started` runs once every port
    listens, SIGINT and SIGTERM already handled here (the demo prints its banner then)."""
    s = app.settings.server
    server = RouterServer(app, sockets, on_started)
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if server.should_exit:
            log.warning("second signal: exiting without waiting for in-flight requests")
            server.force_exit = True
            return
        log.info("signal %s: failing /readyz and draining for up to %g s", signum, s.drain_timeout_s)
        app.draining = True
        server.request_exit()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    tune_gc()
    try:
        return await server.serve()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed (uvicorn[standard] brings it): a cheaper event loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
