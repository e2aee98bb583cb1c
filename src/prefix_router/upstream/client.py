"""The only HTTP client of the router: requests to backends over pooled HTTP/1.1 connections.

Our own client (upstream/pool.py, upstream/http1.py) rather than aiohttp's or httpx's: measured on this
machine, httpx's pool collapsed under concurrency (340 req/s at 64 connections, 3+ ms CPU per request),
and aiohttp's client was the largest single cost of a proxied request (README, "Why our own HTTP/1.1").
Pool limits and timeouts are explicit; failures are errors.UpstreamError subclasses, mapped here and
nowhere else.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

from prefix_router.errors import FirstByteTimeout, UpstreamError
from prefix_router.upstream.config import UpstreamConfig
from prefix_router.upstream.http1 import BodySink, Connection, Origin, StaleConnection
from prefix_router.upstream.pool import CONNECT_GRACE_S, ConnectionBudget, Pool, abandon

T = TypeVar("T")

# RFC 9110 §7.6.1 hop-by-hop fields, plus what the relay re-frames itself.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
_RESPONSE_DROP = HOP_BY_HOP


def _named_in_connection(headers: Sequence[tuple[bytes, bytes]]) -> frozenset[bytes]:
    named: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            named.update(token.strip().lower() for token in value.split(b",") if token.strip())
    return frozenset(named)


def request_headers(raw: Sequence[tuple[bytes, bytes]], client_ip: str | None, scheme: str) -> bytes:
    """The client's headers minus hop-by-hop ones, with X-Forwarded-For/-Proto set, as the lines of a
    request head. One pass; the fields a Connection header names (rare) are dropped afterwards."""
    out: list[tuple[bytes, bytes]] = []
    forwarded_for: bytes | None = None
    connection: bytes | None = None
    for name, value in raw:
        if name in _REQUEST_DROP:
            if name == b"connection":
                connection = value if connection is None else connection + b"," + value
            continue
        if name == b"x-forwarded-proto":
            continue
        if name == b"x-forwarded-for":
            forwarded_for = value if forwarded_for is None else forwarded_for + b", " + value
            continue
        out.append((name, value))
    if connection is not None:
        named = _named_in_connection([(b"connection", connection)])
        if named:
            out = [(n, v) for n, v in out if n not in named]
    if client_ip:
        ip = client_ip.encode("latin-1")
        forwarded_for = forwarded_for + b", " + ip if forwarded_for else ip
    if forwarded_for:
        out.append((b"x-forwarded-for", forwarded_for))
    out.append((b"x-forwarded-proto", scheme.encode("latin-1")))
    return b"".join([b"%s: %s\r\n" % pair for pair in out])


def response_headers(raw: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The backend's headers minus hop-by-hop ones, names lower-cased."""
    drop = _RESPONSE_DROP | _named_in_connection([(n.lower(), v) for n, v in raw])
    return [(name.lower(), value) for name, value in raw if name.lower() not in drop]


_BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})
_JSON_HEADER = b"content-type: application/json\r\n"
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"PUT", b"DELETE", b"OPTIONS"})  # RFC 9110 §9.2.2


# A side request's deadline is checked this many times over its timeout: how late each check comes is
# the time the loop was stalled, which is not counted against the backend.
_DEADLINE_CHECKS = 8


async def wait_for_awake(task: asyncio.Future[T], timeout_s: float) -> T:
    """`task`'s result, or TimeoutError (the task cancelled) after `timeout_s` of time in which the loop
    was awake. The deadline is read on the loop's clock, which a stalled loop reads late: the
    backend's answer (or the kernel's connect) that came during a stall is seen only after it, in the
    turn the timer fires. So the deadline is checked in steps, and what each check comes late (the
    loop's stall) is given back; after the last, one more poll of the sockets (CONNECT_GRACE_S). With
    the loop on time, a backend that does not answer fails at `timeout_s`, as with a plain timeout."""
    left = timeout_s
    step_s = timeout_s / _DEADLINE_CHECKS
    try:
        while left > 0:
            step = min(step_s, left)
            await asyncio.wait((task,), timeout=step)
            if task.done():
                return task.result()
            left -= step  # a late check's lateness is not taken off: the loop was not awake
        await asyncio.wait((task,), timeout=CONNECT_GRACE_S)
        if task.done():
            return task.result()
        raise TimeoutError
    finally:
        abandon(task)  # returned: a no-op; left early (timeout, or the caller cancelled): given up


class UpstreamResponse:
    """A backend's answer: status and headers now, the body pushed to a sink as it arrives."""

    __slots__ = ("_conn", "_done", "_idle_s", "_pool", "headers", "status")

    def __init__(self, conn: Connection, pool: Pool, idle_s: float) -> None:
        self._conn = conn
        self._pool = pool
        self._idle_s = idle_s
        self._done = False
        self.status = conn.status
        self.headers = response_headers(conn.raw_headers)

    @property
    def broken(self) -> UpstreamError | None:
        """Why the answer already failed, before any of its body was handed on: its head and a body
        the parser refused came in one read. Nothing of it has reached the client yet."""
        conn = self._conn
        return conn.error if not conn.has_body_bytes() else None

    async def pipe(
        self,
        sink: BodySink,
        on_first: Callable[[], None] | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        """Hand every body chunk to `sink` (synchronously, from the socket's callback) until the end;
        StreamBroken on reset, StreamIdleTimeout after the idle timeout without a chunk. `on_wait`
        runs once if the body has to be waited for (a stream: send the head ahead of it)."""
        conn = self._conn
        conn.attach_body_sink(sink, on_first)
        try:
            if conn.is_answered():
                return
            if conn.error is not None:
                raise conn.error
            if on_wait is not None:
                on_wait()
            conn.watch_idle(self._idle_s)
            await conn.wait_end()
        finally:
            conn.unwatch_idle()
            conn.detach_body_sink()

    async def read(self) -> bytes:
        chunks: list[bytes] = []
        await self.pipe(chunks.append)
        return b"".join(chunks)

    def pause_reading(self) -> None:
        self._conn.pause_reading()

    def resume_reading(self) -> None:
        self._conn.resume_reading()

    def finish(self) -> None:
        """Body fully read: the connection goes back to the pool."""
        if not self._done:
            self._done = True
            self._conn.resume_reading()
            self._pool.release(self._conn)

    def abort(self) -> None:
        """Close the connection at once, so the backend sees the client leave and stops generating."""
        if not self._done:
            self._done = True
            self._conn.close()
            self._pool.release(self._conn)


class Upstream:
    def __init__(self, settings: UpstreamConfig) -> None:
        self._settings = settings
        self._pools: dict[str, Pool] = {}
        self._budget = ConnectionBudget(settings.max_connections)
        self._retired: list[Pool] = []  # forgotten pools whose last requests are still running
        self._ssl: ssl.SSLContext | None = None
        self._open = False

    async def start(self) -> None:
        self._open = True

    async def close(self) -> None:
        self._open = False
        for pool in [*self._pools.values(), *self._retired]:
            pool.close()
        self._pools.clear()
        self._retired.clear()
        self._budget.pools.clear()

    def forget(self, origin: str) -> None:
        """A backend left the fleet: its idle connections close; busy ones finish, then close idle."""
        pool = self._pools.pop(origin, None)
        if pool is not None:
            self._budget.pools.remove(pool)
            pool.retired = True
            while pool.idle:
                pool.idle.pop().close()
            if pool.busy:
                self._retired.append(pool)

    def pool_in_use(self) -> int:
        """Connections checked out of the pools (for leak checks)."""
        self._retired = [p for p in self._retired if p.busy]
        return sum(len(p.busy) for p in [*self._pools.values(), *self._retired])

    def _pool(self, origin: str) -> Pool:
        pool = self._pools.get(origin)
        if pool is None:
            if not self._open:
                raise RuntimeError("Upstream.start() was not awaited")
            s = self._settings
            parsed = Origin.parse(origin)
            context = None
            if parsed.scheme == "https":
                if self._ssl is None:
                    self._ssl = ssl.create_default_context()
                context = self._ssl
            pool = Pool(
                parsed,
                asyncio.get_running_loop(),
                limit=s.max_connections_per_backend,
                keepalive_s=s.keepalive_timeout_s,
                connect_timeout_s=s.connect_timeout_s,
                ssl_context=context,
                budget=self._budget,
            )
            self._pools[origin] = pool
            self._budget.pools.append(pool)
        return pool

    async def fetch(
        self, url: str, timeout_s: float, json_body: bytes | None = None
    ) -> tuple[int, bytes] | None:
        """GET a side URL of a backend (health, metrics), or POST it `json_body`: (status, body), or
        None if it failed.

        `timeout_s` is counted in time the loop was awake to see an answer (wait_for_awake): a probe
        the backend answered while the router's loop was stalled is answered, not timed out."""
        parts = urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        getting = asyncio.ensure_future(
            self._fetch_whole(f"{parts.scheme}://{parts.netloc}", target.encode("latin-1"), json_body)
        )
        try:
            return await wait_for_awake(getting, timeout_s)
        except (TimeoutError, UpstreamError):
            return None

    async def _fetch_whole(self, origin: str, target: bytes, json_body: bytes | None) -> tuple[int, bytes]:
        # No first-byte timer of its own (the default is minutes): the caller's deadline is the one.
        if json_body is None:
            resp = await self.send("GET", origin, target, b"", b"", side=True)
        else:
            resp = await self.send("POST", origin, target, _JSON_HEADER, json_body, side=True)
        try:
            body = await resp.read()
        except BaseException:
            resp.abort()
            raise
        resp.finish()
        return resp.status, body

    async def send(
        self,
        method: str,
        origin: str,
        target: bytes,
        header_lines: bytes,
        body: bytes,
        first_byte_timeout_s: float | None = None,
        side: bool = False,
    ) -> UpstreamResponse:
        """Send a request to `origin` (scheme://host:port) and wait for the response head.

        `header_lines` are the request's own headers as `name: value\\r\\n` lines; Host and
        Content-Length are set here. A kept-alive connection found closed before the request went out
        is replaced by a fresh one; one that closed after it without a byte of answer (the backend's
        idle close racing the request) is retried once on a fresh one for idempotent methods only
        (RFC 9112 §9.3.1): a POST the backend may have read is never sent twice."""
        s = self._settings
        timeout = s.first_byte_timeout_s if first_byte_timeout_s is None else first_byte_timeout_s
        pool = self._pool(origin)
        m = method.encode("latin-1")
        head = b"%s %s HTTP/1.1\r\nhost: %s\r\n%s" % (m, target, pool.origin.host_header, header_lines)
        if body or m in _BODY_METHODS:
            head += b"content-length: %d\r\n" % len(body)
        data = head + b"\r\n" + body
        for attempt in (0, 1):
            conn = await pool.acquire(fresh=attempt > 0, side=side)
            try:
                conn.start(data, head_only=m == b"HEAD")
                if not conn.has_head():
                    await self._wait_head(conn, timeout)
            except StaleConnection as exc:
                pool.release(conn)
                if attempt == 0 and (not exc.sent or m in _IDEMPOTENT):
                    continue
                raise
            except BaseException:
                conn.close()
                pool.release(conn)
                raise
            return UpstreamResponse(conn, pool, s.stream_idle_timeout_s)
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    async def _wait_head(conn: Connection, timeout_s: float) -> None:
        fut = conn.wait_head()
        loop = asyncio.get_running_loop()

        def expire() -> None:
            if not conn.has_head():
                conn.fail(FirstByteTimeout(f"no response within {timeout_s:g} s"))

        timer = loop.call_later(timeout_s, expire)
        try:
            await fut
        finally:
            timer.cancel()
