"""The only HTTP client of the data path: one aiohttp session for the process.

aiohttp rather than httpx because, measured on this machine, a relay on httpx's pool collapsed under
concurrency (340 req/s at 64 connections, 3+ ms CPU per request) where aiohttp's made ~7.7k req/s
(see README, "Why aiohttp"). Pool limits and timeouts are explicit; library exceptions are mapped to
errors.UpstreamError subclasses here and nowhere else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
from yarl import URL

from prefix_router.errors import ConnectFailed, FirstByteTimeout, NoAnswer, StreamBroken, StreamIdleTimeout
from prefix_router.settings import UpstreamSettings

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


def request_headers(
    raw: Sequence[tuple[bytes, bytes]], client_ip: str | None, scheme: str
) -> list[tuple[str, str]]:
    """The client's headers minus hop-by-hop ones, with X-Forwarded-For/-Proto set. One pass; the
    fields a Connection header names (rare) are dropped afterwards."""
    out: list[tuple[str, str]] = []
    forwarded_for: str | None = None
    connection: bytes | None = None
    for name, value in raw:
        if name in _REQUEST_DROP:
            if name == b"connection":
                connection = value if connection is None else connection + b"," + value
            continue
        if name == b"x-forwarded-proto":
            continue
        if name == b"x-forwarded-for":
            forwarded_for = value.decode("latin-1")
            continue
        out.append((name.decode("latin-1"), value.decode("latin-1")))
    if connection is not None:
        named = _named_in_connection([(b"connection", connection)])
        if named:
            out = [(n, v) for n, v in out if n.encode("latin-1") not in named]
    if client_ip:
        forwarded_for = f"{forwarded_for}, {client_ip}" if forwarded_for else client_ip
    if forwarded_for:
        out.append(("X-Forwarded-For", forwarded_for))
    out.append(("X-Forwarded-Proto", scheme))
    return out


def response_headers(raw: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The backend's headers minus hop-by-hop ones; names lower-cased for ASGI."""
    drop = _RESPONSE_DROP | _named_in_connection([(n.lower(), v) for n, v in raw])
    return [(name.lower(), value) for name, value in raw if name.lower() not in drop]


class UpstreamResponse:
    """A backend's response whose body is read chunk by chunk, each within the idle timeout."""

    __slots__ = ("_idle_s", "_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse, idle_s: float) -> None:
        self._resp = resp
        self._idle_s = idle_s
        self.status = resp.status
        self.headers = response_headers(resp.raw_headers)

    async def next_chunk(self) -> bytes:
        """The next bytes of the body, b'' at its end; StreamBroken on reset or idle timeout."""
        content = self._resp.content
        try:
            # Bytes already buffered (most bodies, most chunks) need no timer at all.
            data = content.read_nowait()
            if data or content.at_eof():
                return data
            async with asyncio.timeout(self._idle_s):
                return await content.readany()
        except TimeoutError as exc:
            raise StreamIdleTimeout(f"no chunk within {self._idle_s:g} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise StreamBroken(f"stream broken: {type(exc).__name__}") from exc

    def finish(self) -> None:
        """Body fully read: the connection goes back to the pool."""
        self._resp.release()

    def abort(self) -> None:
        """Close the connection at once, so the backend sees the client leave and stops generating."""
        self._resp.close()


class Upstream:
    def __init__(self, settings: UpstreamSettings) -> None:
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        s = self._settings
        connector = aiohttp.TCPConnector(
            limit=s.max_connections,
            limit_per_host=s.max_connections_per_backend,
            keepalive_timeout=s.keepalive_timeout_s,
            ttl_dns_cache=10,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout_s),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not awaited")
        return self._session

    def pool_in_use(self) -> int:
        """Connections checked out of the pool (for leak checks)."""
        connector = self.session.connector
        if connector is None:
            return 0
        return sum(len(v) for v in connector._acquired_per_host.values())

    async def fetch(self, url: str, timeout_s: float) -> tuple[int, bytes] | None:
        """GET a side URL of a backend (health, metrics): (status, body), or None if it failed."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self.session.get(url, allow_redirects=False) as resp:
                    return resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    async def send(
        self,
        method: str,
        url: URL,
        headers: list[tuple[str, str]],
        body: bytes,
        first_byte_timeout_s: float | None,
    ) -> UpstreamResponse:
        """Send a request and wait for the response head; errors mapped to the UpstreamError tree."""
        timeout = (
            self._settings.first_byte_timeout_s if first_byte_timeout_s is None else first_byte_timeout_s
        )
        try:
            async with asyncio.timeout(timeout):
                resp = await self.session.request(
                    method, url, headers=headers, data=body or None, allow_redirects=False, compress=None
                )
        except aiohttp.ServerTimeoutError as exc:
            # aiohttp's connect timeout; it subclasses TimeoutError, so it must be caught first.
            raise ConnectFailed("connect timed out") from exc
        except TimeoutError as exc:
            raise FirstByteTimeout(f"no response within {timeout:g} s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(f"connect failed: {type(exc).__name__}") from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
            raise NoAnswer(f"backend closed the connection: {type(exc).__name__}") from exc
        except aiohttp.ClientResponseError as exc:  # unparsable response head
            raise NoAnswer(f"invalid response from backend: {exc.message}") from exc
        except aiohttp.ClientError as exc:
            raise NoAnswer(f"upstream error: {type(exc).__name__}") from exc
        return UpstreamResponse(resp, self._settings.stream_idle_timeout_s)
