"""The upstream Connection, byte by byte, through a fake transport.

The connection is an asyncio protocol: it writes to a transport and is fed bytes by `data_received`.
Here the transport is an object of our own that records writes and closes, and the answer's bytes are
fed in arbitrary splits (hypothesis picks the cut points), so every framing is read the same whatever
way TCP cuts it: the body, the state the connection ends in, and whether it may carry another request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_router.errors import NoAnswer, StreamBroken, UpstreamError
from prefix_router.upstream.http1 import MAX_HEAD_BYTES, Connection, Origin, StaleConnection, State

REQUEST = b"GET /x HTTP/1.1\r\nhost: backend.test:8000\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\n"


class FakeTransport(asyncio.Transport):
    """The part of asyncio.Transport a Connection uses: writes kept, close and reading pause recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False
        self.reading_paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        self.written.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket: set_nodelay leaves it alone

    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.reading_paused = False


def state_of(conn: Connection) -> State:
    """Read afresh each time (a property mypy would otherwise narrow after the first assert)."""
    return conn.state


class Wire:
    """One Connection on a FakeTransport, its body collected, its close to the pool recorded."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.forgotten: list[Connection] = []
        self.conn = Connection(loop, Origin.parse("http://backend.test:8000"), self.forgotten.append)
        self.transport = FakeTransport()
        self.body: list[bytes] = []

    def connect(self) -> None:
        self.conn.connection_made(self.transport)

    def request(self, head_only: bool = False) -> asyncio.Future[None]:
        self.body.clear()
        self.conn.start(b"HEAD /x HTTP/1.1\r\n\r\n" if head_only else REQUEST, head_only=head_only)
        self.conn.attach_body_sink(self.body.append)
        return self.conn.wait_head()

    def feed(self, data: bytes, cuts: Sequence[int] = ()) -> None:
        """`data` in pieces cut at `cuts`, each piece one data_received; stops once the connection closed."""
        at = 0
        for cut in [*sorted(c for c in cuts if 0 < c < len(data)), len(data)]:
            if self.conn.is_closed():
                return
            if cut > at:
                self.conn.data_received(data[at:cut])
            at = cut


@contextmanager
def wire() -> Iterator[Wire]:
    loop = asyncio.new_event_loop()
    try:
        w = Wire(loop)
        w.connect()
        yield w
    finally:
        loop.close()


cuts = st.lists(st.integers(min_value=1, max_value=400), max_size=12)

CHUNKED = (
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nx-trailer: t\r\n\r\n"
)
# (answer, head_only, body, reusable): answers whose end the framing tells, fed whole in any split.
FRAMED = [
    pytest.param(OK + b"content-length: 11\r\n\r\nhello world", False, b"hello world", True, id="cl"),
    pytest.param(OK + b"content-length: 0\r\n\r\n", False, b"", True, id="cl-zero"),
    pytest.param(CHUNKED, False, b"hello world", True, id="chunked-ext-trailer"),
    pytest.param(OK + b"content-length: 11\r\n\r\n", True, b"", True, id="head-with-cl"),
    pytest.param(OK + b"transfer-encoding: chunked\r\n\r\n", True, b"", True, id="head-chunked"),
    pytest.param(b"HTTP/1.1 204 No Content\r\n\r\n", False, b"", True, id="204"),
    pytest.param(b"HTTP/1.1 304 Not Modified\r\ncontent-length: 11\r\n\r\n", False, b"", True, id="304-cl"),
    pytest.param(
        b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
        False,
        b"ok",
        True,
        id="1xx-then-200",
    ),
    pytest.param(OK + b"content-length: 2\r\nconnection: close\r\n\r\nok", False, b"ok", False, id="close"),
    pytest.param(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", False, b"ok", False, id="http10"),
    pytest.param(
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\nok",
        False,
        b"ok",
        True,
        id="http10-keep-alive",
    ),
]


@pytest.mark.parametrize(("answer", "head_only", "body", "reusable"), FRAMED)
@given(cut_at=cuts)
def test_a_framed_answer_is_read_whole_in_any_split_and_its_reuse_decided(
    answer: bytes, head_only: bool, body: bytes, reusable: bool, cut_at: list[int]
) -> None:
    with wire() as w:
        head = w.request(head_only)
        w.feed(answer, cut_at)
        assert head.done() and head.exception() is None
        assert state_of(w.conn) is State.COMPLETE
        assert w.conn.is_answered()
        assert b"".join(w.body) == body
        assert w.conn.is_reusable() is reusable
        assert not w.transport.closed


@given(cut_at=cuts)
def test_a_close_delimited_body_ends_at_the_close_and_leaves_nothing_to_reuse(cut_at: list[int]) -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n" + b"0\r\n\r\nnot chunked" * 20
    with wire() as w:
        w.request()
        w.feed(answer, cut_at)
        assert state_of(w.conn) is State.RECEIVING_BODY, "no framing: only the close ends it"
        end = w.conn.wait_end()
        w.conn.connection_lost(None)
        assert end.done() and end.exception() is None
        assert b"".join(w.body) == answer[answer.index(b"\r\n\r\n") + 4 :]
        assert w.conn.is_answered() and w.conn.is_closed() and not w.conn.is_reusable()
        assert w.forgotten == [w.conn]


def test_states_follow_one_request_and_the_next_on_the_same_connection() -> None:
    loop = asyncio.new_event_loop()
    try:
        w = Wire(loop)
        assert state_of(w.conn) is State.CONNECTING
        w.connect()
        assert state_of(w.conn) is State.IDLE and w.conn.is_idle()
        w.request()
        assert state_of(w.conn) is State.AWAITING_HEAD
        assert w.transport.written == [REQUEST], "the request leaves in one write"
        w.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab")
        assert state_of(w.conn) is State.RECEIVING_BODY and w.conn.has_head()
        assert w.conn.status == 200
        w.feed(b"cd")
        assert state_of(w.conn) is State.COMPLETE
        w.conn.park(loop.time())
        assert state_of(w.conn) is State.IDLE and not w.conn.has_head()
        w.request()
        w.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        assert w.conn.requests == 2 and state_of(w.conn) is State.COMPLETE
        assert repr(w.conn) == "<Connection http://backend.test:8000 complete requests=2>"
        w.conn.close()
        assert state_of(w.conn) is State.CLOSED and w.transport.closed and w.forgotten == [w.conn]
        w.conn.connection_lost(None)
        assert w.forgotten == [w.conn], "the pool forgets a connection once"
    finally:
        loop.close()


STRAY = [
    pytest.param(b"x", id="one-byte"),
    pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nno", id="a-second-answer"),
]


@pytest.mark.parametrize("stray", STRAY)
@pytest.mark.parametrize("same_read", [True, False], ids=["same-read", "later-read"])
def test_bytes_after_a_whole_answer_keep_the_answer_and_close_the_connection(
    stray: bytes, same_read: bool
) -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    with wire() as w:
        w.request()
        if same_read:
            w.feed(answer + stray)
        else:
            w.feed(answer)
            assert w.conn.is_reusable()
            w.feed(stray)
        assert w.conn.is_answered() and b"".join(w.body) == b"ok"
        assert w.conn.is_closed() and w.transport.closed and not w.conn.is_reusable()
        assert w.conn.error is None, "the answer stands"


def test_bytes_while_idle_close_the_connection() -> None:
    with wire() as w:
        w.request()
        w.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        w.conn.park(0.0)
        w.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nno")
        assert w.conn.is_closed() and w.forgotten == [w.conn]


def test_body_bytes_after_a_head_answer_are_never_relayed_and_the_connection_closes() -> None:
    with wire() as w:
        head = w.request(head_only=True)
        w.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
        assert head.done() and head.exception() is None
        assert w.body == [] and w.conn.is_answered()
        assert w.conn.is_closed() and not w.conn.is_reusable()


def test_an_answer_with_reading_paused_is_not_reused() -> None:
    with wire() as w:
        w.request()
        w.conn.pause_reading()
        assert w.transport.reading_paused
        w.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        assert state_of(w.conn) is State.COMPLETE and not w.conn.is_reusable()
        w.conn.resume_reading()
        assert w.conn.is_reusable()


HEAD_FLOODS = [
    pytest.param(b"HTTP/1.1 200 OK\r\nx-flood: ", b"a" * 1000, NoAnswer, id="endless-field-value"),
    pytest.param(b"HTTP/1.1 200 OK\r\n", b"b" * 1000, NoAnswer, id="endless-field-name"),
    pytest.param(b"HTTP/1.1 200 OK\r\n", b"x-f: 1\r\n" * 100, NoAnswer, id="endless-short-fields"),
    pytest.param(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx-t: ",
        b"c" * 1000,
        StreamBroken,
        id="endless-trailer",
    ),
]


@pytest.mark.parametrize(("prefix", "piece", "error"), HEAD_FLOODS)
def test_an_endless_head_or_trailer_is_refused_at_the_limit(
    prefix: bytes, piece: bytes, error: type[UpstreamError]
) -> None:
    with wire() as w:
        head = w.request()
        w.feed(prefix)
        taken = len(prefix)
        while not w.conn.is_closed():
            assert taken <= MAX_HEAD_BYTES + len(piece) + len(prefix), "read past the limit"
            w.feed(piece)
            taken += len(piece)
        assert taken > MAX_HEAD_BYTES - len(piece)
        assert w.transport.closed and not w.conn.is_reusable()
        if error is NoAnswer:
            assert isinstance(head.exception(), NoAnswer)
        else:
            assert isinstance(w.conn.error, StreamBroken)
        assert str(MAX_HEAD_BYTES) in str(w.conn.error)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        pytest.param(b"", NoAnswer, id="nothing"),
        pytest.param(b"HTTP/1.1 200 OK\r\ncontent-le", NoAnswer, id="half-a-head"),
        pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nhal", StreamBroken, id="half-a-body"),
        pytest.param(OK + b"transfer-encoding: chunked\r\n\r\n9\r\nhal", StreamBroken, id="half-a-chunk"),
    ],
)
def test_a_close_before_the_answer_ends_fails_the_request(answer: bytes, error: type[UpstreamError]) -> None:
    with wire() as w:
        head = w.request()
        w.feed(answer)
        end = w.conn.wait_end() if w.conn.has_head() else head
        w.conn.connection_lost(None)
        assert type(end.exception()) is error
        assert w.conn.is_closed() and not w.conn.is_answered()


def test_a_kept_alive_connection_closed_before_a_byte_of_the_next_answer_is_stale() -> None:
    with wire() as w:
        w.request()
        w.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        w.conn.park(0.0)
        head = w.request()
        w.conn.connection_lost(None)
        stale = head.exception()
        assert isinstance(stale, StaleConnection) and stale.sent, "sent: only an idempotent request is resent"


def test_a_request_on_a_connection_closed_before_it_is_written_is_not_sent() -> None:
    with wire() as w:
        w.request()
        w.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        w.conn.park(0.0)
        w.transport.close()  # the close is under way; connection_lost has not run yet
        head = w.request()
        stale = head.exception()
        assert isinstance(stale, StaleConnection) and not stale.sent
        assert w.transport.written == [REQUEST], "nothing more was written"
        assert w.conn.is_closed()


def test_the_router_closing_a_connection_mid_answer_fails_who_waits() -> None:
    with wire() as w:
        head = w.request()
        w.conn.close()
        assert isinstance(head.exception(), NoAnswer)
    with wire() as w:
        w.request()
        w.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nhal")
        end = w.conn.wait_end()
        w.conn.close()
        assert isinstance(end.exception(), StreamBroken)


@pytest.mark.parametrize("coding", [b"gzip", b"gzip, chunked", b"chunked, gzip", b"x-custom"])
def test_a_body_with_a_transfer_coding_other_than_chunked_alone_is_refused_before_a_byte_of_it(
    coding: bytes,
) -> None:
    with wire() as w:
        head = w.request()
        w.feed(OK + b"transfer-encoding: %b\r\n\r\n5\r\nhello\r\n0\r\n\r\n" % coding)
        refused = head.exception()
        assert isinstance(refused, NoAnswer) and "Transfer-Encoding" in str(refused)
        assert w.body == [] and w.conn.is_closed() and w.transport.closed


def test_a_head_answer_naming_a_transfer_coding_is_answered_and_reusable() -> None:
    with wire() as w:
        head = w.request(head_only=True)
        w.feed(OK + b"transfer-encoding: gzip, chunked\r\n\r\n")
        assert head.exception() is None
        assert w.conn.is_answered() and w.conn.is_reusable()
