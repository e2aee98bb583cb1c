"""Arbitrary byte streams, split at arbitrary points, against the real listener (hypothesis).

Streams are built from pieces of valid requests (not HEAD: its answers cannot be told apart without
the request; the conformance tables cover it), framing headers, line ends, NULs and random bytes. For
every stream: the router does not crash (no unhandled error, /healthz still answered), what it sends
parses as HTTP/1.1 responses, every request it forwarded got exactly one answer (and nothing was
forwarded it did not answer), its own refusal is the last answer and closes the connection, and once
the connection is gone it holds nothing of it: no connection, no body budget.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from listener_wire import Outcome, exchange

from fakebackend import FakeBackend
from routerkit import RunningRouter, router_settings, start_router

T = TypeVar("T")
MAX_HEAD = 2048

REQUESTS = [
    b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
    b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"POST /d HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\nabc",
    b"GET /e HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
    b"GET /f HTTP/1.0\r\n\r\n",
    b"GET /status/204 HTTP/1.1\r\nHost: x\r\n\r\n",
]
TOKENS = [
    b"\r\n",
    b"\n",
    b"\r",
    b"\x00",
    b" ",
    b"\t",
    b":",
    b"Host: x\r\n",
    b"Content-Length: 3\r\n",
    b"Content-Length: 99999\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: gzip, chunked\r\n",
    b"Connection: close\r\n",
    b"0\r\n\r\n",
    b"ffffffff\r\n",
    b"GET /smuggled HTTP/1.1\r\n",
    b"HTTP/1.1",
    b"X: " + b"a" * 600,
]
stream = st.lists(
    st.one_of(st.sampled_from(REQUESTS), st.sampled_from(TOKENS), st.binary(max_size=24)),
    min_size=1,
    max_size=8,
).map(b"".join)


class Harness:
    """A router and a backend on a loop of their own thread, so hypothesis can drive them from sync code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.errors: list[str] = []
        self.loop.set_exception_handler(lambda _loop, ctx: self.errors.append(str(ctx.get("message"))))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.backend = FakeBackend(name="fuzz")
        self.run(self.backend.start())
        server = {
            "header_timeout_s": 0.2,
            "body_timeout_s": 0.2,
            "keepalive_timeout_s": 0.2,
            "max_header_bytes": MAX_HEAD,
            "max_body_bytes": 4096,
            "max_buffered_body_bytes": 8192,
        }
        self.router: RunningRouter = self.run(start_router(router_settings([self.backend], server=server)))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def settled(self) -> tuple[int, int]:
        """Connections and body budget still held once the client's connection is gone."""
        listener = self.router.server.listener
        assert listener is not None
        for _ in range(200):
            if not listener.connections and listener.budget.used == 0:
                break
            await asyncio.sleep(0.01)
        return len(listener.connections), listener.budget.used

    async def exchange_watched(self, pieces: list[bytes]) -> tuple[Outcome, int]:
        """The exchange, and the most bytes of head and body any connection held meanwhile."""
        listener = self.router.server.listener
        assert listener is not None
        peak = 0
        task = asyncio.ensure_future(exchange(self.router.port, pieces, gap_s=0.001, read_timeout_s=10))
        while not task.done():
            for c in listener.connections:
                peak = max(peak, len(c._held) + c._head_size + c._body_size)
            await asyncio.sleep(0.001)
        return task.result(), peak

    def close(self) -> None:
        self.run(self.router.stop())
        self.run(self.backend.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


class ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def check(h: Harness, out: Outcome, seen: list[str]) -> None:
    assert not out.malformed, f"not HTTP/1.1 responses: {out.raw[:300]!r}"
    answers = [a for a in out.answers if a.status != 100]
    from_backend = [a for a in answers if a.from_backend]
    assert len(from_backend) == len(seen), f"forwarded {seen}, answered {len(from_backend)} of them"
    own = [a for a in answers if not a.from_backend]
    assert len(own) <= 1, f"more than one refusal: {[a.status for a in own]}"
    if own:
        assert answers[-1] is own[0], "the refusal is the last answer"
        assert own[0].status >= 400 and set(own[0].json()["error"]) >= {"message", "type", "code"}


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=stream, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6))
def test_arbitrary_bytes_split_anywhere_keep_the_listener_invariants(
    harness: Harness, data: bytes, cuts: list[int]
) -> None:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    pieces = [data[a:b] for a, b in itertools.pairwise(points) if b > a]
    errors = ErrorLog()
    for name in ("prefix_router", "asyncio"):
        logging.getLogger(name).addHandler(errors)
    try:
        harness.backend.seen.clear()
        out, peak = harness.run(harness.exchange_watched(pieces))
        seen = [s.path for s in harness.backend.seen]
        connections, budget = harness.run(harness.settled())
    finally:
        for name in ("prefix_router", "asyncio"):
            logging.getLogger(name).removeHandler(errors)
    assert out.closed, "every connection ends (idle timeouts are short here)"
    check(harness, out, seen)
    assert peak <= MAX_HEAD + 4096 + len(data), "what a connection holds stays within its limits"
    assert (connections, budget) == (0, 0), "nothing of a closed connection is held"
    assert errors.records == [] and harness.errors == [], errors.records + harness.errors


def test_the_router_still_answers_after_the_fuzz(harness: Harness) -> None:
    out = harness.run(
        exchange(harness.router.port, [b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"])
    )
    assert out.statuses == [200]
