"""The upstream client against a backend that floods a response head or a trailer section.

A field that never ends used to be buffered without bound until the first-byte timeout, copied again
on every segment, while the whole router waited. Every byte of a head (and of a trailer section) is
now counted as it arrives, so the router refuses at the limit: 502 before the head went to the
client, a truncated stream after it; the connection to that backend is closed at once, and other
clients are served meanwhile. The backend is a raw-bytes server on a loopback port.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import httpx
import pytest

from prefix_router.upstream.http1 import MAX_HEAD_BYTES

from rawbackend import RawConn, RawRequest, Script, Start, dribble, ok
from routerkit import RunningRouter

FLOOD_CAP_BYTES = 64 << 20  # a flood the router never stops ends here, far past the head limit
CLIENT_TIMEOUT_S = 15.0  # the router's first-byte timeout is set well above it (60 s)
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
FIRST_EVENT = b'data: {"n": 0}\n\n'


@dataclass
class Flood:
    """What the backend sent of a flood before the router closed the connection."""

    sent: list[int] = field(default_factory=list)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)


def flooding(prefix: bytes, piece: bytes, flood: Flood) -> Script:
    """/flood gets `prefix` then `piece` over and over until the router closes; any other path 200."""

    async def script(req: RawRequest, conn: RawConn) -> bool:
        if req.target != "/flood":
            await conn.send(ok())
            return True
        sent = 0
        try:
            await conn.send(prefix)
            while sent < FLOOD_CAP_BYTES:
                await conn.send(piece)
                sent += len(piece)
                await asyncio.sleep(0)  # let the router's loop (same process) run between pieces
        except ConnectionError:
            pass
        finally:
            flood.sent.append(sent)
            flood.stopped.set()
        return False

    return script


HEAD_FLOODS = [
    pytest.param(b"HTTP/1.1 200 OK\r\nx-flood: ", b"a" * 4096, id="one-endless-field-value"),
    pytest.param(b"HTTP/1.1 200 OK\r\n", b"b" * 4096, id="one-endless-field-name"),
    pytest.param(b"HTTP/1.1 200 OK\r\n", b"x-f: 1\r\n" * 512, id="endless-short-fields"),
    pytest.param(b"", b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n" * 64, id="endless-1xx"),
]


async def start_flooded(raw: Start, script: Script) -> RunningRouter:
    _, r = await raw(script, upstream={"first_byte_timeout_s": 60.0, "stream_idle_timeout_s": 60.0})
    return r


async def healthz_while(r: RunningRouter, busy: asyncio.Task[object]) -> int:
    """/healthz on its own connections until `busy` ends: how many were answered (each must be)."""
    answered = 0
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as other:
        while True:
            resp = await other.get(f"{r.url}/healthz", headers={"connection": "close"})
            assert resp.status_code == 200
            answered += 1
            if busy.done():
                return answered
            await asyncio.sleep(0.01)


@pytest.mark.parametrize(("prefix", "piece"), HEAD_FLOODS)
async def test_endless_response_head_is_answered_502_and_its_connection_closed(
    raw: Start, prefix: bytes, piece: bytes
) -> None:
    flood = Flood()
    r = await start_flooded(raw, flooding(prefix, piece, flood))
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
        flooded = asyncio.create_task(client.get(f"{r.url}/flood"))
        answered = await healthz_while(r, flooded)
        resp = await flooded
        assert answered >= 1
        assert resp.status_code == 502
        error = resp.json()["error"]
        assert error["code"] == "upstream_unavailable"
        assert set(error) >= {"message", "type", "code"}
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            await flood.stopped.wait()  # the router closed the flooding connection
        # What the router read is bounded by the limit; the rest sat in socket buffers (a few MiB).
        assert flood.sent[0] < FLOOD_CAP_BYTES // 4
        # The backend stays usable on a fresh connection.
        again = await client.get(f"{r.url}/after")
        assert again.status_code == 200
        assert again.content == b"ok"


TRAILER_FLOODS = [
    pytest.param(b"0\r\nx-trailer: ", b"t" * 4096, id="one-endless-trailer-value"),
    pytest.param(b"0\r\n", b"x-t: 1\r\n" * 512, id="endless-short-trailer-fields"),
]


@pytest.mark.parametrize(("last_chunk", "piece"), TRAILER_FLOODS)
async def test_endless_trailer_section_ends_the_stream_and_closes_the_connection(
    raw: Start, last_chunk: bytes, piece: bytes
) -> None:
    flood = Flood()
    event = b"%x\r\n%b\r\n" % (len(FIRST_EVENT), FIRST_EVENT)
    r = await start_flooded(raw, flooding(STREAM_HEAD + event + last_chunk, piece, flood))
    got = b""
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:

        async def read_stream() -> int:
            nonlocal got
            async with client.stream("GET", f"{r.url}/flood") as resp:
                # The head and the first event went out before the trailer began: no 502 now, the
                # stream ends short instead (a chunked body without its last chunk).
                with contextlib.suppress(httpx.RemoteProtocolError):
                    async for chunk in resp.aiter_raw():
                        got += chunk
                return resp.status_code

        streamed = asyncio.create_task(read_stream())
        answered = await healthz_while(r, streamed)
        assert await streamed == 200
        assert answered >= 1
        assert got == FIRST_EVENT
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            await flood.stopped.wait()
        assert flood.sent[0] < FLOOD_CAP_BYTES // 4


async def test_head_just_under_the_limit_is_relayed(raw: Start, client: httpx.AsyncClient) -> None:
    """The count is of the head's bytes: a large head that fits is no flood, split across many reads."""
    value = b"v" * (MAX_HEAD_BYTES - 1024)
    wire = ok(b"fits", b"x-big: %b\r\n" % value)

    _, r = await raw(dribble(wire, 1000))
    resp = await client.get(f"{r.url}/big")
    assert resp.status_code == 200
    assert resp.headers["x-big"] == value.decode()
    assert resp.content == b"fits"
