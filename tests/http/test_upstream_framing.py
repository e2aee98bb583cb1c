"""How the upstream client frames a response body, and the transfer codings it refuses.

The relay decodes chunked and drops Transfer-Encoding (a hop-by-hop field), so a body with any other
transfer coding (`gzip`, `gzip, chunked`, an unknown one) would reach the client still coded and no
longer named; `gzip` alone or `chunked, gzip` would also leave the body to run to the close (RFC 9112
§6.3). nginx refuses all of these with 502 ("upstream sent unknown Transfer-Encoding"); so does the
router, with its OpenAI-shaped 502 for a backend answer it cannot relay. Only `chunked` alone frames a
body by Transfer-Encoding. A HEAD or 304 answer may name the coding the full answer would have had
(§6.1): with no body, there is nothing to frame, and it is relayed. Where the router frames a body,
its rule must agree with llhttp's, which does the parsing: the table checks both.
"""

from __future__ import annotations

import asyncio

import httptools
import httpx
import pytest

from prefix_router.upstream.http1 import Framing, response_framing

from rawbackend import RawConn, RawRequest, Start

CHUNKED_WIRE = b"5\r\nhello\r\n0\r\n\r\n"
TE = b"Transfer-Encoding"

FRAMING = [
    pytest.param([(TE, b"chunked")], Framing.CHUNKED, id="chunked"),
    pytest.param([(TE, b" Chunked ")], Framing.CHUNKED, id="chunked-case-and-spaces"),
    pytest.param([(TE, b"gzip, chunked")], Framing.UNFRAMEABLE, id="gzip-then-chunked"),
    pytest.param([(TE, b"chunked, gzip")], Framing.UNFRAMEABLE, id="chunked-not-final"),
    pytest.param([(TE, b"gzip")], Framing.UNFRAMEABLE, id="gzip-only"),
    pytest.param([(TE, b"x-custom")], Framing.UNFRAMEABLE, id="unknown-coding"),
    pytest.param([(TE, b"xchunked")], Framing.UNFRAMEABLE, id="chunked-as-substring"),
    pytest.param([(TE, b"chunked-ish")], Framing.UNFRAMEABLE, id="chunked-prefix"),
    pytest.param([(TE, b"GZIP ,  CHUNKED ")], Framing.UNFRAMEABLE, id="case-and-spaces"),
    pytest.param([(TE, b"gzip"), (TE, b"chunked")], Framing.UNFRAMEABLE, id="two-fields-chunked-last"),
    pytest.param([(TE, b"chunked"), (TE, b"chunked")], Framing.UNFRAMEABLE, id="chunked-twice"),
    pytest.param(
        [(b"Content-Length", b"%d" % len(CHUNKED_WIRE))], Framing.CONTENT_LENGTH, id="content-length"
    ),
    pytest.param([(b"Content-Type", b"text/plain")], Framing.CLOSE_DELIMITED, id="neither"),
]


class _Events:
    def __init__(self) -> None:
        self.body = b""
        self.complete = False

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


def llhttp_frames(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether llhttp finds the end of a body sent after these headers without the connection closing."""
    events = _Events()
    parser = httptools.HttpResponseParser(events)
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"%s: %s\r\n" % pair for pair in headers) + b"\r\n"
    parser.feed_data(head + CHUNKED_WIRE)
    return events.complete


@pytest.mark.parametrize(("headers", "framing"), FRAMING)
def test_only_chunked_alone_frames_a_body_by_transfer_encoding_as_llhttp_reads_it(
    headers: list[tuple[bytes, bytes]], framing: Framing
) -> None:
    assert response_framing(headers) is framing
    if framing is not Framing.UNFRAMEABLE:
        framed = framing is not Framing.CLOSE_DELIMITED
        assert llhttp_frames(headers) is framed, "the router's rule and the parser's must agree"


REFUSED = [
    pytest.param([b"gzip"], b"\x1f\x8b\x08\x00coded bytes", id="gzip-only"),
    pytest.param([b"chunked, gzip"], b"5\r\nhello\r\n0\r\n\r\n", id="chunked-not-final"),
    pytest.param([b"gzip, chunked"], b"5\r\nhello\r\n0\r\n\r\n", id="gzip-then-chunked"),
    pytest.param([b"x-custom"], b"custom-coded bytes", id="unknown-coding"),
    pytest.param([b"gzip", b"chunked"], b"5\r\nhello\r\n0\r\n\r\n", id="two-fields"),
]


@pytest.mark.parametrize(("codings", "body"), REFUSED)
async def test_an_answer_with_a_transfer_coding_other_than_chunked_alone_is_a_502(
    raw: Start, client: httpx.AsyncClient, codings: list[bytes], body: bytes
) -> None:
    async def script(req: RawRequest, conn: RawConn) -> bool:
        fields = b"".join(b"transfer-encoding: %b\r\n" % c for c in codings)
        await conn.send(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n" + fields + b"\r\n" + body
        )
        return codings[-1].endswith(b"chunked")  # a body that ends at the close closes; else kept open

    backend, r = await raw(script)
    for _ in range(2):
        resp = await client.get(f"{r.url}/coded")
        assert resp.status_code == 502
        error = resp.json()["error"]
        assert error["code"] == "upstream_unavailable" and error["type"] == "server_error"
        assert "Transfer-Encoding" in error["message"]
    assert len(backend.conns) == 2, "a refused answer's connection is never reused"
    if codings[-1].endswith(b"chunked"):  # kept open by the backend: the router closed it
        for conn in backend.conns:
            await asyncio.wait_for(conn.eof.wait(), 5)


@pytest.mark.parametrize(
    ("method", "status"),
    [pytest.param("HEAD", b"200 OK", id="head"), pytest.param("GET", b"304 Not Modified", id="304")],
)
async def test_a_bodiless_answer_naming_a_transfer_coding_is_relayed(
    raw: Start, client: httpx.AsyncClient, method: str, status: bytes
) -> None:
    async def script(req: RawRequest, conn: RawConn) -> bool:
        await conn.send(b'HTTP/1.1 %b\r\netag: "v1"\r\ntransfer-encoding: gzip, chunked\r\n\r\n' % status)
        return True

    backend, r = await raw(script)
    for _ in range(2):
        resp = await client.request(method, f"{r.url}/coded")
        assert resp.status_code == int(status[:3])
        assert resp.headers["etag"] == '"v1"'
        assert "gzip" not in resp.headers.get("transfer-encoding", "")
        assert resp.content == b""
    assert len(backend.conns) == 1, "no body, nothing left unread: the connection is reused"


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"2;\r\naa\r\n0\r\n\r\n", id="extension-without-name"),
        pytest.param(b"5  \r\nhello\r\n0\r\n\r\n", id="space-after-size"),
        pytest.param(b"zz\r\nhello\r\n0\r\n\r\n", id="size-not-hex"),
    ],
)
async def test_a_head_and_a_broken_chunked_body_in_one_read_get_a_502(
    raw: Start, client: httpx.AsyncClient, body: bytes
) -> None:
    # Nothing of the answer has reached the client when the parser refuses its body: the client can
    # still be told, and an empty close would leave it guessing (llhttp's response corpus has these).
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"

    async def script(req: RawRequest, conn: RawConn) -> bool:
        await conn.send(head + body)
        return False

    _, r = await raw(script)
    resp = await client.get(f"{r.url}/broken")
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "upstream_unavailable"
