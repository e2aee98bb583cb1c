"""The client-facing HTTP/1.1 listener of the main port: an asyncio protocol on httptools' parser.

The data path used uvicorn (ASGI) until measurement showed uvicorn and aiohttp's client were most of the
cost of a proxied request (README, "Why our own HTTP/1.1"). A relay needs a small part of a general
server, so it has its own: request heads and bodies parsed by llhttp, the body read whole (bounded)
before the handler runs, responses framed by Content-Length, chunked encoding, or close, and the limits
nginx users expect: head size (431), head and body time (408), body size (413), keep-alive idle time.
A client that goes away cancels its request's task at once, so the backend stops generating.
"""

from __future__ import annotations

import asyncio
import collections
import http
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote

import httptools

from prefix_router.errors import (
    BadRequest,
    BodyTooLarge,
    HeadersTooLarge,
    RequestTimeout,
    RouterError,
)
from prefix_router.tcp import set_nodelay

log = logging.getLogger("prefix_router")

ResponseParts = tuple[int, list[tuple[bytes, bytes]], bytes]  # status, headers, body
ErrorRenderer = Callable[[RouterError], ResponseParts]


class AccessLog(Protocol):
    """Told of every request the listener finished: answered, or refused before it was whole."""

    def answered(self, ex: Exchange, duration_s: float) -> None: ...
    def refused(self, client_ip: str | None, target: bytes, status: int) -> None: ...


_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_MAX_QUEUED = 8  # pipelined requests parsed ahead of the one being answered; then reading pauses
_NONE, _LENGTH, _CHUNKED, _CLOSE = range(4)


class FlowControl(Protocol):
    """What a slow client pauses: the upstream connection feeding its response."""

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    max_head_bytes: int
    head_timeout_s: float
    max_body_bytes: int
    body_timeout_s: float
    keepalive_timeout_s: float
    send_timeout_s: float


class Exchange:
    """One request, read whole, and the way back to its client."""

    __slots__ = (
        "_conn",
        "_head",
        "_mode",
        "backend",
        "body",
        "branch",
        "client_gone",
        "client_ip",
        "complete",
        "flow",
        "headers",
        "http_11",
        "keep_alive",
        "method",
        "path",
        "query",
        "raw_path",
        "scheme",
        "sent",
        "started",
        "status",
        "target",
    )

    def __init__(
        self,
        conn: HttpProtocol,
        method: str,
        url: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        http_11: bool,
        keep_alive: bool,
    ) -> None:
        self._conn = conn
        self.target = url  # as sent: the backend sees exactly this, even a trailing "?"
        raw_path, _, query = url.partition(b"?")
        self.raw_path = raw_path
        self.query = query
        text = raw_path.decode("latin-1")
        self.path = unquote(text) if "%" in text else text
        self.method = method
        self.headers = headers
        self.body = body
        self.http_11 = http_11
        self.keep_alive = keep_alive
        self.client_ip = conn.client_ip
        self.scheme = "http"
        self.client_gone = False
        self.started = False
        self.complete = False
        self.flow: FlowControl | None = None
        self.status = 0
        self.backend: str | None = None  # for the access log: who answered, on which branch
        self.branch: str | None = None
        self.sent = 0  # response body bytes written, for the access log
        self._head = b""
        self._mode = _NONE

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Frame the response; its head leaves with the first body bytes, or on flush()."""
        self.started = True
        self.status = status
        keep_alive = self.keep_alive and not self._conn.closing
        has_length = False
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
        for name, value in headers:
            if name == b"content-length":
                has_length = True
            elif name == b"connection":
                if b"close" in value.lower():
                    keep_alive = False
                continue
            elif name == b"transfer-encoding":
                continue
            lines.append(b"%s: %s\r\n" % (name, value))
        if self.method == "HEAD" or status in (204, 304) or status < 200:
            self._mode = _NONE
        elif has_length:
            self._mode = _LENGTH
        elif self.http_11:
            self._mode = _CHUNKED
            lines.append(b"transfer-encoding: chunked\r\n")
        else:
            self._mode = _CLOSE
            keep_alive = False
        if not keep_alive:
            lines.append(b"connection: close\r\n")
        elif not self.http_11:
            lines.append(b"connection: keep-alive\r\n")
        self.keep_alive = keep_alive
        lines.append(b"\r\n")
        self._head = b"".join(lines)

    @property
    def writing_paused(self) -> bool:
        return self._conn.writing_paused

    def flush(self) -> None:
        """Send the response head now, before any body (a stream whose first event is still coming)."""
        if self._head:
            head, self._head = self._head, b""
            self._conn.write(head)

    def write(self, data: bytes) -> None:
        if not data or self._mode == _NONE:
            self.flush()
            return
        self.sent += len(data)
        if self._mode == _CHUNKED:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        if self._head:
            data = self._head + data
            self._head = b""
        self._conn.write(data)

    def end(self) -> None:
        tail = b"0\r\n\r\n" if self._mode == _CHUNKED else b""
        if self._head:
            tail = self._head + tail
            self._head = b""
        if tail:
            self._conn.write(tail)
        self.complete = True

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole response of the router's own, in one write."""
        self.start(status, headers)
        self.write(body)
        self.end()


Handler = Callable[[Exchange], Awaitable[None]]


class HttpProtocol(asyncio.Protocol):
    """One client connection: parse, queue, answer one request at a time, in order."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener
        self._loop = listener.loop
        self._limits = listener.limits
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client_ip: str | None = None
        self.closing = False
        self._queue: collections.deque[Exchange] = collections.deque()
        self._current: Exchange | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._rejected = False
        self._reading = True
        self._paused_writing = False
        self._upgraded = False
        # the request being parsed
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_size = 0
        self._head_size = 0
        self._in_head = False
        self._in_body = False
        self._last_body = 0.0

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)
        peer = transport.get_extra_info("peername")
        self.client_ip = peer[0] if isinstance(peer, tuple) and peer else None
        self._listener.connections.add(self)
        self._arm(self._limits.head_timeout_s, self._idle_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._rejected or self._upgraded:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # WebSocket and h2c upgrades are not proxied; the request itself is answered as HTTP/1.1
            # (RFC 9110 §7.8 lets a server ignore Upgrade), and the connection closes after it.
            self._upgraded = True
            upgrading = self._queue[-1] if self._queue else self._current
            if upgrading is not None:
                upgrading.keep_alive = False  # the last request parsed is the one that asked
            else:
                self._reject(BadRequest("protocol upgrade without a complete request"))
        except httptools.HttpParserError as exc:
            if not self._rejected:
                self._reject(BadRequest(f"malformed HTTP request: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self._listener.connections.discard(self)
        self.closing = True
        self._queue.clear()
        current = self._current
        if current is not None and not current.complete:
            current.client_gone = True
            if self._task is not None:
                self._task.cancel()
        if current is not None and current.flow is not None:
            current.flow.resume_reading()

    def pause_writing(self) -> None:
        self._paused_writing = True
        if self._stall_timer is None:
            self._stall_timer = self._loop.call_later(self._limits.send_timeout_s, self._send_stalled)
        current = self._current
        if current is not None and current.flow is not None:
            current.flow.pause_reading()

    def resume_writing(self) -> None:
        self._paused_writing = False
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        current = self._current
        if current is not None and current.flow is not None:
            current.flow.resume_reading()

    @property
    def writing_paused(self) -> bool:
        return self._paused_writing

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._body_size = 0
        self._head_size = 0
        self._in_head = True
        if self._current is None:
            self._arm(self._limits.head_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a chunked body's trailer field: never a header of the request (nor a tenant)
        self._count(len(name) + len(value) + 4)
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._rejected:
            return
        declared = -1
        expect = False
        for name, value in self._headers:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    self._reject(BadRequest("invalid Content-Length"))
                    return
            elif name == b"expect":
                expect = value.lower() == b"100-continue"
        limit = self._limits.max_body_bytes
        if declared > limit:
            self._reject(BodyTooLarge(f"request body of {declared} bytes is over the limit of {limit} bytes"))
            return
        if declared != 0 and (declared > 0 or self._has_chunked_body()):
            self._in_body = True
            self._last_body = self._loop.time()
            if self._current is None:
                self._arm(self._limits.body_timeout_s, self._body_timed_out)
            if expect and self._current is None and self._parser.get_http_version() == "1.1":
                self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        elif self._current is None:
            self._disarm()

    def on_body(self, body: bytes) -> None:
        if self._rejected:
            return
        self._body_size += len(body)
        limit = self._limits.max_body_bytes
        if self._body_size > limit:
            self._reject(BodyTooLarge(f"request body is over the limit of {limit} bytes"))
            return
        self._body.append(body)
        self._last_body = self._loop.time()

    def on_message_complete(self) -> None:
        if self._rejected:
            return
        self._in_body = False
        parser = self._parser
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        ex = Exchange(
            self,
            parser.get_method().decode("latin-1"),
            self._url,
            self._headers,
            body,
            parser.get_http_version() == "1.1",
            parser.should_keep_alive(),
        )
        self._queue.append(ex)
        if self._current is None:
            self._next()
        elif len(self._queue) >= _MAX_QUEUED and self._reading and self.transport is not None:
            self._reading = False
            self.transport.pause_reading()

    def _has_chunked_body(self) -> bool:
        return any(n == b"transfer-encoding" and b"chunked" in v.lower() for n, v in self._headers)

    # -- one request at a time -------------------------------------------------------------------

    def _next(self) -> None:
        if not self._queue:
            if not self._reading and self.transport is not None and not self.closing:
                self._reading = True
                self.transport.resume_reading()
            if self._in_head:
                self._arm(self._limits.head_timeout_s, self._head_timed_out)
            elif self._in_body:
                self._arm(self._limits.body_timeout_s, self._body_timed_out)
            else:
                self._arm(self._limits.keepalive_timeout_s, self._idle_timed_out)
            return
        self._disarm()
        ex = self._queue.popleft()
        self._current = ex
        self._task = self._loop.create_task(self._run(ex))

    async def _run(self, ex: Exchange) -> None:
        access = self._listener.access_log
        started = time.perf_counter() if access is not None else 0.0  # (uvloop's clock ticks in ms)
        try:
            await self._listener.handler(ex)
        except asyncio.CancelledError:
            if not ex.client_gone:
                raise
        except Exception:
            log.exception("unhandled error answering %s %s", ex.method, ex.path)
            if not ex.started and not ex.client_gone:
                ex.respond(*self._listener.render_error(RouterError("internal error in the router")))
        finally:
            if access is not None:
                access.answered(ex, time.perf_counter() - started)
            self._finished(ex)

    def _finished(self, ex: Exchange) -> None:
        self._current = None
        self._task = None
        ex.flow = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not ex.complete or not ex.keep_alive or self.closing:
            # An unfinished response (a broken stream) can only be ended by closing: the client sees
            # a truncated body rather than a made-up end.
            transport.close()
            return
        self._next()

    # -- limits ----------------------------------------------------------------------------------

    def _count(self, n: int) -> None:
        self._head_size += n
        if self._head_size > self._limits.max_head_bytes and not self._rejected:
            self._reject(HeadersTooLarge(f"request head over {self._limits.max_head_bytes} bytes"))

    def _reject(self, error: RouterError) -> None:
        """Answer a request the router refuses before it reaches the handler, and close."""
        self._rejected = True
        self._disarm()
        self._queue.clear()
        if self._current is not None:
            # Answer the request in flight first; this one can only be refused by closing after it.
            self._current.keep_alive = False
            return
        status, headers, body = self._listener.render_error(error)
        if self._listener.access_log is not None:
            self._listener.access_log.refused(self.client_ip, self._url, status)
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
        head += [b"%s: %s\r\n" % (n, v) for n, v in headers if n != b"connection"]
        head.append(b"connection: close\r\n\r\n")
        self.write(b"".join(head) + body)
        if self.transport is not None:
            self.transport.close()

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self._loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle_timed_out(self) -> None:
        """Nothing arrived on an accepted or kept-alive connection: close it without an answer."""
        self._timer = None
        if self._current is None and not self._queue and self.transport is not None:
            self.transport.close()

    def _send_stalled(self) -> None:
        """The client took nothing for send_timeout_s: drop it, which cancels its backend request."""
        self._stall_timer = None
        if self._paused_writing and self.transport is not None:
            log.info("client %s read nothing for %g s: closing", self.client_ip, self._limits.send_timeout_s)
            self.transport.abort()

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._in_head:
            self._reject(
                RequestTimeout(f"request head not received within {self._limits.head_timeout_s:g} s")
            )

    def _body_timed_out(self) -> None:
        self._timer = None
        if not self._in_body:
            return
        left = self._last_body + self._limits.body_timeout_s - self._loop.time()
        if left > 0:
            self._arm(left, self._body_timed_out)
            return
        self._reject(RequestTimeout(f"no request body bytes within {self._limits.body_timeout_s:g} s"))

    @property
    def busy(self) -> bool:
        """A request is being answered, queued, or its body is still arriving."""
        return self._current is not None or bool(self._queue) or self._in_body

    def shut_down(self) -> None:
        """Stop after the current response; an idle connection closes now."""
        self.closing = True
        if not self.busy and self.transport is not None:
            self.transport.close()


class Listener:
    """The HTTP/1.1 server of the main port: its connections, its handler, its shutdown."""

    def __init__(
        self,
        handler: Handler,
        render_error: ErrorRenderer,
        limits: ListenerLimits,
        access_log: AccessLog | None = None,
    ) -> None:
        self.handler = handler
        self.access_log = access_log
        self.render_error = render_error
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.connections: set[HttpProtocol] = set()
        self._servers: list[asyncio.Server] = []

    async def listen(
        self, host: str | None = None, port: int | None = None, sock: socket.socket | None = None
    ) -> None:
        if sock is not None:
            server = await self.loop.create_server(lambda: HttpProtocol(self), sock=sock, backlog=2048)
        else:
            server = await self.loop.create_server(
                lambda: HttpProtocol(self), host, port or 0, backlog=2048, reuse_address=True
            )
        self._servers.append(server)

    def addresses(self) -> str:
        names = []
        for server in self._servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                names.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
        return ", ".join(names)

    def busy(self) -> int:
        return sum(1 for c in self.connections if c.busy)

    async def shut_down(self, drain_timeout_s: float, forced: Callable[[], bool]) -> None:
        """Stop accepting, let requests in flight finish for up to drain_timeout_s (or until forced()),
        then close every connection."""
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.shut_down()
        deadline = self.loop.time() + drain_timeout_s
        while self.busy() and self.loop.time() < deadline and not forced():  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # a poll: drains are rare and the condition has three parts
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()  # past the drain: a client's unread buffer must not hold us
        for server in self._servers:
            await server.wait_closed()
