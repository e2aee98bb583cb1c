"""Driving the public HTTP corpora (tests/http/corpus/*.json) through a proxy on loopback.

A case's payload goes to the proxy (the router, or nginx when tools/build_http_corpus.py records the
reference) over one raw connection, in front of a raw backend that records what it receives. The same
driver serves both, so the recorded reference and the tests compare like with like.

Several lanes run at once, each with its own proxy and backend, so a backend's requests always belong
to the one case its lane is running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httptools
from listener_wire import exchange

from prefix_router.settings import Settings

from rawbackend import RawBackend, RawConn, RawRequest
from routerkit import router_settings, start_router

CORPUS_DIR = Path(__file__).parent / "corpus"
BACKEND_MARK = b"x-fake-backend: corpus\r\n"  # what listener_wire counts as the backend's answer
RESPONSE_TARGET = "/corpus-response"


def load_corpus(name: str) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = json.loads((CORPUS_DIR / f"{name}.json").read_text())["cases"]
    return cases


def payload_of(case: dict[str, Any]) -> bytes:
    data: str = case["payload"]
    return data.encode("latin-1")


def backend_answer(req: RawRequest) -> bytes:
    # An answer to HEAD says content-length: 0, so the client side reads it alike without knowing
    # which of its pipelined requests was a HEAD.
    body = (
        b""
        if req.method == "HEAD"
        else b"ok %s %s" % (req.method.encode("latin-1"), req.target.encode("latin-1"))
    )
    return b"HTTP/1.1 200 OK\r\n%bcontent-length: %d\r\n\r\n%b" % (BACKEND_MARK, len(body), body)


async def _echo(req: RawRequest, conn: RawConn) -> bool:
    await conn.send(backend_answer(req))
    return True


# -- request cases -----------------------------------------------------------------------------------


@dataclass
class RequestOutcome:
    """What one request payload did: the requests the backend received (method, target, body), the
    proxy's own refusal if any, and the invariants' raw material."""

    forwarded: list[dict[str, str]] = field(default_factory=list)
    refusal: int | None = None  # status of the proxy's own answer (after the forwarded ones), if any
    silent_close: bool = False  # closed without any answer of its own and nothing forwarded answered
    backend_answers: int = 0  # answers the client got that came from the backend
    own_answers: list[int] = field(default_factory=list)
    closed: bool = False
    malformed: bool = False
    healthy: bool | None = None  # /healthz answered 200 right after the case (router only)

    def expectation(self) -> dict[str, Any]:
        return {"forwarded": self.forwarded, "refusal": self.refusal}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _request_record(req: RawRequest) -> dict[str, str]:
    return {"method": req.method, "target": req.target, "body": req.body.decode("latin-1")}


async def drive_request(
    port: int, backend: RawBackend, payload: bytes, *, read_timeout_s: float = 4.0
) -> RequestOutcome:
    before = {id(conn): len(conn.requests) for conn in backend.conns}  # pooled connections go on
    out = await exchange(port, [payload], read_timeout_s=read_timeout_s)
    await asyncio.sleep(0.01)  # a request forwarded just before the close reaches the backend's log
    got = RequestOutcome(closed=out.closed, malformed=out.malformed)
    got.forwarded = [
        _request_record(r) for conn in backend.conns for r in conn.requests[before.get(id(conn), 0) :]
    ]
    interim = [a for a in out.answers if 100 <= a.status < 200]
    final = [a for a in out.answers if a not in interim]
    got.backend_answers = sum(1 for a in final if a.from_backend)
    got.own_answers = [a.status for a in final if not a.from_backend]
    if got.own_answers:
        got.refusal = got.own_answers[-1]
    elif got.backend_answers < len(got.forwarded) or not final:
        got.silent_close = True
    return got


# -- response cases ----------------------------------------------------------------------------------


@dataclass
class ResponseOutcome:
    """What the client got when the backend answered a plain GET with a payload and closed."""

    status: int | None = None  # the first final response's status
    complete: bool = False  # its framing ended (length reached, last chunk, or close-delimited)
    body: str = ""
    extra_bytes: int = 0  # bytes after the first final response: must be none
    malformed: bool = False
    interim: list[int] = field(default_factory=list)
    healthy: bool | None = None

    def expectation(self) -> dict[str, Any]:
        return {"status": self.status, "complete": self.complete, "body": self.body}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _FirstResponse:
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status: int | None = None
        self.interim: list[int] = []
        self.body = bytearray()
        self.complete = False
        self.headers: list[tuple[bytes, bytes]] = []
        self.consumed = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        assert self.status is not None
        if self.status < 200:
            self.interim.append(self.status)
            self.status, self.headers, self.body = None, [], bytearray()
            return
        self.complete = True


def _framed(headers: list[tuple[bytes, bytes]]) -> bool:
    codings = [t.strip().lower() for n, v in headers if n == b"transfer-encoding" for t in v.split(b",")]
    if codings:
        return codings[-1] == b"chunked"
    return any(n == b"content-length" for n, _ in headers)


def parse_first_response(raw: bytes, closed: bool) -> ResponseOutcome:
    got = ResponseOutcome()
    first = _FirstResponse()
    try:
        # Fed byte by byte up to the end of the first final response, so the bytes after it are
        # counted rather than parsed as a second message (llhttp would read on).
        for i in range(len(raw)):
            try:
                first.parser.feed_data(raw[i : i + 1])
            except httptools.HttpParserUpgrade:
                first.status, first.complete = 101, True  # what follows is another protocol's
            if first.complete:
                got.extra_bytes = len(raw) - i - 1
                break
        else:
            if closed and first.status is not None and not first.complete:
                # Neither a length nor chunked as the final coding: the body is delimited by the
                # close (RFC 9112 §6.3, point 8), so it ends there. httptools has no call to say so.
                first.complete = not _framed(first.headers)
    except httptools.HttpParserError:
        got.malformed = True
    got.status = first.status
    got.interim = first.interim
    got.complete = first.complete
    got.body = bytes(first.body).decode("latin-1")
    return got


async def drive_response(
    port: int, backend: RawBackend, payload: bytes, *, read_timeout_s: float = 4.0
) -> ResponseOutcome:
    async def script(req: RawRequest, conn: RawConn) -> bool:
        await conn.send(payload)
        return False  # then close: a close-delimited body ends here, a short one is cut here

    backend.script = script
    request = f"GET {RESPONSE_TARGET} HTTP/1.1\r\nHost: corpus\r\nConnection: close\r\n\r\n"
    out = await exchange(port, [request.encode()], read_timeout_s=read_timeout_s)
    backend.script = _echo
    return parse_first_response(out.raw, out.closed)


# -- lanes -------------------------------------------------------------------------------------------


@dataclass
class Lane:
    port: int  # the proxy's
    backend: RawBackend
    health_port: int | None = None  # where /healthz is asked after each case (the router's port)


async def start_backend() -> RawBackend:
    backend = RawBackend(_echo)
    await backend.start()
    return backend


async def healthz(port: int) -> bool:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: corpus\r\nConnection: close\r\n\r\n")
        async with asyncio.timeout(5):
            raw = await reader.read()
        return raw.startswith(b"HTTP/1.1 200 ")
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


def corpus_router_settings(backend_url: str) -> Settings:
    """The router as the corpus runs it: default limits; short timeouts, so that every case ends soon
    (an idle kept-alive connection is closed 0.1 s after its last answer, which ends the case)."""
    return router_settings(
        [backend_url],
        server={"header_timeout_s": 1.0, "body_timeout_s": 1.0, "keepalive_timeout_s": 0.1},
    )


@contextlib.asynccontextmanager
async def router_lanes(n: int) -> AsyncIterator[list[Lane]]:
    backends = [await start_backend() for _ in range(n)]
    routers = [await start_router(corpus_router_settings(b.url)) for b in backends]
    try:
        yield [Lane(r.port, b, r.port) for r, b in zip(routers, backends, strict=True)]
    finally:
        for r in routers:
            await r.stop()
        for b in backends:
            await b.stop()


Outcome = RequestOutcome | ResponseOutcome
Drive = Callable[[int, RawBackend, bytes], Awaitable[Outcome]]


async def run_lanes(lanes: Sequence[Lane], cases: Sequence[dict[str, Any]]) -> dict[str, Outcome]:
    """Every case once, spread over the lanes; each lane runs its cases one after the other."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for case in cases:
        queue.put_nowait(case)
    results: dict[str, Outcome] = {}

    async def work(lane: Lane) -> None:
        while not queue.empty():
            case = queue.get_nowait()
            drive: Drive = drive_response if case["kind"] == "response" else drive_request
            got = await drive(lane.port, lane.backend, payload_of(case))
            if lane.health_port is not None:
                got.healthy = await healthz(lane.health_port)
            results[case["id"]] = got

    await asyncio.gather(*(work(lane) for lane in lanes))
    return results


# -- what every case must show ------------------------------------------------------------------------


def check_request(case: dict[str, Any], got: RequestOutcome) -> None:
    """The recorded expectation, and the invariants whatever it is."""
    assert got.healthy, "the router stopped answering /healthz after this case"
    assert not got.malformed, "the router's bytes to the client are not a sequence of responses"
    expect = case["expect"]
    smuggled = [f for f in got.forwarded if f["target"] == "/smuggled"]
    assert len(smuggled) <= sum(1 for f in expect["forwarded"] if f["target"] == "/smuggled"), (
        f"a request hidden in a body reached the backend: {got.forwarded}"
    )
    assert got.forwarded == expect["forwarded"], (
        f"the backend received {got.forwarded}, expected {expect['forwarded']}"
    )
    assert got.backend_answers == len(got.forwarded), "one answer per forwarded request"
    assert not got.silent_close, "the connection closed with a forwarded request unanswered"
    assert got.refusal == expect["refusal"], f"the router's own answers {got.own_answers}"
    if got.refusal is not None:
        assert got.own_answers == [got.refusal], "one refusal, after the forwarded answers"
        assert got.closed, "a refusal closes the connection"


def check_response(case: dict[str, Any], got: ResponseOutcome) -> None:
    assert got.healthy, "the router stopped answering /healthz after this case"
    assert not got.malformed, "the client got bytes that do not parse as a response"
    assert got.extra_bytes == 0, "bytes after the response: a second answer mixed into this one"
    assert got.status is not None, "no answer at all"
    sent = parse_first_response(payload_of(case), closed=True)
    if got.status != 502 and got.complete:
        # Well framed and not the router's 502: the backend's own response, whole.
        assert sent.complete, "a response the backend never finished reached the client as complete"
        assert (got.status, got.body) == (sent.status, sent.body), "relayed status or body changed"
    assert got.expectation() == case["expect"]


def check(case: dict[str, Any], got: Outcome) -> None:
    if isinstance(got, ResponseOutcome):
        check_response(case, got)
    else:
        check_request(case, got)


LANES = 6


async def outcomes_of(*corpora: str) -> dict[str, Outcome]:
    """Each case's outcome, by "corpus/id" (ids are unique within a corpus)."""
    cases = [{**c, "id": f"{name}/{c['id']}"} for name in corpora for c in load_corpus(name)]
    async with router_lanes(LANES) as lanes:
        return await run_lanes(lanes, cases)
