"""Conformance of the main listener, as tables of raw requests and the answers RFC 9112 (and nginx,
where the RFC leaves room) call for.

The cases are written from RFC 9112 and from public corpora: llhttp's request tests and the
Transfer-Encoding mutations of smuggling scanners (smuggler, SMUGGLEtest). Their payloads are data here;
the harness is ours. Every case also checks the invariants that make
smuggling impossible whatever the expected answer: nothing reaches the backend that the router did not
answer (one answer per forwarded request, in order), no request hidden in a body is ever forwarded,
every refusal is an OpenAI-shaped JSON error followed by a close.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
from listener_wire import Outcome, exchange

from fakebackend import FakeBackend
from routerkit import RunningRouter, router_settings, start_router

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_HEAD = 8192
MAX_BODY = 65536
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"


@dataclass
class Stack:
    backend: FakeBackend
    router: RunningRouter


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack() -> AsyncIterator[Stack]:
    backend = FakeBackend(name="conf")
    await backend.start()
    server = {
        "header_timeout_s": 0.5,
        "body_timeout_s": 0.5,
        "keepalive_timeout_s": 0.15,  # each case reads until the router closes
        "max_header_bytes": MAX_HEAD,
        "max_body_bytes": MAX_BODY,
        "max_buffered_body_bytes": 1 << 20,
    }
    r = await start_router(router_settings([backend], server=server))
    yield Stack(backend, r)
    await r.stop()
    await backend.stop()


def head(*lines: str, method: str = "POST", target: str = "/v1/completions", version: str = "1.1") -> bytes:
    return (
        f"{method} {target} HTTP/{version}\r\n" + "".join(f"{line}\r\n" for line in lines) + "\r\n"
    ).encode("latin-1")


@dataclass(frozen=True)
class Expect:
    """`forwarded` requests answered by the backend (their paths, in order), then perhaps one refusal
    with `status` by the router itself, after which the connection is closed."""

    forwarded: tuple[str, ...] = ()
    status: int | None = None  # the router's own refusal, after the forwarded answers
    bodies: tuple[bytes, ...] | None = None  # what the backend received, when the case is about it


def ok(*paths: str, bodies: tuple[bytes, ...] | None = None) -> Expect:
    return Expect(paths or ("/v1/completions",), None, bodies)


def refused(status: int, *before: str) -> Expect:
    return Expect(before, status)


async def run(stack: Stack, pieces: list[bytes], expect: Expect, gap_s: float = 0.0) -> Outcome:
    stack.backend.seen.clear()
    out = await exchange(stack.router.port, pieces, gap_s=gap_s)
    await asyncio.sleep(0.02)
    seen = [s.path for s in stack.backend.seen]
    assert not out.malformed, f"the router's bytes do not parse as responses: {out.raw[:300]!r}"
    assert "/smuggled" not in seen or "/smuggled" in expect.forwarded, (
        f"a smuggled request went through: {seen}"
    )
    from_backend = [a for a in out.answers if a.from_backend]
    assert len(from_backend) == len(seen), f"answered {len(from_backend)}, forwarded {seen}"
    assert [a.json()["path"] for a in from_backend if a.body.startswith(b"{")] == [
        p for p in seen if not p.startswith("/status/")
    ], "each forwarded request answered with its own answer, in order"
    assert tuple(seen) == expect.forwarded, (seen, out.statuses)
    own = [a for a in out.answers if not a.from_backend and a.status != 100]
    if expect.status is None:
        assert own == [], f"unexpected refusal {[(a.status, a.body[:200]) for a in own]}"
    else:
        assert [a.status for a in own] == [expect.status], out.statuses
        assert out.answers[-1] is own[0], "the refusal is the last answer"
        err = own[0].json()["error"]
        assert set(err) >= {"message", "type", "code"}
        assert own[0].headers.get("connection") == "close"
        assert out.closed, "a refusal closes the connection"
    if expect.bodies is not None:
        assert tuple(s.body for s in stack.backend.seen) == expect.bodies
    return out


# -- request framing (RFC 9112 §6) ------------------------------------------------------------------

FRAMING = [
    pytest.param(
        head("Host: x", "Content-Length: 5") + b"hello", ok(bodies=(b"hello",)), id="content-length"
    ),
    pytest.param(head("Host: x", "Content-Length: 0"), ok(bodies=(b"",)), id="content-length-zero"),
    pytest.param(
        head("Host: x", "Content-Length: 005") + b"hello", ok(bodies=(b"hello",)), id="cl-leading-zeros"
    ),
    pytest.param(head("Host: x"), ok(bodies=(b"",)), id="post-without-body"),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        ok(bodies=(b"hello world",)),
        id="chunked",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"A\r\n0123456789\r\n0\r\n\r\n",
        ok(bodies=(b"0123456789",)),
        id="chunked-uppercase-size",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b'5;ext=1;q="a"\r\nhello\r\n0\r\n\r\n',
        ok(bodies=(b"hello",)),
        id="chunk-extensions",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"5\r\nhello\r\n0\r\nX-Trailer: t\r\n\r\n",
        ok(bodies=(b"hello",)),
        id="chunked-with-trailer",
    ),
    pytest.param(
        head("Host: x", "transfer-encoding: CHUNKED") + b"5\r\nhello\r\n0\r\n\r\n",
        ok(bodies=(b"hello",)),
        id="chunked-case-insensitive",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding:\tchunked") + b"5\r\nhello\r\n0\r\n\r\n",
        ok(bodies=(b"hello",)),
        id="chunked-tab-ows",
    ),
    pytest.param(
        head("Host: x", "Content-Length: 5") + b"hello" + SMUGGLED,
        ok("/v1/completions", "/smuggled"),
        id="next-request-after-body-is-a-request",
    ),
    pytest.param(b"\r\n" + head("Host: x", method="GET", target="/x"), ok("/x"), id="leading-empty-line"),
    pytest.param(head(method="GET", target="/x", version="1.0"), ok("/x"), id="http10-close"),
]

SMUGGLING = [
    # CL.TE and TE.CL: both framings in one request (RFC 9112 §6.1: "ought to be handled as an error")
    pytest.param(
        head("Host: x", "Content-Length: 6", "Transfer-Encoding: chunked") + b"0\r\n\r\nG",
        refused(400),
        id="cl-te",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked", "Content-Length: 3") + b"1\r\nG\r\n0\r\n\r\n",
        refused(400),
        id="te-cl",
    ),
    pytest.param(
        head("Host: x", "Content-Length: 4", "Transfer-Encoding: chunked") + b"0\r\n\r\n" + SMUGGLED,
        refused(400),
        id="cl-te-smuggled-request",
    ),
    # duplicate and conflicting Content-Length
    pytest.param(
        head("Host: x", "Content-Length: 5", "Content-Length: 6") + b"hello!", refused(400), id="cl-conflict"
    ),
    pytest.param(
        head("Host: x", "Content-Length: 5", "Content-Length: 5") + b"hello", refused(400), id="cl-duplicate"
    ),
    pytest.param(head("Host: x", "Content-Length: 5, 5") + b"hello", refused(400), id="cl-list"),
    pytest.param(head("Host: x", "Content-Length: +5") + b"hello", refused(400), id="cl-plus-sign"),
    pytest.param(head("Host: x", "Content-Length: -1"), refused(400), id="cl-negative"),
    pytest.param(head("Host: x", "Content-Length: 0x5") + b"hello", refused(400), id="cl-hex"),
    pytest.param(head("Host: x", "Content-Length: 5 5") + b"hello", refused(400), id="cl-inner-space"),
    pytest.param(head("Host: x", "Content-Length: 1_0"), refused(400), id="cl-underscore"),
    pytest.param(head("Host: x", "Content-Length: 99999999999999999999999"), refused(400), id="cl-overflow"),
    pytest.param(head("Host: x", "Content-Length: 1000000"), refused(413), id="cl-over-limit"),
    pytest.param(head("Host: x", "Content-Length : 5") + b"hello", refused(400), id="cl-space-before-colon"),
    pytest.param(head("Host: x", " Content-Length: 5") + b"hello", refused(400), id="cl-leading-space"),
    # chunk-size edge cases
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"ffffffffffffffffffff\r\n",
        refused(400),
        id="chunk-size-overflow",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"-1\r\nhello\r\n0\r\n\r\n",
        refused(400),
        id="chunk-negative",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"0x5\r\nhello\r\n0\r\n\r\n",
        refused(400),
        id="chunk-0x",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"5 \r\nhello\r\n0\r\n\r\n",
        refused(400),
        id="chunk-size-ows",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b" 5\r\nhello\r\n0\r\n\r\n",
        refused(400),
        id="chunk-size-lead-ws",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"5\r\nhelloXX0\r\n\r\n",
        refused(400),
        id="chunk-data-no-crlf",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"5\nhello\n0\n\n", refused(400), id="chunk-bare-lf"
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"5\rhello\r0\r\r", refused(400), id="chunk-bare-cr"
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"g\r\nhello\r\n0\r\n\r\n",
        refused(400),
        id="chunk-size-not-hex",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"\r\n5\r\nhello\r\n0\r\n\r\n",
        refused(400),
        id="chunk-size-empty",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"5;\x00\r\nhello\r\n0\r\n\r\n",
        refused(400),
        id="chunk-ext-nul",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"20000\r\n" + b"a" * 70000,
        refused(413),
        id="chunked-over-limit",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked") + b"5\r\nhello\r\n0\r\nX-T: a\r\n b\r\n\r\n",
        refused(400),
        id="trailer-obs-fold",
    ),
]

# Transfer-Encoding mutations (smuggling scanners' TE.TE lists): anything but one plain `chunked`
# is refused; none is ever read as a different framing.
TE_MUTATIONS = [
    ("Transfer-Encoding: xchunked", 501),
    ("Transfer-Encoding: chunked, identity", 400),  # llhttp: chunked must be the last coding
    ("Transfer-Encoding: identity, chunked", 501),
    ("Transfer-Encoding: gzip, chunked", 501),
    ("Transfer-Encoding: chunked, chunked", 400),
    ("Transfer-Encoding: chunked\t", 400),  # llhttp refuses whitespace after the coding: safe side
    ("Transfer-Encoding: chunk", 501),
    ('Transfer-Encoding: "chunked"', 501),
    ("Transfer-Encoding: chunked\r\nTransfer-Encoding: x", 400),
    ("Transfer-Encoding: x\r\nTransfer-Encoding: chunked", 501),
    ("Transfer-Encoding: chunked, gzip", 400),
    ("Transfer-Encoding : chunked", 400),
    (" Transfer-Encoding: chunked", 400),
    ("\tTransfer-Encoding: chunked", 400),
    ("Transfer-Encoding\t: chunked", 400),
    ("Transfer-Encoding:\r\n chunked", 400),
    ("Transfer-Encoding\r\n: chunked", 400),
    ("Transfer-Encoding: \x0bchunked", 400),
    ("Transfer-Encoding: \x0cchunked", 400),
    ("Transfer-Encoding: chunked\x00", 400),
    ("Transfer-Encoding: \x00chunked", 400),
    ("Transfer-Encoding: ch\x00unked", 400),
    ("Transfer-Encoding: chùnked", 501),
    ("Transfer_Encoding: chunked", None),  # dropped (underscore): a body-less request, then the next
    ("X: x\nTransfer-Encoding: chunked", 400),
    ("X: x\rTransfer-Encoding: chunked", 400),
    ("Transfer-Encoding: chunked\r", 400),
]
SMUGGLING += [
    pytest.param(
        head("Host: x", te) + b"5\r\nhello\r\n0\r\n\r\n" + SMUGGLED,
        refused(status) if status is not None else refused(400, "/v1/completions"),
        id=f"te-{i}-" + te.encode("unicode_escape").decode()[:40],
    )
    for i, (te, status) in enumerate(TE_MUTATIONS)
]

HEADS = [
    pytest.param(head("Host: x", "X: a\x00b"), refused(400), id="nul-in-value"),
    pytest.param(head("Host: x", "X\x00: a"), refused(400), id="nul-in-name"),
    pytest.param(b"GET /a\x00b HTTP/1.1\r\nHost: x\r\n\r\n", refused(400), id="nul-in-target"),
    pytest.param(head("Host: x", "X: a\rb"), refused(400), id="bare-cr-in-value"),
    pytest.param(b"GET /x HTTP/1.1\nHost: x\n\n", refused(400), id="bare-lf-line-ends"),
    pytest.param(b"GET /x HTTP/1.1\r\nHost: x\r\nX: 1\n\r\n", refused(400), id="bare-lf-after-field"),
    pytest.param(head("Host: x", "X: a", " folded"), refused(400), id="obs-fold"),
    pytest.param(head("Host: x", "X: a", "\tfolded"), refused(400), id="obs-fold-tab"),
    pytest.param(head("Host: x", ": empty-name"), refused(400), id="empty-name"),
    pytest.param(head("Host: x", "Bad Name: v"), refused(400), id="space-in-name"),
    pytest.param(head("Host: x", "X(y): v"), refused(400), id="separator-in-name"),
    pytest.param(head("Host: x", "NoColon"), refused(400), id="no-colon"),
    pytest.param(b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n", refused(400), id="space-in-target"),
    # RFC 9112 §3 lets a recipient split the request line on whitespace runs (nginx does): unambiguous
    pytest.param(b"GET  /x HTTP/1.1\r\nHost: x\r\n\r\n", ok("/x"), id="double-space-request-line"),
    pytest.param(b"GET /x HTTP/1.1 \r\nHost: x\r\n\r\n", refused(400), id="trailing-space-request-line"),
    pytest.param(b"GET\t/x HTTP/1.1\r\nHost: x\r\n\r\n", refused(400), id="tab-request-line"),
    pytest.param(b"get /x HTTP/1.1\r\nHost: x\r\n\r\n", refused(400), id="lowercase-method"),
    pytest.param(b"G@T /x HTTP/1.1\r\nHost: x\r\n\r\n", refused(400), id="bad-method-token"),
    pytest.param(b"GET /x HTTP/1.2\r\nHost: x\r\n\r\n", refused(400), id="http-1.2"),
    pytest.param(b"GET /x HTTP/2.0\r\nHost: x\r\n\r\n", refused(505), id="http-2.0"),
    pytest.param(b"GET /x HTTP/3.0\r\nHost: x\r\n\r\n", refused(400), id="http-3.0"),
    pytest.param(b"GET /x http/1.1\r\nHost: x\r\n\r\n", refused(400), id="lowercase-version"),
    pytest.param(b"GET /x\r\n", refused(400), id="http-0.9"),
    pytest.param(b"GET /x\r\n\r\n", refused(400), id="http-0.9-blank-line"),
    pytest.param(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", refused(400), id="h2-prior-knowledge-preface"),
    pytest.param(head(method="GET", target="/x"), refused(400), id="no-host"),
    pytest.param(head("Host: a", "Host: b", method="GET", target="/x"), refused(400), id="two-hosts"),
    pytest.param(head("Host: a\\b", method="GET", target="/x"), refused(400), id="host-backslash"),
    pytest.param(head("Host: a?b", method="GET", target="/x"), refused(400), id="host-query"),
    pytest.param(head("Host:", method="GET", target="/x"), refused(400), id="host-empty"),
    pytest.param(head("Host: [::1]:8080", method="GET", target="/x"), ok("/x"), id="host-ipv6-port"),
    # RFC 9112 §3.2.2: absolute form is accepted and goes on in origin form, as nginx forwards it
    pytest.param(head("Host: other", method="GET", target="http://x/y"), ok("/y"), id="absolute-form"),
    pytest.param(
        head("Host: x", method="GET", target="HTTPS://X:8080/y?q=1"),
        ok("/y"),
        id="absolute-form-https-any-case",
    ),
    pytest.param(head("Host: x", method="GET", target="http://x"), ok("/"), id="absolute-form-empty-path"),
    pytest.param(
        head("Host: x", method="GET", target="http://x?q=1"), ok("/"), id="absolute-form-query-only"
    ),
    pytest.param(
        head("Host: x", method="GET", target="http://[::1]:8080/y"), ok("/y"), id="absolute-form-ip-literal"
    ),
    pytest.param(
        head(method="GET", target="http://x/y", version="1.0"), ok("/y"), id="absolute-form-http10-no-host"
    ),
    pytest.param(head(method="GET", target="http://x/y"), refused(400), id="absolute-form-http11-no-host"),
    pytest.param(head("Host: x", method="GET", target="ftp://x/y"), refused(400), id="absolute-form-ftp"),
    pytest.param(
        head("Host: x", method="GET", target="http://u@x/y"), refused(400), id="absolute-form-userinfo"
    ),
    pytest.param(head("Host: x", method="GET", target="http:///y"), refused(400), id="absolute-form-no-host"),
    pytest.param(
        head("Host: x", method="GET", target="http://x:8o/y"), refused(400), id="absolute-form-bad-port"
    ),
    pytest.param(
        head("Host: x", method="GET", target="http://x..y/z"), refused(400), id="absolute-form-bad-host"
    ),
    pytest.param(head("Host: x", method="CONNECT", target="x:443"), refused(405), id="connect"),
    pytest.param(
        head("Host: x", method="CONNECT", target="http://x/"), refused(405), id="connect-absolute-form"
    ),
    pytest.param(head("Host: x", "X: " + "a" * MAX_HEAD), refused(431), id="head-over-limit"),
    pytest.param(
        head("Host: x", *[f"X-{i}: v" for i in range(MAX_HEAD // 8)]),
        refused(431),
        id="many-fields-over-limit",
    ),
    pytest.param(
        head("Host: x", method="GET", target="/" + "a" * MAX_HEAD), refused(431), id="target-over-limit"
    ),
    pytest.param(head("Host: x", "X: \x80\xff", method="GET", target="/x"), ok("/x"), id="obs-text-value"),
]

PIPELINING = [
    pytest.param(
        head("Host: x", method="GET", target="/a")
        + head("Host: x", method="GET", target="/b")
        + head("Host: x", method="GET", target="/c"),
        ok("/a", "/b", "/c"),
        id="three-gets",
    ),
    pytest.param(
        head("Host: x", "Content-Length: 5", target="/a")
        + b"hello"
        + head("Host: x", method="GET", target="/b"),
        ok("/a", "/b", bodies=(b"hello", b"")),
        id="post-then-get",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked", target="/a")
        + b"5\r\nhello\r\n0\r\n\r\n"
        + head("Host: x", "Content-Length: 2", target="/b")
        + b"hi",
        ok("/a", "/b", bodies=(b"hello", b"hi")),
        id="chunked-then-length",
    ),
    pytest.param(
        head("Host: x", method="GET", target="/a") + b"GARBAGE\r\n\r\n",
        refused(400, "/a"),
        id="get-then-garbage",
    ),
    pytest.param(
        head("Host: x", method="GET", target="/a") + b"GET /x\r\n", refused(400, "/a"), id="get-then-http-0.9"
    ),
    pytest.param(
        head("Host: x", "Content-Length: 5", target="/a") + b"hello" + b"GET /x\r\n",
        refused(400, "/a"),
        id="post-then-http-0.9",
    ),
    pytest.param(
        head("Host: x", "Content-Length: 3", target="/a") + b"a:b" + b"GET /x\r\n",
        refused(400, "/a"),
        id="post-with-a-field-like-body-then-http-0.9",
    ),
    # ... and a 1.x request behind such a body is served, whatever its body and fields read like
    pytest.param(
        head("Host: x", "Content-Length: 3", target="/a")
        + b"a:b"
        + head("Referer: GET /x", "Host: x", method="GET", target="/x"),
        ok("/a", "/x", bodies=(b"a:b", b"")),
        id="post-with-a-field-like-body-then-get-with-a-field-like-its-line",
    ),
    pytest.param(
        head("Host: x", "Content-Length: 11", target="/a")
        + b"GET /x\r\na:b"
        + head("Host: x", method="GET", target="/x"),
        ok("/a", "/x", bodies=(b"GET /x\r\na:b", b"")),
        id="post-with-an-http-0.9-like-body-then-get",
    ),
    # what the HTTP/0.9 check reads must not take a 1.x request for one: a body line, a dropped field
    pytest.param(
        head("Host: x", "Content-Length: 6", target="/a")
        + b"b /x\r\n"
        + head("Host: x", method="GET", target="/x"),
        ok("/a", "/x", bodies=(b"b /x\r\n", b"")),
        id="body-line-like-http-0.9-then-get",
    ),
    pytest.param(
        head("Host: x", method="GET", target="/a") + b"GET /x HTTP/1.1\r\nX_A: b /x\r\nHost: x\r\n\r\n",
        ok("/a", "/x"),
        id="get-then-dropped-field-like-http-0.9",
    ),
    pytest.param(
        head("Host: x", method="GET", target="/a")
        + head("Host: x", "Content-Length: 5", "Content-Length: 6"),
        refused(400, "/a"),
        id="get-then-conflicting-length",
    ),
    pytest.param(
        head("Host: x", "Connection: close", method="GET", target="/a")
        + head("Host: x", method="GET", target="/b"),
        ok("/a"),
        id="nothing-after-connection-close",
    ),
    pytest.param(
        head("Host: x", method="GET", target="/status/204") + head("Host: x", method="GET", target="/b"),
        ok("/status/204", "/b"),
        id="204-then-next",
    ),
    pytest.param(
        head("Host: x", method="GET", target="/status/304") + head("Host: x", method="GET", target="/b"),
        ok("/status/304", "/b"),
        id="304-then-next",
    ),
    pytest.param(
        head("Connection: keep-alive", method="GET", target="/a", version="1.0")
        + head(method="GET", target="/b", version="1.0")
        + head(method="GET", target="/c", version="1.0"),
        ok("/a", "/b"),
        id="http10-keep-alive-then-close",
    ),
    pytest.param(
        head(
            "Host: x",
            "Upgrade: h2c",
            "Connection: Upgrade, HTTP2-Settings",
            "HTTP2-Settings: AAMAAABkAAQAAP__",
            "Content-Length: 5",
            target="/a",
        )
        + b"hello"
        + head("Host: x", method="GET", target="/b"),
        ok("/a", "/b", bodies=(b"hello", b"")),
        id="h2c-upgrade-with-body",
    ),
    pytest.param(
        head("Host: x", "Upgrade: websocket", "Connection: upgrade", method="GET", target="/a")
        + head("Host: x", method="GET", target="/b"),
        ok("/a", "/b"),
        id="websocket-upgrade",
    ),
    pytest.param(
        head(
            "Host: x", "Upgrade: websocket", "Connection: upgrade", "Transfer-Encoding: chunked", target="/a"
        )
        + b"5\r\nhello\r\n0\r\n\r\n"
        + head("Host: x", method="GET", target="/b"),
        ok("/a", "/b", bodies=(b"hello", b"")),
        id="upgrade-chunked-body",
    ),
]


# RFC 9112 §3: a request line's protocol is HTTP. llhttp also takes RTSP/ and ICE/ (and httptools shows
# only their version); nginx answers 400, and so must the router, wherever the line falls in the bytes.
PROTOCOLS = [
    pytest.param(b"OPTIONS /m RTSP/1.0\r\nHost: x\r\n\r\n", refused(400), id="rtsp"),
    pytest.param(b"ANNOUNCE /m RTSP/1.0\r\nHost: x\r\n\r\n", refused(400), id="rtsp-announce"),
    pytest.param(b"GET /m RTSP/1.1\r\nHost: x\r\n\r\n", refused(400), id="rtsp-1.1"),
    pytest.param(b"SOURCE /m ICE/1.0\r\nHost: x\r\n\r\n", refused(400), id="ice"),
    pytest.param(b"GET /m  RTSP/1.0\r\nHost: x\r\n\r\n", refused(400), id="rtsp-after-two-spaces"),
    pytest.param(
        head("Host: x", method="GET", target="/a") + b"OPTIONS /m RTSP/1.0\r\nHost: x\r\n\r\n",
        refused(400, "/a"),
        id="get-then-rtsp",
    ),
    pytest.param(
        head("Host: x", "Content-Length: 5", target="/a") + b"helloSOURCE /m ICE/1.0\r\nHost: x\r\n\r\n",
        refused(400, "/a"),
        id="body-then-ice",
    ),
    pytest.param(
        b"GET /RTSP/1.0 HTTP/1.1\r\nHost: x\r\nX: GET /RTSP/1.0 RTSP/1.0\r\n\r\n",
        ok("/RTSP/1.0"),
        id="rtsp-in-target-and-field",
    ),
    pytest.param(
        b"GET /x HTTP/1.1\r\nX: a RTSP/1.0\r\nHost: x\r\n\r\n",
        ok("/x"),
        id="rtsp-at-the-end-of-the-first-field",
    ),
    pytest.param(
        head("Host: x", "Content-Length: 40", target="/a")
        + b"ICE/1.0\r\nOPTIONS /m RTSP/1.0\r\nHost: x\r\n\r\n"[:40]
        + head("Host: x", method="GET", target="/b"),
        ok("/a", "/b", bodies=(b"ICE/1.0\r\nOPTIONS /m RTSP/1.0\r\nHost: x\r\n\r\n"[:40], b"")),
        id="rtsp-in-a-body",
    ),
    pytest.param(
        head("Host: x", "Transfer-Encoding: chunked", target="/a")
        + b"9\r\nRTSP/1.0\n\r\n0\r\nX: RTSP/1.0\r\n\r\n"
        + head("Host: x", method="GET", target="/b"),
        ok("/a", "/b", bodies=(b"RTSP/1.0\n", b"")),
        id="rtsp-in-a-chunk-and-trailer",
    ),
]


@pytest.mark.parametrize(("data", "expect"), FRAMING + SMUGGLING + HEADS + PIPELINING + PROTOCOLS)
async def test_raw_request_gets_the_answer_the_rfc_calls_for(
    stack: Stack, data: bytes, expect: Expect
) -> None:
    await run(stack, [data], expect)


@pytest.mark.parametrize(("data", "expect"), FRAMING + SMUGGLING[:12] + PIPELINING + PROTOCOLS)
async def test_the_same_bytes_one_at_a_time_get_the_same_answer(
    stack: Stack, data: bytes, expect: Expect
) -> None:
    """Where the segments fall changes nothing (each byte its own write)."""
    pieces = [data[i : i + 1] for i in range(len(data))] if len(data) < 400 else [data]
    await run(stack, pieces, expect)


# -- Expect: 100-continue (RFC 9110 §10.1.1) and HEAD -----------------------------------------------


async def test_expect_100_continue_gets_100_then_the_answer(stack: Stack) -> None:
    data = head("Host: x", "Content-Length: 5", "Expect: 100-continue")
    out = await run(stack, [data, b"hello"], ok(bodies=(b"hello",)), gap_s=0.2)
    assert out.statuses == [100, 200]


async def test_expect_100_continue_from_http10_gets_no_100(stack: Stack) -> None:
    data = head("Content-Length: 5", "Expect: 100-continue", version="1.0")
    out = await run(stack, [data, b"hello"], ok(bodies=(b"hello",)), gap_s=0.2)
    assert out.statuses == [200]


async def test_expect_100_continue_over_the_body_limit_gets_413_and_no_100(stack: Stack) -> None:
    data = head("Host: x", f"Content-Length: {MAX_BODY + 1}", "Expect: 100-continue")
    out = await run(stack, [data], refused(413))
    assert out.statuses == [413]


async def test_head_is_answered_without_a_body_and_the_connection_goes_on(stack: Stack) -> None:
    stack.backend.seen.clear()
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.router.port)
    try:
        writer.write(head("Host: x", method="HEAD", target="/h") + head("Host: x", method="GET", target="/g"))
        raw = b""
        async with asyncio.timeout(10):
            while chunk := await reader.read(65536):
                raw += chunk
    finally:
        writer.close()
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200") and b"content-length" in first.lower()
    assert rest.startswith(b"HTTP/1.1 200"), "the HEAD answer has no body: the next answer follows its head"
    assert [s.path for s in stack.backend.seen] == ["/h", "/g"]
