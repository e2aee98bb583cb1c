"""A loopback HTTP/1.1 backend whose answers are scripts writing raw bytes, for the upstream-client tests.

Raw asyncio streams, so the wire is under the test's control whatever HTTP client the router uses
upstream: exact framing, broken answers, floods, idle closes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rawhttp import RawRequest, read_request
from routerkit import RunningRouter

__all__ = [
    "HEALTH_OK",
    "RawBackend",
    "RawConn",
    "RawRequest",
    "Script",
    "Start",
    "answer",
    "dribble",
    "ok",
    "read_request",
]

HEALTH_OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
# The router's own probes at start (health, and the KV capacity read from the metrics page).
PROBE_PATHS = frozenset({"/health", "/metrics"})


@dataclass
class RawConn:
    index: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    requests: list[RawRequest] = field(default_factory=list)
    eof: asyncio.Event = field(default_factory=asyncio.Event)  # the router closed its side

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


# A script answers one request on one connection and says whether the connection stays open.
Script = Callable[[RawRequest, RawConn], Awaitable[bool]]


class RawBackend:
    """A loopback HTTP/1.1 server whose answers are scripts writing raw bytes.

    /health and /metrics are answered 200 with `connection: close`, so the router's start-up probes
    never leave a pooled connection behind; `conns` holds only the data-path connections.
    `idle_close_s` closes a connection that stays idle that long between requests, as uvicorn's
    keep-alive timeout does.
    """

    def __init__(self, script: Script, idle_close_s: float | None = None) -> None:
        self.script = script
        self.idle_close_s = idle_close_s
        self.conns: list[RawConn] = []
        self.open = 0
        self.peak_open = 0
        self.health_probes = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> list[RawRequest]:
        return [req for conn in self.conns for req in conn.requests]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=1 << 20)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        for task in list(self._handlers):
            with contextlib.suppress(BaseException):
                await task

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        conn: RawConn | None = None
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        try:
            while True:
                if conn is not None and self.idle_close_s is not None:
                    try:
                        # A request's head arrives at once; this bounds only the idle wait for one.
                        async with asyncio.timeout(self.idle_close_s):
                            req = await read_request(reader)
                    except TimeoutError:
                        return
                else:
                    req = await read_request(reader)
                if req is None:
                    if conn is not None:
                        conn.eof.set()
                    return
                if req.target in PROBE_PATHS and conn is None:
                    self.health_probes += req.target == "/health"
                    writer.write(HEALTH_OK)
                    await writer.drain()
                    return
                if conn is None:
                    conn = RawConn(len(self.conns), reader, writer)
                    self.conns.append(conn)
                conn.requests.append(req)
                if not await self.script(req, conn):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            if conn is not None:
                conn.eof.set()
        except asyncio.CancelledError:
            # stop() cancels handlers still scripted to wait; ending quietly keeps asyncio's
            # start_server callback from logging the cancellation as an error.
            return
        finally:
            self.open -= 1
            writer.close()
            self._handlers.discard(task)


def answer(data: bytes, keep_open: bool = True) -> Script:
    async def script(req: RawRequest, conn: RawConn) -> bool:
        await conn.send(data)
        return keep_open

    return script


def dribble(data: bytes, piece_bytes: int, pause_s: float = 0.0) -> Script:
    """Answer with `data` cut in pieces of `piece_bytes`, each its own write, `pause_s` apart."""

    async def script(req: RawRequest, conn: RawConn) -> bool:
        for i in range(0, len(data), piece_bytes):
            await conn.send(data[i : i + piece_bytes])
            await asyncio.sleep(pause_s)
        return True

    return script


def ok(body: bytes = b"ok", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


Start = Callable[..., Awaitable[tuple[RawBackend, RunningRouter]]]
