"""What HTTP/1.1 clients (curl, nginx, SDKs, Go/Java clients) rely on from the router's listener.

Black-box and on the wire: raw sockets to 127.0.0.1 where framing matters, httpx elsewhere. These pin
the client-facing server's behaviour so that replacing it (uvicorn for an own httptools protocol)
changes nothing a client can see. Facts already pinned elsewhere (smuggling 400s, 431, slow headers,
slow Content-Length body, 413 with a sent body, SSE pacing) are not repeated here.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from aiohttp import web

from prefix_router.settings import Settings

from fakebackend import Echo, FakeBackend, Reply
from rawhttp import closed_by_peer, connection, read_response, request
from routerkit import RunningRouter, free_socket, router_settings

MakeBackends = Callable[..., Awaitable[list[FakeBackend]]]
MakeRouter = Callable[[Settings], Awaitable[RunningRouter]]

CHAT = "/v1/chat/completions"


def chat(system: str) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
    return json.dumps({"model": "m", "messages": messages}).encode()


# -- keep-alive and pipelining ---------------------------------------------------------------------


async def test_keep_alive_serves_many_requests_on_one_connection_in_order(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends))
    by_url = {b.url: b.name for b in backends}
    async with connection(r.port) as (reader, writer):
        for i in range(6):
            body = chat(f"conversation {i} " * 20)
            writer.write(request("POST", f"{CHAT}?i={i}", body, headers={"Content-Type": "application/json"}))
            resp = await read_response(reader)
            assert resp.status == 200
            assert resp.header("connection") != "close"
            got = resp.json()
            assert got["query"] == f"i={i}"
            assert got["body"] == body.decode()
            assert got["backend"] == by_url[resp.header("x-prefix-router-backend") or ""]
        # A local route and an answer the backend gives as an error share the connection too.
        writer.write(request("GET", "/healthz"))
        assert (await read_response(reader)).json() == {"status": "ok"}
        backends[0].script = backends[1].script = Reply(429)
        writer.write(request("POST", CHAT, chat("x")))
        assert (await read_response(reader)).status == 429
        backends[0].script = backends[1].script = Echo()
        writer.write(request("GET", "/after-error"))
        resp = await read_response(reader)
        assert resp.status == 200 and resp.json()["path"] == "/after-error"


@pytest.mark.parametrize("count", [2, 3])
async def test_pipelined_requests_are_answered_in_order_each_with_its_own_answer(
    fake_backends: MakeBackends, router: MakeRouter, count: int
) -> None:
    backends = await fake_backends(3)
    r = await router(router_settings(backends))
    bodies = [chat(f"pipelined prompt number {i} " * 30) for i in range(count)]
    async with httpx.AsyncClient() as client:  # each alone first: where its prefix lives
        homes = [(await client.post(f"{r.url}{CHAT}", content=b)).json()["backend"] for b in bodies]
    async with connection(r.port) as (reader, writer):
        writer.write(b"".join(request("POST", f"{CHAT}?n={i}", b) for i, b in enumerate(bodies)))
        by_url = {b.url: b.name for b in backends}
        for i, sent in enumerate(bodies):
            resp = await read_response(reader)
            assert resp.status == 200
            got = resp.json()
            assert (got["query"], got["body"]) == (f"n={i}", sent.decode()), (
                f"answer {i} is not request {i}'s"
            )
            assert got["backend"] == by_url[resp.header("x-prefix-router-backend") or ""]
            assert got["backend"] == homes[i], "pipelining must not change a routing decision"


async def test_pipelined_answers_keep_request_order_when_the_first_is_slowest(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    async with connection(r.port) as (reader, writer):
        writer.write(
            request("GET", "/stream?n=4&delay=0.1")
            + request("POST", "/second", b"two")
            + request("GET", "/third?x=3")
        )
        first = await read_response(reader)
        assert first.status == 200 and first.body.count(b"data: ") == 5
        second = await read_response(reader)
        assert second.json()["path"] == "/second" and second.json()["body"] == "two"
        third = await read_response(reader)
        assert third.json()["path"] == "/third" and third.json()["query"] == "x=3"


# -- closing: HTTP/1.0 and Connection: close -------------------------------------------------------


async def test_http10_request_gets_a_complete_unchunked_answer_then_close(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    async with connection(r.port) as (reader, writer):
        writer.write(request("POST", CHAT, chat("old client"), version="1.0"))
        resp = await read_response(reader)
        assert resp.status == 200
        assert resp.framing in ("content-length", "close")
        assert not resp.values("transfer-encoding"), "no chunked coding to an HTTP/1.0 client"
        assert resp.json()["body"] == chat("old client").decode()
        assert await closed_by_peer(reader), "HTTP/1.0 without keep-alive: the router closes"


async def test_http10_client_gets_a_stream_close_delimited_never_chunked(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    async with httpx.AsyncClient() as client:
        direct = (await client.get(f"{backends[0].url}/stream?n=3")).content
    for extra in ({}, {"Connection": "keep-alive"}):
        async with connection(r.port) as (reader, writer):
            writer.write(request("GET", "/stream?n=3", version="1.0", headers=extra))
            resp = await read_response(reader)
            assert resp.status == 200
            # RFC 9112 §6.1: no Transfer-Encoding to an HTTP/1.0 client; the end of the body is the close.
            assert not resp.values("transfer-encoding")
            assert resp.framing == "close"
            assert resp.body == direct


async def test_connection_close_is_answered_then_closed_and_nothing_after_it_is_served(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    async with connection(r.port) as (reader, writer):
        writer.write(request("GET", "/first", headers={"Connection": "close"}) + request("GET", "/ignored"))
        resp = await read_response(reader)
        assert resp.status == 200 and resp.json()["path"] == "/first"
        assert resp.header("connection") == "close"
        assert await closed_by_peer(reader)
    # RFC 9112 §9.6: after a "close", further requests on that connection are not processed.
    assert [s.path for s in backends[0].seen] == ["/first"]


# -- request bodies --------------------------------------------------------------------------------


def chunked(parts: list[bytes], *, extension: bool = False) -> bytes:
    ext = b";name=value" if extension else b""
    return b"".join(b"%X%s\r\n%s\r\n" % (len(p), ext, p) for p in parts) + b"0\r\n\r\n"


async def test_chunked_request_body_reaches_the_backend_whole_and_routes_like_content_length(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(4)
    r = await router(router_settings(backends))
    async with connection(r.port) as (reader, writer):
        for i in range(8):
            body = chat(f"tenantless prompt {i} " * 40)
            writer.write(request("POST", CHAT, body))
            homes = {(await read_response(reader)).header("x-prefix-router-backend")}
            parts = [body[:1], body[1:700], body[700:701], body[701:]]
            head = request("POST", CHAT, headers={"Transfer-Encoding": "chunked"})
            writer.write(head + chunked(parts, extension=i % 2 == 1))
            resp = await read_response(reader)
            assert resp.status == 200
            assert resp.json()["body"] == body.decode(), "the chunked body arrives whole"
            homes.add(resp.header("x-prefix-router-backend"))
            assert len(homes) == 1, "chunked framing must not change where a body routes"


async def test_a_chunked_body_trailer_is_never_taken_as_a_request_header(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    # A trailer naming the tenant header (or X-Forwarded-For) must not pick a tenant or an address.
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    body = chat("trailer")
    wire = (
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\nTrailer: x-prefix-cache-key\r\n\r\n"
    ).encode() + b"%X\r\n%s\r\n0\r\nx-prefix-cache-key: victim\r\nx-forwarded-for: 6.6.6.6\r\n\r\n" % (
        len(body),
        body,
    )
    async with connection(r.port) as (reader, writer):
        writer.write(wire)
        resp = await read_response(reader)
    assert resp.status == 200
    seen = {k.lower(): v for k, v in resp.json()["headers"].items()}
    assert "x-prefix-cache-key" not in seen
    assert "6.6.6.6" not in seen.get("x-forwarded-for", "")


async def test_expect_100_continue_gets_100_before_the_body(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"max_body_bytes": 10_000}))
    body = chat("expecting")
    async with connection(r.port) as (reader, writer):
        writer.write(
            request("POST", CHAT, headers={"Content-Length": str(len(body)), "Expect": "100-continue"})
        )
        interim = await read_response(reader)
        assert interim.status_line == b"HTTP/1.1 100 Continue"
        assert backends[0].seen == [], "nothing is sent upstream before the body"
        writer.write(body)
        resp = await read_response(reader)
        assert resp.status == 200 and resp.json()["body"] == body.decode()
        assert "expect" not in {k.lower() for k in resp.json()["headers"]}
        # The connection stays usable, and a chunked body may expect 100 as well.
        writer.write(
            request("POST", CHAT, headers={"Transfer-Encoding": "chunked", "Expect": "100-continue"})
        )
        assert (await read_response(reader)).status == 100
        writer.write(chunked([body]))
        assert (await read_response(reader)).json()["body"] == body.decode()


async def test_expect_100_continue_over_the_limit_gets_413_and_no_100(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"max_body_bytes": 10_000}))
    async with connection(r.port) as (reader, writer):
        writer.write(request("POST", CHAT, headers={"Content-Length": "50000", "Expect": "100-continue"}))
        resp = await read_response(reader)
        assert resp.status == 413, "a final status instead of 100: the client never uploads"
        assert resp.json()["error"]["code"] == "body_too_large"
        assert await closed_by_peer(reader)
    assert backends[0].seen == []


async def test_declared_body_over_limit_is_413_before_the_body_is_sent(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"max_body_bytes": 1 << 20}))
    async with connection(r.port) as (reader, writer):
        # 1 GiB declared, 1 KiB sent: the answer must not wait for (or read) the rest.
        writer.write(request("POST", CHAT, headers={"Content-Length": str(1 << 30)}) + b"{" * 1024)
        resp = await read_response(reader, timeout_s=5)
        assert resp.status == 413
        err = resp.json()["error"]
        assert set(err) >= {"message", "type", "code"} and err["code"] == "body_too_large"
        assert resp.header("connection") == "close"
        assert await closed_by_peer(reader)
    assert backends[0].seen == []


async def test_chunked_body_that_stops_midway_gets_408(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"body_timeout_s": 0.5}))
    async with connection(r.port) as (reader, writer):
        writer.write(request("POST", CHAT, headers={"Transfer-Encoding": "chunked"}) + b'10\r\n{"model"')
        resp = await read_response(reader, timeout_s=5)
        assert resp.status == 408
        assert resp.json()["error"]["code"] == "request_timeout"
        assert await closed_by_peer(reader)
    assert backends[0].seen == []


async def test_body_timeout_bounds_the_gap_between_pieces_not_the_whole_body(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"body_timeout_s": 0.4}))
    body = chat("trickled " * 50)
    step = len(body) // 8 + 1
    async with connection(r.port) as (reader, writer):
        writer.write(request("POST", CHAT, headers={"Content-Length": str(len(body))}))
        for i in range(0, len(body), step):  # ~0.8 s in all, each gap a quarter of the 0.4 s bound
            await asyncio.sleep(0.1)
            writer.write(body[i : i + step])
        resp = await read_response(reader)
        assert resp.status == 200 and resp.json()["body"] == body.decode()


async def test_large_request_body_reaches_the_backend_intact(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    payload = random.Random(1).randbytes(4 << 20)

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 100_000):
            yield payload[i : i + 100_000]

    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.post(f"{r.url}/upload", content=payload)
        assert resp.status_code == 200
        assert backends[0].seen[-1].body == payload
        resp = await client.post(f"{r.url}/upload", content=pieces())  # sent chunked
        assert resp.status_code == 200
        assert backends[0].seen[-1].body == payload


# -- responses -------------------------------------------------------------------------------------


async def test_head_has_headers_and_no_body_and_the_connection_stays_usable(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    async with connection(r.port) as (reader, writer):
        writer.write(request("HEAD", "/v1/models"))
        head = await read_response(reader, head=True)
        assert head.status == 200
        assert head.header("x-fake-backend") == "b0"
        assert head.header("content-type") == "application/json; charset=utf-8"
        # Had a body followed the HEAD answer, it would be read here as the next status line.
        writer.write(request("GET", "/after-head"))
        resp = await read_response(reader)
        assert resp.status == 200 and resp.json()["path"] == "/after-head"
    assert [s.method for s in backends[0].seen] == ["HEAD", "GET"]


async def test_streaming_answer_is_chunked_or_close_delimited_and_parses(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    async with httpx.AsyncClient() as client:
        direct = (await client.get(f"{backends[0].url}/stream?n=5")).content
    async with connection(r.port) as (reader, writer):
        writer.write(request("GET", "/stream?n=5"))
        resp = await read_response(reader)
        assert resp.status == 200
        assert resp.header("content-type") == "text/event-stream"
        assert resp.framing in ("chunked", "close")
        assert resp.body == direct
        assert resp.body.endswith(b"data: [DONE]\n\n")
        if resp.framing == "chunked":
            writer.write(request("GET", "/stream?n=1"))
            again = await read_response(reader)
            assert again.body.count(b"data: ") == 2


async def test_non_streaming_answer_keeps_its_content_length_and_one_of_each_header(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    async with connection(r.port) as (reader, writer):
        writer.write(request("POST", CHAT, chat("sized")))
        resp = await read_response(reader)
    assert resp.framing == "content-length"
    assert resp.values("content-length") == [str(len(resp.body))]
    assert not resp.values("transfer-encoding")
    # The router adds no Date or Server of its own next to the backend's.
    for name in ("date", "server", "content-type"):
        assert len(resp.values(name)) <= 1, resp.headers


@functools.cache
def big_payload() -> bytes:
    return random.Random(8).randbytes(8 << 20)


async def _big_answer(request: web.Request) -> web.StreamResponse:
    big = big_payload()
    if request.path == "/small":
        return web.Response(body=b"the tail", content_type="application/octet-stream")
    if request.query.get("framing") == "chunked":
        resp = web.StreamResponse(headers={"content-type": "application/octet-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(big), 256 * 1024):
            await resp.write(big[i : i + 256 * 1024])
        await resp.write_eof()
        return resp
    return web.Response(body=big, content_type="application/octet-stream")


@pytest.fixture
async def big_backend() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", _big_answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = free_socket()
    await web.SockSite(runner, sock).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    await runner.cleanup()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_large_answer_read_slowly_arrives_complete_and_intact(
    big_backend: str, router: MakeRouter, framing: str
) -> None:
    r = await router(router_settings([big_backend]))
    big = big_payload()
    raw = bytearray()
    async with connection(r.port, rcvbuf=16384) as (reader, writer):
        # Two pipelined: the second answer must follow the first intact, then the router closes.
        writer.write(
            request("GET", f"/big?framing={framing}")
            + request("GET", "/small", headers={"Connection": "close"})
        )
        await asyncio.sleep(0.3)  # a stalled reader: everything upstream of it must hold, not drop
        paced = 0
        async with asyncio.timeout(30):
            while chunk := await reader.read(65536):
                raw += chunk
                if len(raw) - paced >= 512 * 1024:  # ~20 ms per 512 KiB: far slower than loopback
                    paced = len(raw)
                    await asyncio.sleep(0.02)
    replay = asyncio.StreamReader()
    replay.feed_data(bytes(raw))
    replay.feed_eof()
    first = await read_response(replay)
    assert first.status == 200
    assert first.framing == framing
    assert len(first.body) == len(big)
    assert hashlib.sha256(first.body).digest() == hashlib.sha256(big).digest()
    second = await read_response(replay)
    assert (second.status, second.body) == (200, b"the tail")
    assert await replay.read() == b""


# -- paths and queries -----------------------------------------------------------------------------

TARGETS = [
    "/v1/a%2Fb/c%20d",  # an encoded slash stays one segment
    "/x/caf%C3%A9/%E2%82%AC",
    "/x/%25/%2e%2E/../y",  # no dot-segment removal, no decoding
    "/x//double//slashes/",
    "/x/%7e/%7E",  # hex case kept
    "/x;param=1/y",
    "/x/~user/a-b_c.d!$&'()*+,;=:@",
    "/x?q=a%26b&r=%2F&s=+&t",
    "/x?a=1&a=2&b=&=c",
    "/x?redirect=http://h/p?y=1",
    "/x?%E2%82%AC=%e2%82%ac",
    "/x?",  # an empty query keeps its "?" (RFC 3986 §6.2.3)
]


async def test_path_and_query_reach_the_backend_exactly_as_sent(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    async with connection(r.port) as (reader, writer):
        for target in TARGETS:
            writer.write(request("GET", target))
            resp = await read_response(reader)
            assert resp.status == 200, target
            got = resp.json()
            assert (got["raw_path"], got["query"]) == (target, target.partition("?")[2]), target


# -- garbage and idle connections ------------------------------------------------------------------

GARBAGE = [
    b"GARBAGE\r\n\r\n",
    b"G@T /x HTTP/1.1\r\nHost: x\r\n\r\n",  # not a method token
    b"GET /x HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: x\r\nX-Nul: a\x00b\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: x\r\n : v\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n",
    b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32,  # a TLS ClientHello on the plain port
]


async def test_malformed_requests_get_a_json_400_and_other_connections_keep_being_served(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    async with connection(r.port) as (other_reader, other_writer):
        other_writer.write(request("GET", "/before"))
        assert (await read_response(other_reader)).status == 200
        for garbage in GARBAGE:
            async with connection(r.port) as (reader, writer):
                writer.write(garbage)
                resp = await read_response(reader)
                assert resp.status == 400, garbage
                assert resp.header("content-type") == "application/json"
                err = resp.json()["error"]
                assert set(err) >= {"message", "type", "code"} and err["code"] == "bad_request", garbage
                assert await closed_by_peer(reader), garbage
        other_writer.write(request("GET", "/after"))  # the kept-alive neighbour was never disturbed
        assert (await read_response(other_reader)).json()["path"] == "/after"
    assert [s.path for s in backends[0].seen] == ["/before", "/after"]


async def test_silent_connection_is_closed_after_the_header_timeout(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"header_timeout_s": 0.5}))
    async with connection(r.port) as (reader, _):
        assert await closed_by_peer(reader, timeout_s=5), "nothing is answered, the socket is closed"


async def test_idle_keep_alive_connection_is_closed_by_the_router(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"keepalive_timeout_s": 1.0}))
    async with connection(r.port) as (reader, writer):
        writer.write(request("GET", "/x"))
        assert (await read_response(reader)).status == 200
        assert await closed_by_peer(reader, timeout_s=15), "an idle kept-alive connection is not held forever"
