"""The router toward backends that answer in every HTTP/1.1 shape: framing, keep-alive, hygiene.

Each backend here is a raw asyncio server on a 127.0.0.1 ephemeral port writing exact bytes, so the
wire is under the test's control whatever HTTP client the router uses upstream. These pin behaviour
the upstream client must keep: bodies relayed whole whatever their framing, connections reused when
HTTP allows and never when it does not, stale pooled connections survived, broken answers mapped to
502/504 or a truncated response, hop-by-hop fields dropped both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import random
from typing import Any

import httpx
import pytest

from rawbackend import RawBackend, RawConn, RawRequest, Start, answer, dribble, ok
from routerkit import RunningRouter, eventually, router_settings


async def metrics_text(client: httpx.AsyncClient, r: RunningRouter) -> str:
    return (await client.get(f"{r.url}/metrics")).text


# -- framing ---------------------------------------------------------------------------------------


async def test_content_length_body_split_across_writes_arrives_whole(
    raw: Start, client: httpx.AsyncClient
) -> None:
    body = bytes(range(256)) * 40
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: %d\r\n\r\n" % len(
        body
    )
    wire = head + body
    # Cuts inside the status line, inside a header, between the CR and LF of the blank line, in the body.
    cuts = [7, 30, len(head) - 1, len(head) + 1, len(head) + 500, len(head) + 5000, len(wire)]

    async def script(req: RawRequest, conn: RawConn) -> bool:
        start = 0
        for cut in cuts:
            await conn.send(wire[start:cut])
            start = cut
            await asyncio.sleep(0.02)
        return True

    backend, r = await raw(script)
    for _ in range(2):
        resp = await client.get(f"{r.url}/bytes")
        assert resp.status_code == 200
        assert resp.content == body
        assert resp.headers["content-length"] == str(len(body))
    assert len(backend.conns) == 1, "the connection is reused once its Content-Length body is read"


async def test_chunked_with_extensions_and_trailers_is_decoded(raw: Start, client: httpx.AsyncClient) -> None:
    wire = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n"
        b"trailer: x-checksum\r\n\r\n"
        b"5;name=value\r\nhello\r\n"
        b'7;quoted="a b;c";flag\r\n, world\r\n'
        b"a\r\n0123456789\r\n"
        b"0000A\r\nABCDEFGHIJ\r\n"
        b"0;last=1\r\nx-checksum: abc\r\nx-other: 2\r\n\r\n"
    )

    backend, r = await raw(dribble(wire, 23, 0.005))
    for _ in range(2):
        resp = await client.get(f"{r.url}/chunked")
        assert resp.status_code == 200
        assert resp.content == b"hello, world0123456789ABCDEFGHIJ"
    assert len(backend.requests) == 2
    assert len(backend.conns) == 1, "the trailers were read, so the connection was reusable"


async def test_encoded_body_is_relayed_as_sent_never_decoded(raw: Start, client: httpx.AsyncClient) -> None:
    plain = b'{"choices": [{"text": "compressible "}]}' * 500
    encoded = gzip.compress(plain, mtime=0)
    backend, r = await raw(
        answer(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(encoded), encoded)
        )
    )
    async with client.stream(
        "POST", f"{r.url}/v1/completions", json={"prompt": "p"}, headers={"accept-encoding": "gzip"}
    ) as resp:
        assert resp.status_code == 200
        raw_body = b"".join([chunk async for chunk in resp.aiter_raw()])
    assert resp.headers["content-encoding"] == "gzip"
    assert resp.headers["content-length"] == str(len(encoded))
    assert raw_body == encoded
    assert backend.requests[0].values("accept-encoding") == ["gzip"], "the client's, passed on"


async def test_close_delimited_body_arrives_whole_and_next_request_opens_a_new_connection(
    raw: Start, client: httpx.AsyncClient
) -> None:
    body = b"no length, no chunks: the body ends when the connection does. " * 200

    async def script(req: RawRequest, conn: RawConn) -> bool:
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n")
        for i in range(0, len(body), 4000):
            await conn.send(body[i : i + 4000])
            await asyncio.sleep(0.01)
        return False  # close: that is the end of the body

    backend, r = await raw(script)
    for i in range(3):
        resp = await client.get(f"{r.url}/until-close/{i}")
        assert resp.status_code == 200
        assert resp.content == body
    assert len(backend.conns) == 3
    assert all(len(c.requests) == 1 for c in backend.conns)


async def test_connection_close_is_honoured_even_while_the_backend_keeps_the_socket_open(
    raw: Start, client: httpx.AsyncClient
) -> None:
    # The backend says `connection: close` but does not close; the router must not send it another
    # request, and must close it itself.
    backend, r = await raw(answer(ok(b"once", b"connection: close\r\n"), keep_open=True))
    for _ in range(3):
        resp = await client.get(f"{r.url}/x")
        assert resp.status_code == 200
        assert resp.content == b"once"
    assert [len(c.requests) for c in backend.conns] == [1, 1, 1]
    for conn in backend.conns:
        await asyncio.wait_for(conn.eof.wait(), 5)


HTTP10 = {
    "length-then-close": (b"HTTP/1.0 200 OK\r\ncontent-length: 9\r\n\r\nhttp 1.0!", True),
    "until-close": (b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nhttp 1.0!", True),
    "length-left-open": (b"HTTP/1.0 200 OK\r\ncontent-length: 9\r\n\r\nhttp 1.0!", False),
}


async def test_http10_response_is_relayed_and_its_connection_not_reused(
    raw: Start, client: httpx.AsyncClient
) -> None:
    async def script(req: RawRequest, conn: RawConn) -> bool:
        wire, backend_closes = HTTP10[req.target.rsplit("/", 1)[1]]
        await conn.send(wire)
        return not backend_closes

    backend, r = await raw(script)
    for case in HTTP10:
        for _ in range(2):
            resp = await client.get(f"{r.url}/old/{case}")
            assert resp.status_code == 200, case
            assert resp.content == b"http 1.0!", case
    # HTTP/1.0 without `connection: keep-alive` is one request per connection (RFC 9112 §9.3).
    assert [len(c.requests) for c in backend.conns] == [1] * 2 * len(HTTP10)


BODILESS = {
    "204": ("GET", b"HTTP/1.1 204 No Content\r\nx-a: 1\r\n\r\n", 204),
    "204-with-length-0": ("GET", b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n", 204),
    "304": ("GET", b'HTTP/1.1 304 Not Modified\r\netag: "v1"\r\n\r\n', 304),
    # RFC 9110 §8.6: a 304 may carry the length of the representation it stands for; no body follows.
    "304-with-representation-length": (
        "GET",
        b'HTTP/1.1 304 Not Modified\r\netag: "v1"\r\ncontent-length: 1234\r\n\r\n',
        304,
    ),
    "head-with-length": (
        "HEAD",
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 1234\r\n\r\n",
        200,
    ),
    "head-with-chunked": ("HEAD", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", 200),
}


async def test_bodiless_answers_are_relayed_at_once_and_the_connection_reused(
    raw: Start, client: httpx.AsyncClient
) -> None:
    async def script(req: RawRequest, conn: RawConn) -> bool:
        if req.target == "/after":
            await conn.send(ok(b"after"))
        else:
            await conn.send(BODILESS[req.target.rsplit("/", 1)[1]][1])
        return True

    # A router that waited for a body here would hang until the stream idle timeout, past the
    # client's timeout.
    backend, r = await raw(script, upstream={"stream_idle_timeout_s": 30})
    for case, (method, wire, status) in BODILESS.items():
        for _ in range(2):
            resp = await client.request(
                method, f"{r.url}/bodiless/{case}", headers={"if-none-match": '"v1"'}, timeout=5
            )
            assert resp.status_code == status, case
            assert resp.content == b"", case
            after = await client.get(f"{r.url}/after", timeout=5)
            assert after.status_code == 200 and after.content == b"after", case
        if method == "HEAD" and b"content-length" in wire:
            assert resp.headers["content-length"] == "1234", "HEAD keeps the length GET would send"
        assert len(backend.conns) == 1, f"{case}: no body to read, so the connection is reused"
    assert len(backend.requests) == 4 * len(BODILESS)


# -- connections -----------------------------------------------------------------------------------


async def test_sequential_requests_reuse_one_kept_alive_connection(
    raw: Start, client: httpx.AsyncClient
) -> None:
    backend, r = await raw(answer(ok(b"{}")))
    n = 40
    for i in range(n):
        if i % 2:
            resp = await client.post(f"{r.url}/v1/completions", json={"prompt": f"p{i}"})
        else:
            resp = await client.get(f"{r.url}/v1/models")
        assert resp.status_code == 200
    assert len(backend.requests) == n
    assert len(backend.conns) <= 2, f"{len(backend.conns)} connections for {n} sequential requests"


async def test_concurrent_requests_each_get_a_connection_within_the_per_backend_limit(
    raw: Start,
) -> None:
    gate = asyncio.Event()

    async def script(req: RawRequest, conn: RawConn) -> bool:
        await gate.wait()
        await conn.send(ok(req.target.encode()))
        return True

    backend, r = await raw(script, upstream={"max_connections_per_backend": 2})
    async with httpx.AsyncClient(timeout=10) as c:
        tasks = [asyncio.create_task(c.get(f"{r.url}/held/{i}")) for i in range(6)]
        await eventually(lambda: len(backend.requests) == 2)
        await asyncio.sleep(0.2)
        assert len(backend.requests) == 2, "the rest wait for one of the two connections"
        assert backend.peak_open <= 2
        gate.set()
        got = sorted([(await t).text for t in tasks])
    assert got == sorted(f"/held/{i}" for i in range(6))
    assert backend.peak_open <= 2


async def test_no_pipelining_concurrent_requests_use_separate_connections(raw: Start) -> None:
    gate = asyncio.Event()

    async def script(req: RawRequest, conn: RawConn) -> bool:
        await gate.wait()
        await conn.send(ok(req.target.encode()))
        return True

    backend, r = await raw(script)
    async with httpx.AsyncClient(timeout=10) as c:
        tasks = [asyncio.create_task(c.get(f"{r.url}/held/{i}")) for i in range(5)]
        # Each connection of this backend answers one request at a time: five held at once need five.
        await eventually(lambda: len(backend.requests) == 5)
        assert len(backend.conns) == 5
        gate.set()
        assert sorted([(await t).text for t in tasks]) == sorted(f"/held/{i}" for i in range(5))


async def test_idle_pooled_connection_is_closed_by_the_router_after_its_keepalive_timeout(
    raw: Start, client: httpx.AsyncClient
) -> None:
    backend, r = await raw(answer(ok()), upstream={"keepalive_timeout_s": 0.3})
    assert (await client.get(f"{r.url}/x")).status_code == 200
    await asyncio.wait_for(backend.conns[0].eof.wait(), 5)


async def test_pooled_connection_the_backend_closed_while_idle_is_not_used(
    raw: Start, client: httpx.AsyncClient
) -> None:
    # The backend closes a connection idle for 0.1 s (uvicorn's keep-alive timeout does so, at 5 s);
    # each request comes well after that close, so the pooled connection is known dead by then.
    backend, r = await raw(answer(ok(b"fresh")), idle_close_s=0.1)
    for i in range(4):
        resp = await client.post(f"{r.url}/v1/completions", json={"prompt": f"p{i}"})
        assert resp.status_code == 200, resp.text
        assert resp.content == b"fresh"
        await eventually(lambda: backend.open == 0)
        await asyncio.sleep(0.05)
    assert len(backend.conns) == 4


async def test_idempotent_request_survives_the_backend_closing_a_pooled_connection_as_it_arrives(
    raw: Start, client: httpx.AsyncClient
) -> None:
    # The worst moment of a keep-alive race: the backend's idle timer fires as the request lands, so
    # it reads the request and closes without a byte. RFC 9112 §9.3.1 lets a client retry an
    # idempotent request on a new connection then; the client of the router must never see it.
    async def script(req: RawRequest, conn: RawConn) -> bool:
        if len(conn.requests) > 1:
            return False
        await conn.send(ok(b"answered"))
        return True

    backend, r = await raw(script)
    for _ in range(5):
        resp = await client.get(f"{r.url}/v1/models")
        assert resp.status_code == 200, resp.text
        assert resp.content == b"answered"
    assert any(len(c.requests) == 2 for c in backend.conns), "the race was exercised"
    assert all(len(c.requests) <= 2 for c in backend.conns)

    # A POST the backend read is never sent twice: it may have started generating. (The default
    # upstream keep-alive, 4 s, is below vLLM's 5 s, so the router's close comes first.)
    resp = await client.post(f"{r.url}/v1/completions", json={"prompt": "once"})
    posts = [q for q in backend.requests if q.method == "POST" and b"once" in q.body]
    assert resp.status_code == 502, "the kept-alive connection took the POST and closed"
    assert len(posts) == 1, "a POST the backend read is not replayed"


STALE_DELAYS_S = [0.18, 0.19, 0.195, 0.2, 0.2, 0.205, 0.21, 0.22, 0.25]


async def test_idempotent_requests_around_the_backends_idle_close_all_succeed(
    raw: Start, client: httpx.AsyncClient
) -> None:
    """Requests land just before, at and just after the backend's 0.2 s idle close."""
    backend, r = await raw(answer(ok(b"fresh")), idle_close_s=0.2)
    statuses = []
    for delay in [0.0, *STALE_DELAYS_S]:
        await asyncio.sleep(delay)
        resp = await client.get(f"{r.url}/v1/models")
        statuses.append(resp.status_code)
    assert statuses == [200] * len(statuses)
    assert 1 < len(backend.conns) <= len(statuses)


# -- broken answers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 1000\r\n\r\n" + b"x" * 100,
            id="content-length-short",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            b"10\r\ndata: partial\n\n\r\n",
            id="chunked-unterminated",
        ),
    ],
)
async def test_backend_closing_mid_body_truncates_the_response_and_is_counted(
    raw: Start, client: httpx.AsyncClient, wire: bytes
) -> None:
    async def script(req: RawRequest, conn: RawConn) -> bool:
        if req.target == "/after":
            await conn.send(ok(b"after"))
            return True
        head, _, body = wire.partition(b"\r\n\r\n")
        await conn.send(head + b"\r\n\r\n")
        await asyncio.sleep(0.05)
        await conn.send(body)
        await asyncio.sleep(0.05)
        return False  # FIN, with the body short of what the framing promised

    backend, r = await raw(script)
    got = b""
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", f"{r.url}/v1/completions", json={"prompt": "p"}) as resp:
            assert resp.status_code == 200
            async for chunk in resp.aiter_raw():
                got += chunk
    assert len(got) <= 100
    after = await client.get(f"{r.url}/after")
    assert after.status_code == 200 and after.content == b"after"
    text = await metrics_text(client, r)
    assert f'prefix_router_upstream_errors_total{{backend="{backend.url}",kind="stream_broken"}} 1.0' in text
    assert len(backend.requests) == 2, "never retried once the response began"
    await eventually(lambda: sum(r.inflight().values()) == 0)


async def test_partial_response_head_then_silence_is_504(raw: Start, client: httpx.AsyncClient) -> None:
    async def script(req: RawRequest, conn: RawConn) -> bool:
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/pl")  # and not another byte
        await conn.reader.read()  # until the router closes
        conn.eof.set()
        return False

    backend, r = await raw(script, upstream={"first_byte_timeout_s": 0.5})
    resp = await client.post(f"{r.url}/v1/completions", json={"prompt": "p"})
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "upstream_timeout"
    await asyncio.wait_for(backend.conns[0].eof.wait(), 5)  # the router dropped that connection
    text = await metrics_text(client, r)
    assert f'prefix_router_upstream_errors_total{{backend="{backend.url}",kind="first_byte_timeout"}}' in text


NOT_HTTP = {
    "text-then-close": (b"NOT HTTP AT ALL\r\n\r\n", False),
    "text-left-open": (b"NOT HTTP AT ALL\r\n\r\n", True),
    "tls-bytes-left-open": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", True),
    "bad-status-code": (b"HTTP/1.1 abc OK\r\ncontent-length: 0\r\n\r\n", True),
    "bad-content-length": (b"HTTP/1.1 200 OK\r\ncontent-length: banana\r\n\r\n", True),
    "two-lengths": (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!", True),
    # Both framings at once is the shape of response splitting (RFC 9112 §6.3): refused, not guessed.
    "length-and-chunked": (
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        True,
    ),
    "header-without-colon": (b"HTTP/1.1 200 OK\r\nno colon here\r\ncontent-length: 0\r\n\r\n", True),
    # A switch of protocol nobody asked for, and a head no relay should buffer (over 64 KiB).
    "unasked-101": (
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
        True,
    ),
    "head-over-64KiB": (
        b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 70_000 + b"\r\ncontent-length: 0\r\n\r\n",
        True,
    ),
}


async def test_unparsable_answer_is_an_openai_shaped_502_and_its_connection_dropped(
    raw: Start, client: httpx.AsyncClient
) -> None:
    async def script(req: RawRequest, conn: RawConn) -> bool:
        if req.target == "/after":
            await conn.send(ok(b"after"))
            return True
        wire, left_open = NOT_HTTP[req.target.rsplit("/", 1)[1]]
        await conn.send(wire)
        if left_open:
            await conn.reader.read()  # until the router closes
            conn.eof.set()
        return False

    backend, r = await raw(script)
    for case in NOT_HTTP:
        resp = await client.post(f"{r.url}/garbage/{case}", json={"prompt": "p"}, timeout=5)
        assert resp.status_code == 502, case
        err = resp.json()["error"]
        assert set(err) >= {"message", "type", "code"}, case
        assert err["type"] == "server_error" and err["code"] == "upstream_unavailable", case
        after = await client.get(f"{r.url}/after", timeout=5)
        assert after.status_code == 200 and after.content == b"after", case
    for conn in backend.conns:
        if any(req.target.startswith("/garbage/") for req in conn.requests):
            last = conn.requests[-1].target
            assert last.startswith("/garbage/"), "never reused after garbage"
            if NOT_HTTP[last.rsplit("/", 1)[1]][1]:
                await asyncio.wait_for(conn.eof.wait(), 5)  # left open by the backend: the router closes it
    text = await metrics_text(client, r)
    series = f'prefix_router_upstream_errors_total{{backend="{backend.url}",kind="no_answer"}}'
    assert f"{series} {float(len(NOT_HTTP))}" in text


INTERIM = {
    "100": b"HTTP/1.1 100 Continue\r\n\r\n",
    "103": b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n",
    "100-and-103": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n\r\n",
}


async def test_interim_1xx_answers_are_skipped_and_the_final_one_relayed(
    raw: Start, client: httpx.AsyncClient
) -> None:
    async def script(req: RawRequest, conn: RawConn) -> bool:
        await conn.send(INTERIM[req.target.rsplit("/", 1)[1]])
        await asyncio.sleep(0.02)
        await conn.send(ok(b"final", b"x-final: 1\r\n"))
        return True

    backend, r = await raw(script)
    for case in INTERIM:
        for _ in range(2):
            resp = await client.post(f"{r.url}/interim/{case}", json={"prompt": "p"})
            assert resp.status_code == 200, case
            assert resp.content == b"final", case
            assert resp.headers["x-final"] == "1", case
            assert "link" not in resp.headers, case
    assert len(backend.conns) == 1


STATUS_LINES = {
    "unregistered-2xx": (b"HTTP/1.1 299 Whatever", 299),
    "unregistered-5xx-empty-reason": (b"HTTP/1.1 599 ", 599),
    "no-reason-phrase": (b"HTTP/1.1 200", 200),
    "418": (b"HTTP/1.1 418 I'm a teapot", 418),
}


async def test_any_status_code_is_relayed_as_is(raw: Start, client: httpx.AsyncClient) -> None:
    async def script(req: RawRequest, conn: RawConn) -> bool:
        line = STATUS_LINES[req.target.rsplit("/", 1)[1]][0]
        await conn.send(line + b"\r\ncontent-length: 2\r\n\r\nhi")
        return True

    backend, r = await raw(script)
    for case, (_, status) in STATUS_LINES.items():
        resp = await client.post(f"{r.url}/status/{case}", json={"prompt": "p"})
        assert resp.status_code == status, case
        assert resp.content == b"hi", case
    assert len(backend.conns) == 1


# -- header hygiene --------------------------------------------------------------------------------


async def test_response_hop_by_hop_fields_dropped_end_to_end_ones_kept_with_duplicates(
    raw: Start, client: httpx.AsyncClient
) -> None:
    head = (
        b"HTTP/1.1 200 OK\r\n"
        b"Connection: X-Foo, keep-alive\r\n"
        b"x-FOO: 1\r\n"
        b"Keep-Alive: timeout=5, max=100\r\n"
        b"Transfer-Encoding: chunked\r\n"
        b"Trailer: x-checksum\r\n"
        b"Proxy-Connection: keep-alive\r\n"
        b"Upgrade: h2c\r\n"
        b"content-type: text/plain\r\n"
        b"X-Request-Id: req-123\r\n"
        b"Set-Cookie: a=1; Path=/\r\n"
        b"Set-Cookie: b=2; Path=/; HttpOnly\r\n"
        b"x-dup: one\r\n"
        b"x-dup: two, three\r\n"
        b"Server: raw-backend/1\r\n"
        b"Date: Mon, 01 Jan 2024 00:00:00 GMT\r\n"
        b"\r\n"
    )
    wire = head + b"5\r\nhello\r\n0\r\nx-checksum: 1\r\n\r\n"
    _, r = await raw(answer(wire))
    resp = await client.get(f"{r.url}/headers")
    assert resp.status_code == 200
    assert resp.content == b"hello"
    h = resp.headers
    for gone in ("x-foo", "keep-alive", "trailer", "proxy-connection", "upgrade"):
        assert gone not in h, gone
    assert "x-foo" not in h.get("connection", "").lower()
    assert len(h.get_list("transfer-encoding")) <= 1, "only the router's own framing, if any"
    assert h["x-request-id"] == "req-123"
    assert h.get_list("set-cookie") == ["a=1; Path=/", "b=2; Path=/; HttpOnly"]
    assert h.get_list("x-dup") == ["one", "two, three"]
    assert h.get_list("server") == ["raw-backend/1"]
    assert h.get_list("date") == ["Mon, 01 Jan 2024 00:00:00 GMT"]
    assert h["content-type"] == "text/plain"


async def test_request_reaches_the_backend_with_its_host_forwarding_fields_and_no_hop_by_hop(
    raw: Start, client: httpx.AsyncClient
) -> None:
    backend, r = await raw(answer(ok()))
    sent = [
        ("Host", "public.example"),
        ("x-multi", "a"),
        ("User-Agent", "test-agent/1"),
        ("X-Multi", "b"),
        ("Connection", "keep-alive, X-Hop"),
        ("x-hop", "1"),
        ("Keep-Alive", "300"),
        ("TE", "trailers"),
        ("Trailer", "x-t"),
        ("Proxy-Authorization", "Basic c2VjcmV0"),
        ("Proxy-Connection", "keep-alive"),
        ("x-multi", "c, d"),
        ("Authorization", "Bearer token"),
        ("Cookie", "k=v"),
    ]
    resp = await client.post(f"{r.url}/v1/completions?q=1", content=b'{"prompt": "p"}', headers=sent)
    assert resp.status_code == 200
    got = backend.requests[-1]
    assert got.method == "POST" and got.target == "/v1/completions?q=1"
    assert got.body == b'{"prompt": "p"}'
    assert got.values("content-length") == ["15"]
    assert got.values("host") == [f"127.0.0.1:{backend.port}"]
    assert got.values("x-multi") == ["a", "b", "c, d"], "repeated fields arrive, in order"
    assert got.values("user-agent") == ["test-agent/1"]
    assert got.values("authorization") == ["Bearer token"]
    assert got.values("cookie") == ["k=v"]
    assert got.values("x-forwarded-for") == ["127.0.0.1"]
    assert got.values("x-forwarded-proto") == ["http"]
    names = got.names()
    for gone in ("x-hop", "keep-alive", "te", "trailer", "proxy-authorization", "proxy-connection"):
        assert gone not in names, gone
    assert all("x-hop" not in v.lower() for v in got.values("connection"))


async def test_router_adds_no_request_fields_of_its_own(raw: Start) -> None:
    """A bare request (no User-Agent, Accept, Content-Type...) reaches the backend as bare."""
    backend, r = await raw(answer(ok()))
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    try:
        for request in (
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 3\r\n\r\nabc",
            b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n",
        ):
            writer.write(request)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            assert await asyncio.wait_for(reader.readexactly(2), 5) == b"ok"
    finally:
        writer.close()
    post, get = backend.requests
    allowed = {"host", "content-length", "x-forwarded-for", "x-forwarded-proto", "connection"}
    assert post.names() <= allowed, post.headers
    assert post.body == b"abc" and post.values("content-length") == ["3"]
    assert get.names() <= allowed, get.headers
    assert get.values("content-length") in ([], ["0"]) and not get.values("transfer-encoding")
    assert get.body == b""


# -- big and aborted bodies ------------------------------------------------------------------------


async def test_twenty_megabyte_chunked_stream_arrives_intact_and_in_order(
    raw: Start, client: httpx.AsyncClient
) -> None:
    rng = random.Random(20)
    payload = rng.randbytes(20 * 1024 * 1024)
    sizes: list[int] = []
    left = len(payload)
    while left:
        size = min(left, rng.choice([1, 7, 100, 4096, 65536, 300_000]))
        sizes.append(size)
        left -= size

    async def script(req: RawRequest, conn: RawConn) -> bool:
        await conn.send(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        at = 0
        for size in sizes:
            conn.writer.write(b"%x\r\n%s\r\n" % (size, payload[at : at + size]))
            at += size
            if conn.writer.transport.get_write_buffer_size() > 1 << 20:
                await conn.writer.drain()
        await conn.send(b"0\r\n\r\n")
        return True

    backend, r = await raw(script)
    digest = hashlib.sha256()
    total = 0
    async with client.stream("GET", f"{r.url}/big") as resp:
        assert resp.status_code == 200
        async for chunk in resp.aiter_bytes():
            digest.update(chunk)
            total += len(chunk)
    assert total == len(payload)
    assert digest.hexdigest() == hashlib.sha256(payload).hexdigest()
    assert (await client.get(f"{r.url}/big-again", timeout=30)).content == payload
    assert len(backend.conns) == 1


@pytest.mark.parametrize("framing", ["content-length", "close-delimited"])
async def test_client_leaving_mid_body_closes_the_upstream_connection(raw: Start, framing: str) -> None:
    # Chunked SSE is pinned in test_proxy_streaming.py; these are the other two framings.
    async def script(req: RawRequest, conn: RawConn) -> bool:
        length = b"content-length: 100000000\r\n" if framing == "content-length" else b""
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n" + length + b"\r\n")
        eof = asyncio.create_task(conn.reader.read())
        try:
            while not eof.done():
                conn.writer.write(b"x" * 1000)
                await asyncio.sleep(0.01)
        finally:
            eof.cancel()
        with contextlib.suppress(ConnectionError):
            await eof  # b"" (FIN) or a reset: either way the router let go
        conn.eof.set()
        return False

    backend, r = await raw(script)
    async with httpx.AsyncClient(timeout=10) as c, c.stream("GET", f"{r.url}/endless") as resp:
        assert resp.status_code == 200
        async for _ in resp.aiter_raw():
            break
    await asyncio.wait_for(backend.conns[0].eof.wait(), 5)
    await eventually(lambda: sum(r.inflight().values()) == 0)
    await eventually(lambda: r.app.upstream.pool_in_use() == 0)


async def test_bytes_after_a_whole_answer_are_never_relayed_nor_read_as_the_next_answer(
    raw: Start, client: httpx.AsyncClient
) -> None:
    # A second response (or stray bytes) after a complete one, in the same write: the first is the
    # answer; the rest must not reach this client, nor be taken as the answer to the next request.
    stray = b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nINJECTED"

    async def script(req: RawRequest, conn: RawConn) -> bool:
        await conn.send(ok(b"hello") + stray if req.target == "/first" else ok(b"second"))
        return True

    backend, r = await raw(script)
    first = await client.get(f"{r.url}/first")
    assert first.status_code == 200
    assert first.content == b"hello"
    assert first.headers.get_list("content-length") == ["5"]
    second = await client.get(f"{r.url}/second")
    assert second.content == b"second"
    served_first = next(c for c in backend.conns if any(q.target == "/first" for q in c.requests))
    assert [q.target for q in served_first.requests] == ["/first"], "that connection was not reused"


async def test_max_connections_bounds_upstream_connections_over_all_backends(router: Any) -> None:
    gate = asyncio.Event()

    async def script(req: RawRequest, conn: RawConn) -> bool:
        await gate.wait()
        await conn.send(ok(req.target.encode()))
        return True

    backends = [RawBackend(script, None), RawBackend(script, None)]
    for backend in backends:
        await backend.start()
    try:
        settings = router_settings(
            [b.url for b in backends],
            upstream={"max_connections": 3},
            balancing={"policy": "round_robin"},
            health={"interval_s": 0.05},
        )
        r = await router(settings)
        await eventually(lambda: all(b.health_probes >= 1 and b.open == 0 for b in backends))
        async with httpx.AsyncClient(timeout=10) as c:
            tasks = [asyncio.create_task(c.get(f"{r.url}/held/{i}")) for i in range(8)]
            await eventually(lambda: sum(len(b.requests) for b in backends) == 3)
            await asyncio.sleep(0.2)
            assert sum(len(b.requests) for b in backends) == 3, "the rest wait for room under the limit"
            # Data-path connections only: a health probe (every 50 ms, its own connection, closed
            # after its answer) may be open at this instant too, and probes never wait for room.
            assert sum(len(b.conns) for b in backends) <= 3
            # Probes never wait for room: a router busy at its limit still sees a healthy fleet.
            probes = [b.health_probes for b in backends]
            await eventually(
                lambda: all(b.health_probes > n + 2 for b, n in zip(backends, probes, strict=True))
            )
            assert all(b.state.value == "healthy" for b in r.app.backends.backends())
            assert (await c.get(f"{r.url}/readyz")).status_code == 200
            gate.set()
            got = sorted([(await t).text for t in tasks])
        assert got == sorted(f"/held/{i}" for i in range(8))
        assert all(b.requests for b in backends), "both backends served"
    finally:
        for backend in backends:
            await backend.stop()
