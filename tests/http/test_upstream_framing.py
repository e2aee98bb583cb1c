"""How the upstream client tells a response body's end: Transfer-Encoding read as a list of codings.

Chunked frames a response body only as the final coding (RFC 9112 §6.1, §6.3); with any other final
coding the body runs to the close. A substring match on "chunked" took `chunked, gzip` for a framed
body, so a close-delimited answer counted as broken at the close and reached the client truncated.
The rule must agree with llhttp's, which does the parsing: the table checks both.
"""

from __future__ import annotations

import asyncio

import httptools
import httpx
import pytest

from prefix_router.upstream.pool import frames_body

from rawbackend import RawConn, RawRequest, Start

CHUNKED_WIRE = b"5\r\nhello\r\n0\r\n\r\n"
TE = b"Transfer-Encoding"

FRAMING = [
    pytest.param([(TE, b"chunked")], True, id="chunked"),
    pytest.param([(TE, b"gzip, chunked")], True, id="gzip-then-chunked"),
    pytest.param([(TE, b"chunked, gzip")], False, id="chunked-not-final"),
    pytest.param([(TE, b"gzip")], False, id="gzip-only"),
    pytest.param([(TE, b"xchunked")], False, id="chunked-as-substring"),
    pytest.param([(TE, b"chunked-ish")], False, id="chunked-prefix"),
    pytest.param([(TE, b"GZIP ,  CHUNKED ")], True, id="case-and-spaces"),
    pytest.param([(TE, b"gzip"), (TE, b"chunked")], True, id="two-fields-chunked-last"),
    pytest.param([(TE, b"chunked"), (TE, b"gzip")], False, id="two-fields-gzip-last"),
    pytest.param([(b"Content-Length", b"%d" % len(CHUNKED_WIRE))], True, id="content-length"),
    pytest.param([(b"Content-Type", b"text/plain")], False, id="neither"),
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


@pytest.mark.parametrize(("headers", "framed"), FRAMING)
def test_body_framing_follows_the_final_transfer_coding_as_llhttp_does(
    headers: list[tuple[bytes, bytes]], framed: bool
) -> None:
    assert frames_body(headers) is framed
    assert llhttp_frames(headers) is framed, "the router's rule and the parser's must agree"


@pytest.mark.parametrize("coding", [b"chunked, gzip", b"gzip"])
async def test_close_delimited_answer_with_a_final_coding_other_than_chunked_arrives_whole(
    raw: Start, client: httpx.AsyncClient, coding: bytes
) -> None:
    # Bytes that look like chunked framing: relayed as they are, never decoded or cut at a "0\r\n\r\n".
    body = b"5\r\nhello\r\n0\r\n\r\n" + bytes(range(256)) * 64

    async def script(req: RawRequest, conn: RawConn) -> bool:
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n")
        await conn.send(b"transfer-encoding: %b\r\n\r\n" % coding)
        for i in range(0, len(body), 4096):
            await conn.send(body[i : i + 4096])
            await asyncio.sleep(0.005)
        return False  # the close ends the body

    backend, r = await raw(script)
    for _ in range(2):
        resp = await client.get(f"{r.url}/coded")
        assert resp.status_code == 200
        assert resp.content == body
    assert len(backend.conns) == 2, "a body read to the close leaves no connection to reuse"


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
