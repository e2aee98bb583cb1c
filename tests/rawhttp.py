"""Raw HTTP/1.x on the wire, for the tests and the benchmarks: a strict response reader (RFC 9112 §6.3
framing), a request reader for raw backends, request bytes, loopback connections."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


@dataclass
class RawResponse:
    status_line: bytes
    status: int
    headers: list[tuple[str, str]]  # names lower-cased, in wire order
    body: bytes
    framing: str  # "content-length" | "chunked" | "close" | "none"

    def values(self, name: str) -> list[str]:
        return [v for n, v in self.headers if n == name]

    def header(self, name: str) -> str | None:
        got = self.values(name)
        assert len(got) <= 1, f"{name} sent {len(got)} times"
        return got[0] if got else None

    def json(self) -> Any:
        return json.loads(self.body)


async def _line(reader: asyncio.StreamReader) -> bytes:
    line = await reader.readuntil(b"\r\n")
    return line[:-2]


async def read_response(
    reader: asyncio.StreamReader, *, head: bool = False, timeout_s: float = 10.0
) -> RawResponse:
    """One response off the wire, framed as RFC 9112 §6.3 says; 1xx responses are returned as such."""
    async with asyncio.timeout(timeout_s):
        status_line = await _line(reader)
        version, code, *_ = status_line.split(b" ", 2)
        assert version in (b"HTTP/1.0", b"HTTP/1.1"), status_line
        status = int(code)
        headers: list[tuple[str, str]] = []
        while line := await _line(reader):
            name, sep, value = line.partition(b":")
            assert sep and name == name.strip(), f"malformed header line {line!r}"
            headers.append((name.decode("latin-1").lower(), value.strip().decode("latin-1")))
        resp = RawResponse(status_line, status, headers, b"", "none")
        if head or status < 200 or status in (204, 304):
            return resp
        te = resp.values("transfer-encoding")
        cl = resp.values("content-length")
        if te:
            assert not cl, "both Transfer-Encoding and Content-Length in one response"
            assert te[-1].lower() == "chunked", te
            resp.framing = "chunked"
            resp.body = await _read_chunked(reader)
        elif cl:
            assert len(set(cl)) == 1, cl
            resp.framing = "content-length"
            resp.body = await reader.readexactly(int(cl[0]))
        else:
            resp.framing = "close"
            resp.body = await reader.read()
        return resp


@dataclass
class RawRequest:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]  # wire order, wire case
    body: bytes

    def values(self, name: str) -> list[str]:
        return [v for n, v in self.headers if n.lower() == name.lower()]

    def names(self) -> set[str]:
        return {n.lower() for n, _ in self.headers}


async def read_request(reader: asyncio.StreamReader) -> RawRequest | None:
    """One request as a client sent it, or None at a clean EOF between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    lines = head[:-4].split(b"\r\n")
    method, target, version = lines[0].decode("latin-1").split(" ", 2)
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.decode("latin-1"), value.strip().decode("latin-1")))
    req = RawRequest(method, target, version, headers, b"")
    if any("chunked" in v.lower() for v in req.values("transfer-encoding")):
        req.body = await _read_chunked(reader)
    elif req.values("content-length"):
        req.body = await reader.readexactly(int(req.values("content-length")[0]))
    return req


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size_line = await _line(reader)
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while await _line(reader):  # trailer section
                pass
            return bytes(out)
        out += await reader.readexactly(size)
        assert await reader.readexactly(2) == b"\r\n", "chunk data not followed by CRLF"


async def closed_by_peer(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bool:
    """True if the other side closes (EOF or reset) within timeout_s with nothing more sent."""
    try:
        async with asyncio.timeout(timeout_s):
            extra = await reader.read(65536)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    assert extra == b"", f"unexpected bytes after the response: {extra[:200]!r}"
    return True


@contextlib.asynccontextmanager
async def connection(
    port: int, *, rcvbuf: int | None = None
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def request(
    method: str,
    target: str,
    body: bytes | None = None,
    *,
    version: str = "1.1",
    headers: dict[str, str] | None = None,
) -> bytes:
    lines = [f"{method} {target} HTTP/{version}", "Host: 127.0.0.1"]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
