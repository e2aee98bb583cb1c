"""HTTP/1.1 connections to backends, kept alive in one pool per backend origin.

A purpose-built client on asyncio protocols and httptools' (llhttp's) response parser. The data path
used aiohttp's client until measurement showed it was the largest single cost of a proxied request
(README, "Why our own HTTP/1.1"); a relay needs only a small part of a general client: one request at
a time per connection, bytes in, bytes out, and body chunks pushed to a sink as they arrive.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

from prefix_router.errors import ConnectFailed, NoAnswer, StreamBroken, StreamIdleTimeout, UpstreamError
from prefix_router.tcp import set_nodelay
from prefix_router.waiters import wake_first

BodySink = Callable[[bytes], None]
_NO_BODY_STATUSES = frozenset({204, 304})
MAX_HEAD_BYTES = 65536  # a backend's response head; over it the answer is refused (nginx: 4-8 KB buffers)
# Also the bound on bytes read without a body byte among them (a head, chunk framing, a trailer
# section): httptools hands a field over only once it ends, so a field that never ends is counted here.


class _Refused(Exception):
    """Raised from a parser callback to stop parsing an answer the router refuses (the parser
    re-raises it as HttpParserCallbackError; the reason travels in Connection.refusal)."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a backend listens, and the Host header its requests carry."""

    scheme: str
    host: str  # as connect() takes it: no brackets around IPv6
    port: int
    host_header: bytes

    @classmethod
    def parse(cls, origin: str) -> Origin:
        parts = urlsplit(origin)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname or "", port, parts.netloc.encode("latin-1"))


def frames_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the body's end is known without the connection closing (RFC 9112 §6.3): with
    Transfer-Encoding, only when chunked is the final coding of the list its fields make (`chunked,
    gzip` runs to the close, as llhttp reads it); without it, when there is a Content-Length."""
    codings: list[bytes] = []
    has_length = False
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"transfer-encoding":
            codings += [c.strip().lower() for c in value.split(b",") if c.strip()]
        elif lowered == b"content-length":
            has_length = True
    if codings:
        return codings[-1] == b"chunked"
    return has_length


class StaleConnection(UpstreamError):
    """A kept-alive connection closed before any byte of the answer: the request may be resent once."""

    kind = "no_answer"


class Connection(asyncio.Protocol):
    """One TCP connection to a backend, carrying one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self.last_data = 0.0
        self.counted = False  # against the ConnectionBudget, until it closes
        self.reading_paused = False
        self._idle_s = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._bytes_since_body = 0
        self.refusal: str | None = None
        self.head_done = False
        self.complete = False
        self.keep_alive = True
        self._head_only = False
        self._has_length = False
        self.error: UpstreamError | None = None
        self.buffered: list[bytes] = []
        self.sink: BodySink | None = None
        self.on_first: Callable[[], None] | None = None
        self.got_body = False
        self.waiter: asyncio.Future[None] | None = None
        self._got_bytes = False
        self.wrote = False

    # -- the request -----------------------------------------------------------------------------

    def start(self, data: bytes, head_only: bool) -> None:
        self._reset()
        self._head_only = head_only
        if self.closed or self.transport is None or self.transport.is_closing():
            error = StaleConnection if self.reused else NoAnswer
            self.error = error("connection closed before the request was sent")
            return
        self.wrote = True
        self.transport.write(data)

    def wait(self) -> asyncio.Future[None]:
        """A future set when the awaited step (head or body end) is reached or the connection fails."""
        fut = self._loop.create_future()
        if self.error is not None:
            fut.set_exception(self.error)
        self.waiter = fut
        return fut

    def _wake(self) -> None:
        fut = self.waiter
        if fut is not None:
            self.waiter = None
            if not fut.done():
                if self.error is not None:
                    fut.set_exception(self.error)
                else:
                    fut.set_result(None)

    def fail(self, error: UpstreamError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.close()
        self._wake()

    def close(self) -> None:
        self.unwatch_idle()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self._pool.forget(self)

    def pause_reading(self) -> None:
        """The client reads slower than the backend writes: let TCP push back on the backend."""
        if not self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    def watch_idle(self, idle_s: float) -> None:
        """Fail the body when nothing arrived for idle_s, not counting time a slow client held us."""
        self._idle_s = idle_s
        self._idle_timer = self._loop.call_later(idle_s, self._check_idle)

    def unwatch_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self.complete or self.closed:
            return
        now = self._loop.time()
        if self.reading_paused:
            self.last_data = now
        left = self.last_data + self._idle_s - now
        if left > 0:
            self._idle_timer = self._loop.call_at(now + left, self._check_idle)
            return
        self.fail(StreamIdleTimeout(f"no chunk within {self._idle_s:g} s"))

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)

    def data_received(self, data: bytes) -> None:
        if self.complete or self.closed or (self._head_only and self.head_done):
            self.close()  # bytes nobody asked for: the connection cannot be trusted for another request
            return
        self._got_bytes = True
        self.last_data = self._loop.time()
        self._bytes_since_body += len(data)  # on_body sets it back to 0
        error: UpstreamError | None = None
        try:
            self._parser.feed_data(data)
            if self._head_only and self.head_done:
                # llhttp cannot be told that a HEAD answer has no body: a fresh parser reads the next.
                self._parser = httptools.HttpResponseParser(self)
        except httptools.HttpParserUpgrade:
            error = NoAnswer("backend switched protocols unasked")
        except httptools.HttpParserError as exc:
            if self.complete:
                self.close()  # bytes after a whole answer: the answer stands, the connection does not
            elif self.refusal is not None:
                error = StreamBroken(self.refusal) if self.head_done else NoAnswer(self.refusal)
            elif self.head_done:
                error = StreamBroken(f"invalid response body from backend: {exc}")
            else:
                error = NoAnswer(f"invalid response from backend: {exc}")
        if error is None and self._bytes_since_body > MAX_HEAD_BYTES and not self.complete:
            # A head or a trailer section still going past the limit: refused now, not at the
            # first-byte timeout, before the parser holds (and re-copies) any more of it.
            error = self._refuse("trailer section" if self.head_done else "head")
        if self.buffered and self.sink is not None:
            self.flush_body()
        if error is not None:
            self.fail(error)

    def _refuse(self, part: str) -> UpstreamError:
        self.keep_alive = False
        self.refusal = f"backend's response {part} is over {MAX_HEAD_BYTES} bytes"
        return StreamBroken(self.refusal) if self.head_done else NoAnswer(self.refusal)

    def flush_body(self) -> None:
        """Everything one read brought goes to the sink as one piece: one write to the client for
        several SSE events that arrived together, not one per chunk of the backend's framing."""
        assert self.sink is not None
        pieces = self.buffered
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        if not self.got_body:
            self.got_body = True
            if self.on_first is not None:
                self.on_first()
        self.sink(data)

    def connection_lost(self, exc: Exception | None) -> None:
        was_closed = self.closed
        self.closed = True
        self._pool.forget(self)
        if self.complete or (was_closed and self.waiter is None):
            return
        if not self.head_done:
            if self.reused and not self._got_bytes:
                self.fail(StaleConnection("kept-alive connection closed by the backend"))
            else:
                self.fail(NoAnswer("backend closed the connection before answering"))
        elif exc is None and self._close_delimited():
            self.on_message_complete()
        else:
            self.fail(StreamBroken("backend closed the connection mid-body"))

    def pause_writing(self) -> None:  # the request body is bounded by max_body_bytes: buffer it
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.head_done:
            # A second answer to one request: never relayed, and the connection is not reused.
            self.keep_alive = False
            raise _Refused

    def on_header(self, name: bytes, value: bytes) -> None:
        # Head and trailer section each have the budget (_head_bytes restarts at the head's end).
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse("trailer section" if self.head_done else "head")
            raise _Refused
        if not self.head_done:  # a trailer field is not a header of the answer: counted, dropped
            self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status == 101:
            self.refusal = "backend switched protocols (101) to a request that asked for none"
            raise _Refused
        if 100 <= status < 200:  # an interim answer (103 Early Hints): the real one follows
            self.raw_headers = []
            return
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        self._has_length = frames_body(self.raw_headers)
        self.head_done = True
        self._head_bytes = 0
        if self._head_only or status in _NO_BODY_STATUSES:
            self.complete = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._bytes_since_body = 0
        self.buffered.append(body)  # handed on once the read is parsed (flush_body)

    def on_message_complete(self) -> None:
        if not self.head_done:
            return  # the end of an interim 1xx answer
        self.complete = True
        self._wake()

    def _close_delimited(self) -> bool:
        return not self._has_length


@dataclass(slots=True)
class ConnectionBudget:
    """The process-wide bound on open upstream connections (upstream.max_connections), over all pools."""

    limit: int
    pools: list[Pool] = field(default_factory=list)
    open: int = 0
    waiters: collections.deque[asyncio.Future[None]] = field(default_factory=collections.deque)

    def has_room(self) -> bool:
        """Room for one more connection, closing the longest-idle one of any pool if need be."""
        if self.open < self.limit:
            return True
        # Not from a pool someone waits on: its idle connection is theirs.
        holders = [p for p in self.pools if p.idle and not p.has_waiters()]
        if holders:
            conn = min(holders, key=lambda p: p.idle[0].idle_since).idle.popleft()
            self._uncount(conn)  # the room is the caller's: nobody else is woken for it
            conn.close()
        return self.open < self.limit

    def opened(self, conn: Connection) -> None:
        self.open += 1
        conn.counted = True

    def closed(self, conn: Connection) -> None:
        if conn.counted:
            self._uncount(conn)
            self.wake_one()

    def _uncount(self, conn: Connection) -> None:
        if conn.counted:
            conn.counted = False
            self.open -= 1

    def wake_one(self) -> None:
        wake_first(self.waiters)


@dataclass(slots=True)
class Pool:
    """Kept-alive connections to one origin; at most `limit` open at once."""

    origin: Origin
    loop: asyncio.AbstractEventLoop
    limit: int
    keepalive_s: float
    connect_timeout_s: float
    ssl_context: ssl.SSLContext | None
    budget: ConnectionBudget
    idle: collections.deque[Connection] = field(default_factory=collections.deque)
    busy: set[Connection] = field(default_factory=set)
    waiters: collections.deque[asyncio.Future[None]] = field(default_factory=collections.deque)
    retired: bool = False  # its backend left the fleet: connections close when their request ends
    _sweep: asyncio.TimerHandle | None = None

    @property
    def open(self) -> int:
        return len(self.idle) + len(self.busy)

    def has_waiters(self) -> bool:
        return any(not fut.done() for fut in self.waiters)

    async def acquire(self, fresh: bool = False, side: bool = False) -> Connection:
        """A connection for one request. `side` (health probes, load scrapes) is never made to wait
        for room: a router busy at its limits must not read as a fleet of failing backends."""
        woken = False
        while True:
            now = self.loop.time()
            while self.idle and not fresh:
                conn = self.idle.pop()
                if conn.closed or now - conn.idle_since > self.keepalive_s:
                    conn.close()
                    continue
                conn.reused = True
                self.busy.add(conn)
                return conn
            if fresh and self.idle and self.open >= self.limit:
                self.idle.popleft().close()  # a fresh connection may take the place of an idle one
            if side:
                return await self._connect(counted=False)
            below_own = self.open < self.limit
            if below_own and self.budget.has_room():
                return await self._connect()
            fut = self.loop.create_future()
            queue = self.budget.waiters if below_own else self.waiters
            if woken:
                queue.appendleft(fut)  # woken and beaten to it: keep the place in the line
            else:
                queue.append(fut)
            woken = True
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    # Woken, then cancelled: the wake goes on to whoever waits next.
                    if below_own:
                        self.budget.wake_one()
                    else:
                        self._wake_one()
                fut.cancel()
                raise

    async def _connect(self, counted: bool = True) -> Connection:
        o = self.origin
        conn = Connection(self)
        self.busy.add(conn)  # counts against the limits while connecting
        if counted:
            self.budget.opened(conn)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await self.loop.create_connection(
                    lambda: conn,
                    o.host,
                    o.port,
                    ssl=self.ssl_context,
                    server_hostname=o.host if self.ssl_context is not None else None,
                )
        except TimeoutError as exc:
            self.forget(conn)
            raise ConnectFailed("connect timed out") from exc
        except (OSError, ssl.SSLError) as exc:
            self.forget(conn)
            raise ConnectFailed(f"connect failed: {type(exc).__name__}") from exc
        except BaseException:
            self.forget(conn)
            conn.close()
            raise
        return conn

    def release(self, conn: Connection) -> None:
        """Back to the pool if the answer was read whole and both sides keep the connection."""
        self.busy.discard(conn)
        if conn.closed:
            self._wake_one()
            return
        reusable = conn.complete and conn.keep_alive and conn.error is None and not conn.reading_paused
        if reusable and not self.retired:
            conn.idle_since = self.loop.time()
            conn.sink = None
            conn.on_first = None
            self.idle.append(conn)
            if self.has_waiters():
                self._wake_one()  # this pool's own waiter takes it
                return
            if self.budget.waiters:
                self.budget.wake_one()  # at the global limit, an idle connection can make room
            if self._sweep is None:
                self._sweep = self.loop.call_later(self.keepalive_s, self._close_expired)
        else:
            conn.close()
        self._wake_one()

    def forget(self, conn: Connection) -> None:
        """A closed connection leaves the pool, wherever it was."""
        self.budget.closed(conn)
        self.busy.discard(conn)
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        wake_first(self.waiters)

    def _close_expired(self) -> None:
        """Idle connections past keepalive_s are closed, oldest first, not left for the backend to."""
        self._sweep = None
        now = self.loop.time()
        while self.idle and now - self.idle[0].idle_since >= self.keepalive_s:
            self.idle.popleft().close()
        if self.idle:
            self._sweep = self.loop.call_at(self.idle[0].idle_since + self.keepalive_s, self._close_expired)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self.idle) + list(self.busy):
            conn.close()
        self.idle.clear()
        self.busy.clear()
