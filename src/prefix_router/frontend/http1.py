"""The client-facing HTTP/1.1 listener of the main port: an asyncio protocol on httptools' parser.

The data path used uvicorn (ASGI) until measurement showed uvicorn and aiohttp's client were most of the
cost of a proxied request (README, "Why our own HTTP/1.1"). A relay needs a small part of a general
server, so it has its own: request heads and bodies parsed by llhttp, the body read whole (bounded)
before the handler runs, responses framed by Content-Length, chunked encoding, or close, and the limits
nginx users expect: head size (431, counted as the bytes arrive), head and body time (408), body size
(413), a global budget for buffered bodies and a connection cap (503), keep-alive idle time. A refusal is
followed by a lingering close (nginx's): the write side is shut and the rest of the upload read and
dropped for a bounded time, so the client reads the answer instead of a reset.
A client that goes away cancels its request's task at once, so the backend stops generating.
"""

from __future__ import annotations

import asyncio
import collections
import http
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

import httptools

from prefix_router.errors import (
    BadRequest,
    BodyTooLarge,
    HeadersTooLarge,
    InternalError,
    NotImplementedHere,
    Overloaded,
    RequestTimeout,
    RouterError,
    VersionNotSupported,
)
from prefix_router.frontend.exchange import AccessLog, ErrorRenderer, FlowControl, Handler
from prefix_router.tcp import set_nodelay

log = logging.getLogger("prefix_router")

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_MAX_QUEUED = 8  # pipelined requests parsed ahead of the one being answered; then reading pauses
_NONE, _LENGTH, _CHUNKED, _CLOSE = range(4)
# Lingering close after a refusal (nginx: lingering_time 30 s, lingering_timeout 5 s): the rest of an
# upload is read and dropped so that the client, still writing, is not reset before it reads the answer.
_LINGER_TOTAL_S = 30.0
_LINGER_IDLE_S = 5.0
_LINGER_MAX_BYTES = 64 * 1024 * 1024
# How long a request whose body does not fit the global body budget waits for room before its 503.
BODY_BUDGET_WAIT_S = 2.0
# RFC 3986 host (reg-name, IPv4, IP-literal) and port characters; anything else in Host is refused.
_HOST_BYTES = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,;=%:[]"


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    max_head_bytes: int
    head_timeout_s: float
    max_body_bytes: int
    body_timeout_s: float
    keepalive_timeout_s: float
    send_timeout_s: float
    max_buffered_body_bytes: int = 48 * 1024 * 1024
    max_connections: int = 16384
    underscores_in_headers: bool = False
    body_budget_wait_s: float = BODY_BUDGET_WAIT_S


class BodyBudget:
    """The bytes of request bodies the listener holds, over every connection, and who waits for room.

    A body is counted from its first byte (its whole declared length at once, so that uploads cannot
    each hold part of the budget and starve together) until its response starts: until then a retry
    may need it, and the client controls how long that lasts. Waiters are woken in arrival order."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[tuple[HttpProtocol, int]] = collections.deque()

    def take(self, n: int) -> bool:
        # A body that fits goes ahead of larger ones waiting: small requests stay served while big
        # uploads queue (a waiter's own wait is bounded).
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def force(self, n: int) -> None:
        """Count bytes already in memory (a chunked body has no declared length)."""
        self.used += n

    @property
    def over(self) -> bool:
        return self.used > self.limit

    def wait(self, conn: HttpProtocol, n: int) -> None:
        self._waiters.append((conn, n))

    def forget(self, conn: HttpProtocol) -> None:
        if any(c is conn for c, _ in self._waiters):
            self._waiters = collections.deque((c, n) for c, n in self._waiters if c is not conn)

    def release(self, n: int) -> None:
        self.used -= n
        while self._waiters and self.used + self._waiters[0][1] <= self.limit:
            conn, need = self._waiters.popleft()
            self.used += need
            conn.budget_granted(need)


class Http1Exchange:
    """One HTTP/1.1 request, read whole, and the way back to its client: a `frontend.exchange.Exchange`."""

    __slots__ = (
        "_conn",
        "_head",
        "_mode",
        "_reserved",
        "_transport",
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
        "model",
        "path",
        "query",
        "raw_path",
        "scheme",
        "sent",
        "started",
        "status",
        "target",
        "waiting",
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
        reserved: int = 0,
    ) -> None:
        self._conn = conn
        self._transport = conn.transport  # set once, in connection_made, before any request is parsed
        self._reserved = reserved  # bytes of the body budget this request holds
        self.waiting = False  # whole, but its body waits for room in the budget
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
        self.model: str | None = None
        self.sent = 0  # response body bytes written, for the access log
        self._head = b""
        self._mode = _NONE

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Frame the response; its head leaves with the first body bytes, or on flush()."""
        self.started = True
        self.status = status
        self.release_budget()
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

    def release_budget(self) -> None:
        """The body is no longer the listener's to hold: its response has started, or it is over."""
        if self._reserved:
            self._conn.budget.release(self._reserved)
            self._reserved = 0

    @property
    def writing_paused(self) -> bool:
        return self._conn.writing_paused

    def flush(self) -> None:
        """Send the response head now, before any body (a stream whose first event is still coming)."""
        if self._head:
            head, self._head = self._head, b""
            self._conn.write(head)

    def write(self, data: bytes) -> None:
        # Once per relayed chunk of a stream: the client's transport is written here, not through
        # HttpProtocol.write (one Python call less per event).
        mode = self._mode
        if mode == _NONE or not data:
            self.flush()
            return
        self.sent += len(data)
        if mode == _CHUNKED:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        if self._head:
            data = self._head + data
            self._head = b""
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

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


class HttpProtocol(asyncio.Protocol):
    """One client connection: parse, queue, answer one request at a time, in order."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener
        self._loop = listener.loop
        self._limits = listener.limits
        self.budget = listener.budget
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client_ip: str | None = None
        self.closing = False
        self._queue: collections.deque[Http1Exchange] = collections.deque()
        self._current: Http1Exchange | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._budget_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._rejected = False  # no more requests are parsed on this connection
        self._refusal: RouterError | None = None  # answered once the requests queued before it are
        self._lingering = False
        self._linger_bytes = 0
        self._linger_until = 0.0
        self._reading = True
        self._paused_writing = False
        self._upgraded = False  # a CONNECT: nothing after it is HTTP
        self._held = bytearray()  # bytes of a head (or trailer) field not fed yet: no line end seen
        self._line_tail = b""  # the open request line's bytes at the end of the last feed, if any
        self._line_opens = False  # ... and the request began in them (perhaps behind a body's last bytes)
        # The request whose request line passed its checks, by the identity of its field list (each
        # message gets a new one; its target would not do: one-byte bytes objects are shared).
        self._line_checked: list[tuple[bytes, bytes]] | None = None
        # the request being parsed
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_size = 0
        self._head_size = 0
        self._trailer_size = 0
        self._in_head = False
        self._in_body = False
        self._maybe_trailer = False  # after a chunk-size line and before its data: perhaps trailers
        self._chunked = False
        self._length = -1  # the request's Content-Length (-1: none)
        self._reserved = 0  # body budget held by the request being parsed
        self._awaiting_budget = False
        self._budget_ex: Http1Exchange | None = None  # a whole request that waits for body budget
        self._expect_continue = False  # a 100 Continue is owed once this request is the current one
        self._http_11 = False
        self._last_body = 0.0

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)
        peer = transport.get_extra_info("peername")
        self.client_ip = peer[0] if isinstance(peer, tuple) and peer else None
        connections = self._listener.connections
        if len(connections) >= self._limits.max_connections:
            # Envoy's overflow answer: a 503 the client can read, then close; never a silent reset.
            log.warning("connection from %s refused: %d connections open", self.client_ip, len(connections))
            self._reject(Overloaded(f"the router holds its maximum of {len(connections)} connections"))
            return
        connections.add(self)
        self._arm(self._limits.head_timeout_s, self._idle_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._rejected or self._upgraded:
            self._discard(len(data))
            return
        if self._in_body and self._length > 0:
            left = self._length - self._body_size
            if 0 < left < len(data):
                # A body framed by its length ends inside this read: what follows is fed as a read
                # of its own, so the next request line is read from its own first byte (the checks
                # on it read whole lines, and a body need not end with a line end).
                self._feed(data[:left])
                data = data[left:]
                if self._rejected:
                    self._discard(len(data))
                    return
        if self._in_head or self._maybe_trailer:
            # A field is complete only at its line end. Bytes without one are held (amortised, and
            # counted) rather than fed, so the parser's own per-field buffer is copied once per line,
            # not once per segment, and an endless field meets the head limit as it grows.
            if b"\n" not in data:
                self._held += data
                if self._in_head and self._head_size + len(self._held) > self._limits.max_head_bytes:
                    self._reject(HeadersTooLarge(f"request head over {self._limits.max_head_bytes} bytes"))
                elif len(self._held) > self._limits.max_head_bytes:
                    held, self._held = bytes(self._held), bytearray()
                    self._feed(held)
                    if self._maybe_trailer and not self._rejected:
                        self._reject(HeadersTooLarge("request trailer field too large"))
                return
            if self._held:
                data = bytes(self._held) + data
                self._held = bytearray()
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        tail = self._line_tail
        message = self._headers  # each message gets a new list: a new one began in this feed if it changes
        if tail or b"RTSP/" in data or b"ICE/" in data:
            if not self._feed_lines(data):
                return
        elif not self._parse(data):
            return
        if self._in_head and not self._rejected and self._head_size == len(self._url):
            # The request line (or the first field line after it) is still open: rare, a head split
            # across reads. Its start is kept for _feed_lines, in case a protocol name is split too.
            self._line_tail = data[data.rfind(b"\n") + 1 :]
            began = self._headers is not message
            self._line_opens = False
            if self._url:
                self._line_opens = self._check_http09(data, tail, began) and began

    def _parse(self, data: bytes, rest: bytes = b"") -> bool:
        """Feed the parser; False when it stopped (an error, or an Upgrade offer handed on with `rest`,
        the bytes that follow `data`)."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgrade(data[int(exc.args[0]) :] + rest)
            return False
        except httptools.HttpParserError as exc:
            if not self._rejected:
                self._reject(BadRequest(f"malformed HTTP request: {exc}"))
            return False
        return True

    def _feed_lines(self, data: bytes) -> bool:
        """Bytes that may hold an RTSP/ or ICE/ request line: llhttp accepts those protocol names and
        httptools reports only their version, so they would pass for HTTP. Fed one line at a time, so
        that the line ending a request line is known (see _ends_request_line). Only segments holding
        either name, or a head split across reads, come here, so the usual request costs two byte
        scans."""
        tail, self._line_tail = self._line_tail, b""
        tail_opens, self._line_opens = self._line_opens, False
        start, size = 0, len(data)
        while start < size and not self._rejected:
            end = data.find(b"\n", start) + 1 or size
            piece = data[start:end]
            url, message = self._url, self._headers
            if not self._parse(piece, data[end:]):
                return False
            if piece[-1:] == b"\n" and self._in_head and self._head_size == len(self._url):
                line = tail + piece if start == 0 else piece
                # The request began in this line (in this piece, or in the kept start of it), perhaps
                # behind a body's last bytes: this line is its request line, from its method on.
                opens = self._headers is not message or (start == 0 and tail_opens)
                at = line.rfind(self._request_opening()) if opens else -1
                if at > 0 and self._line_checked is not self._headers:
                    if not self._request_line_ok(line[at:]):
                        return False
                elif self._ends_request_line(line, self._url is not url) and not self._request_line_ok(line):
                    return False
            start = end
        return True

    def _ends_request_line(self, line: bytes, target_grew: bool) -> bool:
        """Is this complete line, fed whole in a head with no field counted, its request line? It is
        that or the first field line: httptools reports a field only once the next one begins. A line
        in which the target grew holds the request line's end; otherwise one that reads as a field
        (a name, then a colon) is taken for one. (A line the request began in, behind a body's last
        bytes that look like a field, `a:bGET /x`, is known for its request line before this.)"""
        if self._line_checked is self._headers:
            return False
        return target_grew or not _reads_as_field(line)

    def _request_line_ok(self, line: bytes) -> bool:
        """Refuse a whole request line (perhaps after the last bytes of the message before it) that
        llhttp passes but that is not HTTP/1.x: an RTSP/ or ICE/ protocol, or none (HTTP/0.9, which
        ends with its target and has no head to wait for)."""
        self._line_checked = self._headers
        protocol = line.rstrip(b"\r\n").rpartition(b" ")[2]
        if protocol == self._url:
            self._reject(BadRequest("HTTP/0.9 requests are not supported"))
            return False
        if protocol.startswith((b"RTSP/", b"ICE/")):
            name = protocol.partition(b"/")[0].decode("ascii")
            self._reject(BadRequest(f"{name} is not HTTP: this port speaks HTTP/1.1"))
            return False
        return True

    def _check_http09(self, data: bytes, tail: bytes, began: bool) -> bool:
        """A head still open, with no field counted: has its request line ended without a protocol?
        llhttp gives no sign before the head ends (it reports 0.0 on a fresh parser, and the previous
        message's version on a kept-alive one), so the line itself is read: the last complete line,
        or the one before when the last reads as a field. Where the two readings could differ, the
        end of the head decides. `tail` is what an earlier read brought of the last line (a head's
        segments without a line end are held, so a line is split in two at most).

        `began`: the request began in this read, perhaps right behind a body that did not end with a
        line end, whose last bytes then start the request line's line. True when the request line may
        still be open at the end of `data` (its start is then in what _feed keeps of the last line)."""
        url = self._url
        if self._line_checked is self._headers:
            return False
        end = data.rfind(b"\n")
        if end < 0 or url in data[end + 1 :]:
            return True  # the request line is still open (or may be)
        start = data.rfind(b"\n", 0, end) + 1
        line = data[start:end] if start else tail + data[:end]
        if _reads_as_field(line):
            before = data.rfind(b"\n", 0, start - 1) + 1
            if began:
                # The request line is this line, behind a body's last bytes, or the one before it
                # (this line is then its first field): where the one before cannot be it, this is.
                opening = self._request_opening()
                if not start or opening not in data[before : start - 1]:
                    at = line.rfind(opening)
                    if at > 0:
                        self._request_line_ok(line[at:])
                return False
            if not start or b" " + url in line:
                return False  # the request line is in an earlier read, or this may be it behind a body
            line = data[before : start - 1] if before else tail + data[: start - 1]
        self._request_line_ok(line)
        return False

    def _request_opening(self) -> bytes:
        """What the request line being parsed begins with: its method and target (no space within)."""
        return self._parser.get_method() + b" " + self._url

    def _upgrade(self, rest: bytes) -> None:
        """llhttp stopped at a request offering Upgrade (h2c, websocket). The router never switches
        protocols (RFC 9110 §7.8 lets a server ignore Upgrade), so the request is parsed again without
        the offer, body and all, and the connection goes on as HTTP/1.1."""
        if self._rejected:
            return
        method = self._parser.get_method()
        if method == b"CONNECT":
            # A tunnel request: answered (refused) as HTTP/1.1; nothing after it is HTTP.
            self._upgraded = True
            upgrading = self._queue[-1] if self._queue else self._current
            if upgrading is not None:
                upgrading.keep_alive = False
            else:
                self._reject(BadRequest("protocol upgrade without a complete request"))
            return
        version = self._parser.get_http_version().encode("latin-1")
        lines = [b"%s %s HTTP/%s\r\n" % (method, self._url, version)]
        for name, value in self._headers:
            if name == b"upgrade":
                continue
            if name == b"connection":
                tokens = [t for t in value.split(b",") if t.strip().lower() not in (b"upgrade", b"")]
                if not tokens:
                    continue
                value = b",".join(tokens)
            lines.append(b"%s: %s\r\n" % (name, value))
        lines.append(b"\r\n")
        self._parser = httptools.HttpRequestParser(self)
        self._feed(b"".join(lines) + rest)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_budget_timer()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self._listener.connections.discard(self)
        self.closing = True
        self._drop_parsed_body()
        for queued in self._queue:
            queued.release_budget()
        self._queue.clear()
        current = self._current
        if current is not None and not current.complete:
            current.client_gone = True
            if self._task is not None:
                self._task.cancel()
        if current is not None and current.flow is not None:
            current.flow.resume_reading()

    def eof_received(self) -> bool | None:
        if self._lingering and self.transport is not None:
            self.transport.close()  # the client finished sending: the lingering close is over
        return None

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
        self._trailer_size = 0
        self._in_head = True
        self._chunked = False
        self._expect_continue = False
        if self._current is None:
            self._arm(self._limits.head_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + 4
        if not self._in_head:
            # A chunked body's trailer field: counted like a header, never a header of the request.
            self._trailer_size += size
            if self._trailer_size > self._limits.max_head_bytes and not self._rejected:
                self._reject(HeadersTooLarge(f"request trailer over {self._limits.max_head_bytes} bytes"))
            return
        self._count(size)
        if b"_" in name and not self._limits.underscores_in_headers:
            # nginx's underscores_in_headers off: servers and frameworks that map header names to
            # CGI-style variables read X_Tenant and X-Tenant as one name, so a client could pass for a
            # header the router sets or trusts.
            return
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._rejected:
            return
        declared = -1
        hosts = 0
        host = b""
        codings: list[bytes] = []
        expect = b""
        for name, value in self._headers:  # one pass: this runs for every request
            if name == b"content-length":
                declared = int(value)  # llhttp has checked it: digits only, one value
            elif name == b"host":
                hosts += 1
                host = value
            elif name == b"transfer-encoding":
                codings.append(value)
            elif name == b"expect":
                expect = value
        error = self._head_error(hosts, host, codings)
        if error is None and not self._url.startswith(b"/"):
            error = self._to_origin_form(hosts)
        if error is not None:
            self._reject(error)
            return
        self._expect_continue = self._http_11 and expect.lower() == b"100-continue"
        limit = self._limits.max_body_bytes
        if declared > limit:
            self._reject(BodyTooLarge(f"request body of {declared} bytes is over the limit of {limit} bytes"))
            return
        self._length = declared
        if declared > 0 or self._chunked:
            self._in_body = True
            self._last_body = self._loop.time()
            if declared > 0 and not self.budget.take(declared):
                self._wait_for_budget(declared)
                return
            self._reserved = max(declared, 0)
            self._body_may_come()
        elif self._current is None:
            self._disarm()

    def _head_error(self, hosts: int, host: bytes, codings: list[bytes]) -> RouterError | None:
        """What RFC 9112 (and nginx, where it leaves room) refuses in a head llhttp accepted."""
        version = self._parser.get_http_version()
        self._http_11 = version == "1.1"
        if not self._http_11 and version != "1.0":
            if version.startswith("0."):
                return BadRequest("HTTP/0.9 requests are not supported")
            return VersionNotSupported(f"HTTP/{version} is not supported on this port; use HTTP/1.1")
        if hosts > 1 or (hosts == 0 and self._http_11):
            return BadRequest("an HTTP/1.1 request needs exactly one Host header")
        if hosts and not _host_ok(host):
            return BadRequest("invalid Host header")
        if not codings:
            return None
        if not self._http_11:
            # RFC 9112 §6.1: chunked framing from an HTTP/1.0 client cannot be trusted (nginx: 400).
            return BadRequest("Transfer-Encoding in an HTTP/1.0 request")
        tokens = [t.strip().lower() for v in codings for t in v.split(b",")]
        if tokens != [b"chunked"]:
            return NotImplementedHere("only Transfer-Encoding: chunked is supported for request bodies")
        self._chunked = True
        return None

    def _to_origin_form(self, hosts: int) -> RouterError | None:
        """An absolute-form target (RFC 9112 §3.2.2: a server MUST accept it), taken as nginx takes it:
        the request goes on in origin form (`/` for an empty path), and its Host is the target's
        authority, whatever the Host header said (§3.2.2: the header is ignored). So routing, the
        local routes and the backend see the same request as for `GET /path`. CONNECT's authority
        form and OPTIONS' asterisk form are left as they are: the handler refuses both."""
        url = self._url
        if url == b"*" or self._parser.get_method() == b"CONNECT":
            return None
        scheme, sep, rest = url.partition(b"://")
        if not sep or scheme.lower() not in (b"http", b"https"):
            return BadRequest("the request target must be a path, or an http:// or https:// URI")
        cut = len(rest)
        for mark in (b"/", b"?", b"#"):  # RFC 3986 §3.2: what ends an authority
            at = rest.find(mark)
            if 0 <= at < cut:
                cut = at
        authority, path = rest[:cut], rest[cut:]
        if not _authority_ok(authority):
            return BadRequest("invalid authority in the request target")
        self._url = path if path.startswith(b"/") else b"/" + path
        if hosts:
            self._headers = [(n, authority if n == b"host" else v) for n, v in self._headers]
        else:
            self._headers.append((b"host", authority))  # HTTP/1.0 may send none
        return None

    def _body_may_come(self) -> None:
        """The body's budget is held: arm its timer, and send the 100 Continue if this is current."""
        if self._current is None and not self._queue:
            self._arm(self._limits.body_timeout_s, self._body_timed_out)
            if self._expect_continue:
                self._expect_continue = False
                self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _wait_for_budget(self, need: int) -> None:
        self._awaiting_budget = True
        self.budget.wait(self, need)
        self._set_reading(False)
        self._stop_budget_timer()
        self._budget_timer = self._loop.call_later(self._limits.body_budget_wait_s, self._budget_timed_out)

    def _stop_budget_timer(self) -> None:
        if self._budget_timer is not None:
            self._budget_timer.cancel()
            self._budget_timer = None

    def budget_granted(self, taken: int) -> None:
        """Called by the budget: `taken` bytes are now held for the body that waited."""
        self._awaiting_budget = False
        self._stop_budget_timer()
        ex, self._budget_ex = self._budget_ex, None
        if ex is not None:
            ex.waiting = False
            ex._reserved += taken
        else:
            self._reserved += taken
        if self.transport is None or self.transport.is_closing():
            if ex is not None:
                ex.release_budget()
            self._drop_parsed_body()
            return
        self._set_reading(True)
        if ex is not None:
            if self._current is None:
                self._next()
        elif self._in_body:
            self._last_body = self._loop.time()
            self._body_may_come()

    def _budget_timed_out(self) -> None:
        self._budget_timer = None
        if not self._awaiting_budget:
            return
        ex, self._budget_ex = self._budget_ex, None
        if ex is not None:
            # The refused request and anything pipelined after it leave the queue; what came before
            # it is still answered, then the 503.
            while self._queue:
                dropped = self._queue.pop()
                dropped.release_budget()
                if dropped is ex:
                    break
        self._reject(Overloaded("the router holds its maximum of buffered request bodies"))

    def on_chunk_header(self) -> None:
        self._maybe_trailer = True

    def on_chunk_complete(self) -> None:
        self._maybe_trailer = False

    def on_body(self, body: bytes) -> None:
        self._maybe_trailer = False
        if self._rejected:
            return
        self._body_size += len(body)
        limit = self._limits.max_body_bytes
        if self._body_size > limit:
            self._reject(BodyTooLarge(f"request body is over the limit of {limit} bytes"))
            return
        self._body.append(body)
        self._last_body = self._loop.time()
        if self._chunked:
            self.budget.force(len(body))
            self._reserved += len(body)
            if self.budget.over and not self._awaiting_budget:
                self._wait_for_budget(0)

    def on_message_complete(self) -> None:
        self._maybe_trailer = False
        if self._rejected:
            return
        self._in_body = False
        if self._parser.should_upgrade() and self._parser.get_method() != b"CONNECT":
            return  # parsed again without the offer (_upgrade), body and all
        parser = self._parser
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        ex = Http1Exchange(
            self,
            parser.get_method().decode("latin-1"),
            self._url,
            self._headers,
            body,
            self._http_11,
            parser.should_keep_alive(),
            self._reserved,
        )
        self._reserved = 0
        self._queue.append(ex)
        if self._awaiting_budget:
            ex.waiting = True  # answered in turn once the budget has room for its body
            self._budget_ex = ex
        if self._current is None:
            self._next()
        elif len(self._queue) >= _MAX_QUEUED:
            self._set_reading(False)

    def _set_reading(self, on: bool) -> None:
        if on != self._reading and self.transport is not None and not self.transport.is_closing():
            self._reading = on
            if on:
                self.transport.resume_reading()
            else:
                self.transport.pause_reading()

    def _drop_parsed_body(self) -> None:
        self._body = []
        if self._awaiting_budget and self._budget_ex is None:
            self.budget.forget(self)
            self._awaiting_budget = False
        if self._reserved:
            self.budget.release(self._reserved)
            self._reserved = 0

    # -- one request at a time -------------------------------------------------------------------

    def _next(self) -> None:
        if self._queue and self._queue[0].waiting:
            return  # its body waits for budget: budget_granted() comes back here
        if not self._queue:
            if self._refusal is not None:
                self._send_refusal(self._refusal)
                return
            if not self._awaiting_budget:
                self._set_reading(True)
            if self._in_head:
                self._arm(self._limits.head_timeout_s, self._head_timed_out)
            elif self._awaiting_budget:
                self._disarm()  # the budget's own timer bounds the wait
            elif self._in_body:
                self._body_may_come()  # a pipelined body: its 100 Continue is owed now
            else:
                self._arm(self._limits.keepalive_timeout_s, self._idle_timed_out)
            return
        self._disarm()
        ex = self._queue.popleft()
        self._current = ex
        self._task = self._loop.create_task(self._run(ex))

    async def _run(self, ex: Http1Exchange) -> None:
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
                ex.respond(*self._listener.render_error(InternalError("internal error in the router")))
        finally:
            ex.release_budget()
            if access is not None:
                access.answered(ex, time.perf_counter() - started)
            self._finished(ex)

    def _finished(self, ex: Http1Exchange) -> None:
        self._current = None
        self._task = None
        ex.flow = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not ex.complete:
            # An unfinished response (a broken stream) can only be ended by closing: the client sees
            # a truncated body rather than a made-up end.
            transport.close()
            return
        if not ex.keep_alive or self.closing:
            # The last answer on this connection. Whatever the client pipelined after it is read and
            # dropped while the close lingers: closing on unread input would reset the connection and
            # the client could lose the answers already sent.
            self._rejected = True
            self._refusal = None
            self._linger()
            return
        self._next()

    # -- limits ----------------------------------------------------------------------------------

    def _count(self, n: int) -> None:
        self._head_size += n
        if self._head_size > self._limits.max_head_bytes and not self._rejected:
            self._reject(HeadersTooLarge(f"request head over {self._limits.max_head_bytes} bytes"))

    def _reject(self, error: RouterError) -> None:
        """Refuse the request being read: nothing more is parsed on this connection. The requests
        queued before it are answered first, in order; then the refusal, then a lingering close."""
        self._rejected = True
        self._held = bytearray()
        self._in_head = self._in_body = self._maybe_trailer = False
        self._drop_parsed_body()
        self._disarm()
        self._stop_budget_timer()
        if self._current is not None or self._queue:
            self._refusal = error
            self._set_reading(False)  # resumed, to linger, once the refusal is sent
            return
        self._send_refusal(error)

    def _send_refusal(self, error: RouterError) -> None:
        self._refusal = None
        status, headers, body = self._listener.render_error(error)
        if self._listener.access_log is not None:
            self._listener.access_log.refused(self.client_ip, self._url, status)
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
        head += [b"%s: %s\r\n" % (n, v) for n, v in headers if n != b"connection"]
        head.append(b"connection: close\r\n\r\n")
        self.write(b"".join(head) + body)
        self._linger()

    def _linger(self) -> None:
        """Shut the write side after the answer, then read and drop what the client still sends, for
        a bounded time and number of bytes (nginx's lingering close): closing with unread input would
        reset the connection, and the client's kernel would discard the answer before it is read."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._lingering = True
        self._linger_until = self._loop.time() + _LINGER_TOTAL_S
        self._set_reading(True)
        self._arm(_LINGER_IDLE_S, self._linger_over)

    def _discard(self, n: int) -> None:
        if not self._lingering:
            return  # a refusal waits behind queued requests (reading is paused), or a CONNECT tail
        self._linger_bytes += n
        if self._linger_bytes > _LINGER_MAX_BYTES or self._loop.time() > self._linger_until:
            self._linger_over()
        else:
            left = max(0.0, self._linger_until - self._loop.time())
            self._arm(min(_LINGER_IDLE_S, left), self._linger_over)

    def _linger_over(self) -> None:
        self._timer = None
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
        if not self._in_body or self._awaiting_budget:
            return
        left = self._last_body + self._limits.body_timeout_s - self._loop.time()
        if left > 0:
            self._arm(left, self._body_timed_out)
            return
        self._reject(RequestTimeout(f"no request body bytes within {self._limits.body_timeout_s:g} s"))

    @property
    def busy(self) -> bool:
        """A request is being answered, queued, or its body is still arriving."""
        return self._current is not None or bool(self._queue) or self._in_body or self._awaiting_budget

    def shut_down(self) -> None:
        """Stop after the current response; an idle connection closes now."""
        self.closing = True
        if not self.busy and self.transport is not None:
            self.transport.close()


def _reads_as_field(line: bytes) -> bool:
    """A field name then a colon: a request line has a space (after its method) before any colon."""
    colon = line.find(b":")
    return colon > 0 and b" " not in line[:colon] and b"\t" not in line[:colon]


def _host_ok(host: bytes) -> bool:
    # translate() deletes the allowed bytes in C: anything left over is a byte Host may not hold
    return bool(host) and not host.translate(None, _HOST_BYTES) and b".." not in host


def _authority_ok(authority: bytes) -> bool:
    """host[:port] of an http(s) URI: a reg-name, IPv4 or IP-literal host, never empty, and digits
    (or nothing) for the port. No userinfo: RFC 9110 §4.2.4 has a recipient treat it as an error."""
    if not _host_ok(authority):
        return False
    if authority.startswith(b"["):
        host, bracket, port = authority.partition(b"]")
        if not bracket or len(host) < 2 or b"[" in host[1:]:
            return False
        if port and not port.startswith(b":"):
            return False
        port = port[1:]
    else:
        host, _, port = authority.partition(b":")
        if not host or b"[" in host or b"]" in host:
            return False
    return not port or port.isdigit()


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
        self.budget = BodyBudget(limits.max_buffered_body_bytes)
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
