"""The listener's answers to what clients and attackers actually send, as raw bytes over loopback.

Each test pins one behaviour that once went wrong: unbounded header and trailer fields, unbounded body
buffering and connections, a 413 that async clients never read, a body lost to an Upgrade offer,
framing and version cases RFC 9112 settles (nginx where it leaves room), pipelining order, header
hygiene, and keep-alive idle time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import openai
import pytest

from prefix_router.frontend.exchange import Exchange
from prefix_router.frontend.http1 import Listener, ListenerLimits
from prefix_router.frontend.local_routes import error_response_parts
from prefix_router.settings import Settings, load_settings

from fakebackend import FakeBackend
from rawhttp import closed_by_peer, connection, read_response, request
from routerkit import RunningRouter, router_settings

MakeBackends = Callable[..., Awaitable[list[FakeBackend]]]
MakeRouter = Callable[[Settings], Awaitable[RunningRouter]]
MiB = 1024 * 1024


async def started(
    fake_backends: MakeBackends, router: MakeRouter, **server: object
) -> tuple[FakeBackend, RunningRouter]:
    backends = await fake_backends(1)
    return backends[0], await router(router_settings(backends, server=dict(server)))


async def healthz_rounds(port: int, rounds: int) -> int:
    """GET /healthz `rounds` times on one kept-alive connection; how many were answered 200."""
    ok = 0
    async with connection(port) as (reader, writer):
        for _ in range(rounds):
            writer.write(request("GET", "/healthz"))
            if (await read_response(reader, timeout_s=30)).status == 200:
                ok += 1
            await asyncio.sleep(0.01)
    return ok


async def flood(port: int, prefix: bytes, piece: bytes, cap_bytes: int) -> tuple[int | None, int]:
    """Send `prefix`, then `piece` over and over (never a line end) until the router answers or closes,
    at most `cap_bytes`; the status it answered (None: none) and the bytes sent."""
    sent = 0
    async with connection(port) as (reader, writer):
        writer.write(prefix)
        answer: asyncio.Task[bytes] = asyncio.ensure_future(reader.read(65536))
        try:
            while sent < cap_bytes and not answer.done():
                writer.write(piece)
                await writer.drain()
                sent += len(piece)
                await asyncio.sleep(0)
        except ConnectionError:
            pass
        try:
            got = await asyncio.wait_for(answer, 10)
        except (TimeoutError, ConnectionError):
            return None, sent
        if not got.startswith(b"HTTP/1.1 "):
            return None, sent
        return int(got[9:12]), sent


# -- 1. header and trailer fields are counted as they arrive ---------------------------------------

FLOODS = [
    pytest.param(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Flood: ", id="endless-header-value"),
    pytest.param(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Flood", id="endless-header-name"),
    pytest.param(b"GET /", id="endless-request-target"),
    pytest.param(
        b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\nX-Trailer: ",
        id="endless-trailer-value",
    ),
]


@pytest.mark.parametrize("prefix", FLOODS)
async def test_an_endless_field_is_refused_431_at_the_head_limit_while_others_are_served(
    fake_backends: MakeBackends, router: MakeRouter, prefix: bytes
) -> None:
    backend, r = await started(fake_backends, router, max_header_bytes=16384)
    flooder = asyncio.ensure_future(flood(r.port, prefix, b"a" * 512, cap_bytes=4 * MiB))
    answered = await healthz_rounds(r.port, 20)
    status, sent = await flooder
    assert answered == 20, "other clients' /healthz answered during the flood"
    assert status == 431, f"the flooder is refused at the limit (got {status} after {sent} bytes)"
    assert sent < 1 * MiB, "refused near the limit, not after megabytes"
    assert backend.seen == []


async def test_trailer_fields_count_against_the_head_limit(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backend, r = await started(fake_backends, router, max_header_bytes=4096)
    trailers = b"".join(b"X-T%d: %s\r\n" % (i, b"v" * 100) for i in range(200))
    async with connection(r.port) as (reader, writer):
        writer.write(
            b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n"
            + trailers
            + b"\r\n"
        )
        resp = await read_response(reader)
        assert resp.status == 431 and resp.json()["error"]["code"] == "headers_too_large"
        assert await closed_by_peer(reader)
    assert backend.seen == []


# -- 2. a global budget for buffered bodies, and a connection cap ----------------------------------


async def test_bodies_over_the_global_budget_wait_then_get_503_while_small_requests_are_served(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    budget = 2 * MiB + 65536  # two uploads under way, and room for small bodies beside them
    backend, r = await started(fake_backends, router, max_body_bytes=1 * MiB, max_buffered_body_bytes=budget)
    head = request("POST", "/v1/completions", headers={"Content-Length": str(1 * MiB)})
    async with (
        connection(r.port) as (r1, w1),
        connection(r.port) as (r2, w2),
        connection(r.port) as (r3, w3),
    ):
        w1.write(head + b"a" * 1000)  # two uploads under way: no room for a third
        w2.write(head + b"b" * 1000)
        await asyncio.sleep(0.2)
        w3.write(head + b"c" * 1000)
        assert await healthz_rounds(r.port, 3) == 3, "requests without a body pass meanwhile"
        async with connection(r.port) as (r4, w4):
            w4.write(request("POST", "/small", b'{"prompt": "hi"}'))  # a body that fits goes ahead
            assert (await read_response(r4)).status == 200
        third = await read_response(r3, timeout_s=15)
        assert third.status == 503, "no room within the wait: refused, not buffered"
        assert third.header("retry-after") is not None
        assert third.json()["error"]["code"] == "overloaded"
        assert await closed_by_peer(r3)
        w1.write(b"a" * (1 * MiB - 1000))  # the uploads that were admitted complete normally
        w2.write(b"b" * (1 * MiB - 1000))
        assert (await read_response(r1)).status == 200
        assert (await read_response(r2)).status == 200
    assert sorted(s.path for s in backend.seen) == ["/small", "/v1/completions", "/v1/completions"]


async def test_a_body_waiting_for_budget_goes_through_when_room_frees_within_the_wait(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backend, r = await started(fake_backends, router, max_body_bytes=1 * MiB, max_buffered_body_bytes=1 * MiB)
    head = request("POST", "/v1/completions", headers={"Content-Length": str(1 * MiB)})
    async with connection(r.port) as (r1, w1), connection(r.port) as (r2, w2):
        w1.write(head + b"a" * 1000)
        await asyncio.sleep(0.2)
        w2.write(head + b"b" * (1 * MiB))  # sent whole: it waits, held to one read, for the budget
        await asyncio.sleep(0.2)
        w1.write(b"a" * (1 * MiB - 1000))
        assert (await read_response(r1)).status == 200
        second = await read_response(r2)
        assert second.status == 200 and second.json()["body"] == "b" * MiB
    assert len(backend.seen) == 2


async def test_a_connection_over_max_connections_gets_a_503_then_close(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    _, r = await started(fake_backends, router, max_connections=2)
    async with connection(r.port) as (r1, w1), connection(r.port) as (r2, w2):
        for reader, writer in ((r1, w1), (r2, w2)):
            writer.write(request("GET", "/x"))
            assert (await read_response(reader)).status == 200
        async with connection(r.port) as (r3, w3):
            w3.write(request("GET", "/x"))
            refused = await read_response(r3)
            assert refused.status == 503 and refused.json()["error"]["code"] == "overloaded"
            assert await closed_by_peer(r3)
    async with connection(r.port) as (r4, w4):  # room again once the others have gone
        w4.write(request("GET", "/x"))
        assert (await read_response(r4)).status == 200


# -- 3. the 413 reaches async clients (lingering close) --------------------------------------------


async def chunks(total: int, piece: int = 64 * 1024) -> AsyncIterator[bytes]:
    for _ in range(total // piece):
        yield b"a" * piece


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_httpx_async_client_reads_the_413_of_an_oversize_upload(
    fake_backends: MakeBackends, router: MakeRouter, framing: str
) -> None:
    backend, r = await started(fake_backends, router, max_body_bytes=1 * MiB, max_buffered_body_bytes=2 * MiB)
    content = b"a" * (8 * MiB) if framing == "content-length" else chunks(8 * MiB)
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(3):
            resp = await client.post(f"{r.url}/v1/completions", content=content)
            assert resp.status_code == 413
            assert resp.json()["error"]["code"] == "body_too_large"
            content = b"a" * (8 * MiB) if framing == "content-length" else chunks(8 * MiB)
    assert backend.seen == []


async def test_async_openai_sdk_reads_the_413_of_an_oversize_request(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backend, r = await started(fake_backends, router, max_body_bytes=1 * MiB, max_buffered_body_bytes=2 * MiB)
    sdk = openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key="test", max_retries=0, timeout=30)
    try:
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as caught:
                await sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x" * (6 * MiB)}]
                )
            assert caught.value.status_code == 413
            assert caught.value.code == "body_too_large"
    finally:
        await sdk.close()
    assert backend.seen == []


# -- 4. an Upgrade offer does not cost the request its body ----------------------------------------


async def test_a_request_offering_h2c_keeps_its_body_and_the_connection_goes_on(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backend, r = await started(fake_backends, router)
    async with connection(r.port) as (reader, writer):
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Length: 11\r\n\r\n"
            b'{"a": "hi"}' + request("GET", "/next")
        )
        first = await read_response(reader)
        assert first.status == 200, "answered as HTTP/1.1, never 101"
        assert first.json()["body"] == '{"a": "hi"}'
        assert first.json()["headers"]["Content-Length"] == "11"
        assert "upgrade" not in {name.lower() for name in first.json()["headers"]}
        assert (await read_response(reader)).json()["path"] == "/next"
    assert [s.body for s in backend.seen] == [b'{"a": "hi"}', b""]


async def test_a_websocket_upgrade_is_answered_as_a_plain_request(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backend, r = await started(fake_backends, router)
    async with connection(r.port) as (reader, writer):
        writer.write(
            request(
                "GET",
                "/ws",
                headers={"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13"},
            )
            + request("GET", "/after")
        )
        assert (await read_response(reader)).json()["path"] == "/ws"
        assert (await read_response(reader)).json()["path"] == "/after"
    assert [s.path for s in backend.seen] == ["/ws", "/after"]


# -- 5, 6. framing and versions --------------------------------------------------------------------

REFUSED_HEADS = [
    pytest.param(
        b"POST /x HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n", 400, id="http10-chunked"
    ),
    pytest.param(
        b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n1\r\na\r\n0\r\n\r\n",
        501,
        id="gzip-chunked",
    ),
    pytest.param(b"GET /x HTTP/1.1\r\n\r\n", 400, id="no-host"),
    pytest.param(b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, id="two-hosts"),
    pytest.param(b"GET /x HTTP/1.1\r\nHost: a\r\nhost: a\r\n\r\n", 400, id="two-equal-hosts"),
    pytest.param(b"GET /x HTTP/1.1\r\nHost: a/b\r\n\r\n", 400, id="host-with-slash"),
    pytest.param(b"GET /x HTTP/1.1\r\nHost: a b\r\n\r\n", 400, id="host-with-space"),
    pytest.param(b"GET /x HTTP/1.1\r\nHost: a..b\r\n\r\n", 400, id="host-with-dotdot"),
    pytest.param(b"GET /x HTTP/1.1\r\nHost: u@a\r\n\r\n", 400, id="host-with-userinfo"),
    pytest.param(b"GET /x HTTP/2.0\r\nHost: a\r\n\r\n", 505, id="http2-request-line"),
    pytest.param(b"GET /x\r\n", 400, id="http09"),
]


@pytest.mark.parametrize(("data", "status"), REFUSED_HEADS)
async def test_framing_and_version_refusals_are_answered_at_once_then_closed(
    fake_backends: MakeBackends, router: MakeRouter, data: bytes, status: int
) -> None:
    backend, r = await started(fake_backends, router, header_timeout_s=60.0)
    async with connection(r.port) as (reader, writer):
        writer.write(data)
        resp = await read_response(reader, timeout_s=10)  # well before the 60 s head timeout
        assert resp.status == status
        assert set(resp.json()["error"]) >= {"message", "type", "code"}
        assert await closed_by_peer(reader)
    assert backend.seen == []


HTTP09_LINE = b"GET /x\r\n"


@pytest.mark.parametrize("bytewise", [False, True], ids=["whole", "byte-by-byte"])
@pytest.mark.parametrize("before", ["fresh", "pipelined", "after-response"])
async def test_an_http09_request_line_is_refused_at_once_wherever_it_comes_on_the_connection(
    fake_backends: MakeBackends, router: MakeRouter, before: str, bytewise: bool
) -> None:
    """llhttp keeps the previous message's version until the next one's head ends, so after a kept-alive
    HTTP/1.1 request a bare `GET /x` line looked versioned and waited for the head timeout. It must be
    refused at once, as on a fresh connection, whole or one byte per read."""
    backend, r = await started(fake_backends, router, header_timeout_s=60.0)
    async with connection(r.port) as (reader, writer):
        if before != "fresh":
            writer.write(request("GET", "/a"))
        if before == "after-response":
            assert (await read_response(reader)).json()["path"] == "/a"
        for piece in [HTTP09_LINE[i : i + 1] for i in range(len(HTTP09_LINE))] if bytewise else [HTTP09_LINE]:
            writer.write(piece)
            await writer.drain()
            if bytewise:
                await asyncio.sleep(0.01)  # each byte its own read
        if before == "pipelined":
            assert (await read_response(reader)).json()["path"] == "/a"
        refused = await read_response(reader, timeout_s=10)  # well before the 60 s head timeout
        assert refused.status == 400 and refused.json()["error"]["code"] == "bad_request"
        assert await closed_by_peer(reader)
    assert [s.path for s in backend.seen] == ([] if before == "fresh" else ["/a"])


@pytest.mark.parametrize("head_apart", [False, True], ids=["head-in-the-same-read", "head-read-before"])
@pytest.mark.parametrize(
    "pieces",
    [
        pytest.param([b"a:bGET /x\r\n"], id="whole"),
        pytest.param([b"a:b", b"GET /x\r\n"], id="body-then-line"),
        pytest.param([b"a:bGE", b"T /x\r\n"], id="split-in-the-method"),
        pytest.param([b"a:bGET /x", b"\r\n"], id="split-before-the-line-end"),
    ],
)
async def test_an_http09_line_right_behind_a_body_ending_like_a_field_is_refused_at_once(
    fake_backends: MakeBackends, router: MakeRouter, pieces: list[bytes], head_apart: bool
) -> None:
    """A body framed by its length need not end with a line end, so the next request line can share
    its line with the body's last bytes (`a:b` + `GET /x`), which read like a field: that bare line
    must still be refused at once, however the reads split it, not wait out the head timeout."""
    backend, r = await started(fake_backends, router, header_timeout_s=60.0)
    post = request("POST", "/a", b"a:b")[: -len(b"a:b")]
    async with connection(r.port) as (reader, writer):
        if head_apart:
            writer.write(post)
            await writer.drain()
            await asyncio.sleep(0.05)
        else:
            pieces = [post + pieces[0], *pieces[1:]]
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)  # each piece its own read
        assert (await read_response(reader)).json()["path"] == "/a"
        refused = await read_response(reader, timeout_s=10)  # well before the 60 s head timeout
        assert refused.status == 400 and refused.json()["error"]["code"] == "bad_request"
        assert await closed_by_peer(reader)
    assert [(s.path, s.body) for s in backend.seen] == [("/a", b"a:b")]


@pytest.mark.parametrize("target", ["/", "/x"])
async def test_an_http09_line_after_a_split_request_for_the_same_target_is_refused_at_once(
    fake_backends: MakeBackends, router: MakeRouter, target: str
) -> None:
    """The request line of a head split across reads is checked once; what marks it checked must be
    this message's own, even where two messages' targets are one object (one-byte bytes are shared)."""
    backend, r = await started(fake_backends, router, header_timeout_s=60.0)
    async with connection(r.port) as (reader, writer):
        writer.write(f"GET {target} HTTP/1.1\r\n".encode())
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"Host: x\r\n\r\n")
        assert (await read_response(reader)).header("x-fake-backend") == backend.name
        writer.write(f"GET {target}\r\n".encode())
        refused = await read_response(reader, timeout_s=10)  # well before the 60 s head timeout
        assert refused.status == 400 and refused.json()["error"]["code"] == "bad_request"
        assert await closed_by_peer(reader)
    assert len(backend.seen) == 1


@pytest.mark.parametrize(
    ("before", "first"),
    [
        pytest.param(b"", b"GET /x HTTP/1.1\r\nX_A: b /x\r\n", id="dropped-field-ending-like-the-target"),
        pytest.param(b"", b"GET /x HTTP/1.1\r\n", id="request-line-alone"),
        pytest.param(b"", b"GET /x HTTP/1.1\r\nX: a RTSP/1.0\r\n", id="first-field-ending-like-rtsp"),
        pytest.param(b'{"a":1}', b"GET /x HTTP/1.1\r\n", id="behind-a-body-ending-like-a-field"),
        pytest.param(b"q /x\r\na:b", b"GET /x HTTP/1.1\r\n", id="behind-a-body-line-ending-like-the-target"),
    ],
)
async def test_a_versioned_head_split_after_a_line_ending_like_its_target_is_served(
    fake_backends: MakeBackends, router: MakeRouter, before: bytes, first: bytes
) -> None:
    """The request-line checks (HTTP/0.9, RTSP/) read the last lines of a head split across reads: a
    field (reported only once the next begins) or the end of a body before the request line must not
    pass for a request line that is not HTTP/1.x."""
    backend, r = await started(fake_backends, router, header_timeout_s=60.0)
    async with connection(r.port) as (reader, writer):
        writer.write(request("POST", "/a", before) + first)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"Host: x\r\n\r\n")
        assert [(await read_response(reader)).json()["path"] for _ in range(2)] == ["/a", "/x"]
    assert [s.path for s in backend.seen] == ["/a", "/x"]
    assert backend.seen[0].body == before


async def test_http10_without_host_is_still_served(fake_backends: MakeBackends, router: MakeRouter) -> None:
    _, r = await started(fake_backends, router)
    async with connection(r.port) as (reader, writer):
        writer.write(b"GET /x HTTP/1.0\r\n\r\n")
        assert (await read_response(reader)).status == 200


# -- 7. pipelining: order survives a malformed request, and a deferred 100 Continue ----------------


async def test_a_malformed_pipelined_request_is_answered_after_the_valid_ones_before_it(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    backend, r = await started(fake_backends, router)
    async with connection(r.port) as (reader, writer):
        malformed = b"GET /c HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n"
        writer.write(request("GET", "/a") + request("GET", "/b") + malformed)
        assert (await read_response(reader)).json()["path"] == "/a"
        assert (await read_response(reader)).json()["path"] == "/b"
        refused = await read_response(reader)
        assert refused.status == 400 and refused.json()["error"]["code"] == "bad_request"
        assert await closed_by_peer(reader)
    assert [s.path for s in backend.seen] == ["/a", "/b"]


async def test_expect_100_continue_behind_another_request_gets_its_100_when_it_is_current(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    _, r = await started(fake_backends, router)
    async with connection(r.port) as (reader, writer):
        writer.write(
            request("GET", "/first")
            + request("POST", "/second", headers={"Content-Length": "5", "Expect": "100-continue"})
        )
        assert (await read_response(reader)).json()["path"] == "/first"
        interim = await read_response(reader, timeout_s=10)
        assert interim.status == 100, "the 100 comes once the request is the one being answered"
        writer.write(b"hello")
        second = await read_response(reader)
        assert second.json()["path"] == "/second" and second.json()["body"] == "hello"


# -- 8. header hygiene, internal errors, local paths -----------------------------------------------


@pytest.mark.parametrize("allow", [False, True])
async def test_header_names_with_underscores_are_dropped_unless_allowed(
    fake_backends: MakeBackends, router: MakeRouter, allow: bool
) -> None:
    _, r = await started(fake_backends, router, underscores_in_headers=allow)
    async with connection(r.port) as (reader, writer):
        writer.write(request("GET", "/x", headers={"X_Forwarded_For": "6.6.6.6", "X-Kept": "1"}))
        headers = (await read_response(reader)).json()["headers"]
    assert headers["x-kept"] == "1"
    assert ("x_forwarded_for" in headers) is allow


async def test_an_internal_error_is_a_500_internal_error_not_blamed_on_a_backend(
    fake_backends: MakeBackends, router: MakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, r = await started(fake_backends, router)

    async def broken(ex: object) -> None:
        raise RuntimeError("a bug in the router")

    monkeypatch.setattr(r.app.proxy, "handle", broken)
    async with connection(r.port) as (reader, writer):
        writer.write(request("GET", "/x"))
        resp = await read_response(reader)
    assert resp.status == 500
    assert resp.json()["error"]["code"] == "internal_error"
    assert resp.json()["error"]["type"] == "server_error"


@pytest.mark.parametrize("target", ["/%68ealthz", "/healthz%2F", "/%72eadyz", "/metrics%3F"])
async def test_an_encoded_local_path_is_forwarded_not_answered_by_the_router(
    fake_backends: MakeBackends, router: MakeRouter, target: str
) -> None:
    backend, r = await started(fake_backends, router)
    async with connection(r.port) as (reader, writer):
        writer.write(request("GET", target))
        resp = await read_response(reader)
    assert resp.json()["raw_path"] == target
    assert [s.path for s in backend.seen] and resp.header("x-fake-backend") == backend.name


# -- 9. keep-alive idle time -----------------------------------------------------------------------


def test_the_keepalive_default_outlasts_common_client_pools() -> None:
    assert load_settings(None, {}, environ=False).server.keepalive_timeout_s >= 75


@pytest.mark.slow
async def test_a_pooled_connection_idle_6_s_then_reused_is_answered(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    _, r = await started(fake_backends, router)

    async def raw_connection() -> str:
        async with connection(r.port) as (reader, writer):
            writer.write(request("GET", "/one"))
            assert (await read_response(reader)).status == 200
            await asyncio.sleep(6.0)  # longer than httpx's (and the OpenAI SDK's) 5 s pool expiry
            writer.write(request("GET", "/two"))
            return str((await read_response(reader)).json()["path"])

    async def pooled_client() -> str:
        # a real pooled client that keeps its connection as long
        async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(keepalive_expiry=30)) as client:
            assert (await client.get(f"{r.url}/three")).status_code == 200
            await asyncio.sleep(6.0)
            second = await client.get(f"{r.url}/four")
            assert second.status_code == 200
            return str(json.loads(second.content)["path"])

    assert list(await asyncio.gather(raw_connection(), pooled_client())) == ["/two", "/four"]


async def test_answers_before_a_close_survive_requests_pipelined_after_it(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    """Closing with the client's later requests unread would reset the connection, and the client's
    kernel would drop the answers already sent: the close lingers instead."""
    backend, r = await started(fake_backends, router)
    backend.gate = asyncio.Event()  # the answers wait until the client has sent everything
    async with connection(r.port) as (reader, writer):
        writer.write(request("GET", "/a") + request("GET", "/last", headers={"Connection": "close"}))
        for _ in range(3):  # reading pauses after the first of these: the rest stays unread
            await asyncio.sleep(0.1)
            writer.write(request("GET", "/never") * 50)
        await asyncio.sleep(0.1)
        backend.gate.set()
        await asyncio.sleep(0.5)  # read only once the router is done with the connection
        assert (await read_response(reader)).json()["path"] == "/a"
        assert (await read_response(reader)).json()["path"] == "/last"
        assert await closed_by_peer(reader)
    assert [s.path for s in backend.seen] == ["/a", "/last"]


# -- 10. request-target forms (RFC 9112 §3.2) and the protocol name (§3) ---------------------------


async def test_an_absolute_form_request_reaches_the_handler_in_origin_form_with_its_authority_as_host() -> (
    None
):
    """RFC 9112 §3.2.2: the target's authority replaces the Host header; the rest is the origin form."""
    seen: list[tuple[str, bytes, bytes, str, bytes, list[bytes]]] = []

    async def handler(ex: Exchange) -> None:
        hosts = [v for n, v in ex.headers if n == b"host"]
        seen.append((ex.method, ex.target, ex.raw_path, ex.path, ex.query, hosts))
        ex.respond(204, [], b"")

    limits = ListenerLimits(8192, 5.0, 65536, 5.0, 5.0, 5.0)
    listener = Listener(handler, error_response_parts, limits)
    await listener.listen("127.0.0.1", 0)
    port = int(listener.addresses().rsplit(":", 1)[1])
    try:
        async with connection(port) as (reader, writer):
            writer.write(b"GET HTTP://Api.Example:8443/v1/%6dodels?x=1 HTTP/1.1\r\nHost: elsewhere\r\n\r\n")
            writer.write(b"GET https://[::1] HTTP/1.1\r\nHost: elsewhere\r\n\r\n")
            writer.write(b"GET http://a.example HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            for _ in range(3):
                assert (await read_response(reader)).status == 204
    finally:
        await listener.shut_down(1.0, lambda: True)
    assert seen == [
        ("GET", b"/v1/%6dodels?x=1", b"/v1/%6dodels", "/v1/models", b"x=1", [b"Api.Example:8443"]),
        ("GET", b"/", b"/", "/", b"", [b"[::1]"]),
        ("GET", b"/", b"/", "/", b"", [b"a.example"]),
    ]


@pytest.mark.parametrize(("target", "local"), [("/healthz", True), ("/%68ealthz", False)])
async def test_the_local_routes_match_the_origin_form_of_an_absolute_target(
    fake_backends: MakeBackends, router: MakeRouter, target: str, local: bool
) -> None:
    """`GET http://x/healthz` is the router's /healthz, as nginx would read it; an encoded one is not."""
    backend, r = await started(fake_backends, router)
    async with connection(r.port) as (reader, writer):
        writer.write(request("GET", f"http://router.example{target}"))
        resp = await read_response(reader)
    assert resp.status == 200
    assert (resp.header("x-fake-backend") is None) == local
    assert [s.path for s in backend.seen] == ([] if local else [target.replace("%68", "h")])


async def test_an_absolute_form_request_is_routed_as_its_origin_form(
    fake_backends: MakeBackends, router: MakeRouter
) -> None:
    """The routing key comes from the origin-form path and the body: the same backend either way."""
    backends = await fake_backends(4)
    r = await router(router_settings(backends))
    for n in range(12):
        body = json.dumps({"model": "m", "prompt": f"tenant {n}: " + "a long shared system prompt " * 20})
        answered = []
        for target in ("/v1/completions", f"http://host-{n}.example/v1/completions"):
            async with connection(r.port) as (reader, writer):
                writer.write(request("POST", target, body.encode()))
                resp = await read_response(reader)
            assert resp.status == 200, resp.body
            answered.append((resp.header("x-fake-backend"), resp.json()["path"]))
        assert answered[0] == answered[1]


RTSP_REQUEST = b"OPTIONS /m RTSP/1.0\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("cut", range(len(RTSP_REQUEST)))
async def test_an_rtsp_request_split_anywhere_across_reads_is_refused_after_the_one_before_it(
    fake_backends: MakeBackends, router: MakeRouter, cut: int
) -> None:
    """The check for RTSP/ and ICE/ must see the protocol name even when a read ends inside it, in a
    request pipelined behind one that is answered first."""
    backend, r = await started(fake_backends, router)
    async with connection(r.port) as (reader, writer):
        writer.write(request("GET", "/a") + RTSP_REQUEST[:cut])
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(RTSP_REQUEST[cut:])
        first = await read_response(reader)
        second = await read_response(reader)
        assert await closed_by_peer(reader)
    assert (first.status, first.header("x-fake-backend")) == (200, backend.name)
    assert second.status == 400 and second.json()["error"]["type"] == "invalid_request_error"
    assert [s.path for s in backend.seen] == ["/a"]
