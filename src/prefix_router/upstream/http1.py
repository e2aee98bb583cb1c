"""One HTTP/1.1 client connection to a backend: an explicit state machine on httptools' (llhttp's) parser.

A purpose-built client: the data path used aiohttp's client until measurement showed it was the largest
single cost of a proxied request (README, "Why our own HTTP/1.1"); a relay needs only a small part of a
general client: one request at a time per connection, bytes in, bytes out, and body chunks pushed to a
sink as they arrive.

The states, and the only transitions between them (each one a call of `Connection._enter`):

    CONNECTING ──connection_made──▶ IDLE ──start──▶ AWAITING_HEAD ──final head──▶ RECEIVING_BODY
                                     ▲                   │ HEAD, 204, 304             │ length reached,
                                     │                   ▼                            │ last chunk, or the
                                     └───park (pool)── COMPLETE ◀─────────────────────┘ close (no framing)
    every state ──close, fail, connection_lost──▶ CLOSED (terminal)

There is no sending state: a request (head and body, bounded by the listener's max_body_bytes) leaves in
one transport.write, which never blocks; the transport buffers what the socket does not take at once.
An interim 1xx answer keeps the connection in AWAITING_HEAD. Bytes that arrive outside AWAITING_HEAD and
RECEIVING_BODY (after a whole answer, while idle) answer nothing that was asked: the connection closes.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from prefix_router.errors import NoAnswer, StreamBroken, StreamIdleTimeout, UpstreamError
from prefix_router.tcp import set_nodelay

BodySink = Callable[[bytes], None]
_NO_BODY_STATUSES = frozenset({204, 304})
MAX_HEAD_BYTES = 65536  # a backend's response head; over it the answer is refused (nginx: 4-8 KB buffers)
# Also the bound on bytes read without a body byte among them (a head, chunk framing, a trailer
# section): httptools hands a field over only once it ends, so a field that never ends is counted here.


class State(enum.Enum):
    CONNECTING = "connecting"  # TCP (and TLS) handshake under way
    IDLE = "idle"  # connected, no request on it
    AWAITING_HEAD = "awaiting_head"  # request written; the final answer's head not read yet
    RECEIVING_BODY = "receiving_body"  # head read; the body is arriving
    COMPLETE = "complete"  # the answer read whole; the pool parks it (IDLE) if it is reusable
    CLOSED = "closed"  # the transport is closed or closing; never leaves this state


# Module constants: read on every segment, cheaper than the enum's attribute lookup.
_CONNECTING = State.CONNECTING
_IDLE = State.IDLE
_AWAITING_HEAD = State.AWAITING_HEAD
_RECEIVING_BODY = State.RECEIVING_BODY
_COMPLETE = State.COMPLETE
_CLOSED = State.CLOSED


class Framing(enum.Enum):
    """How a response body's end is known (RFC 9112 §6.3)."""

    CONTENT_LENGTH = "content-length"
    CHUNKED = "chunked"
    CLOSE_DELIMITED = "close-delimited"  # no Transfer-Encoding, no Content-Length: the close ends it
    UNFRAMEABLE = "unframeable"  # a transfer coding other than exactly `chunked`: refused


def response_framing(headers: list[tuple[bytes, bytes]]) -> Framing:
    """How a response body with these headers is framed, read the way nginx's upstream module does.

    With Transfer-Encoding, only `chunked` alone is relayable: the relay decodes chunked and drops the
    field (hop-by-hop), so any other coding (`gzip`, `gzip, chunked`, an unknown one, chunked twice)
    would reach the client still applied and no longer named. `gzip` alone or `chunked, gzip` would
    also leave the body to run to the close (§6.3, as llhttp reads it). nginx answers 502 to all of
    these ("upstream sent unknown Transfer-Encoding"); so does the router. Fields are joined into one
    list of codings first (§5.3), names and codings case-insensitive."""
    codings: list[bytes] | None = None
    has_length = False
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"transfer-encoding":
            listed = [c.strip().lower() for c in value.split(b",") if c.strip()]
            codings = listed if codings is None else codings + listed
        elif lowered == b"content-length":
            has_length = True
    if codings is not None:
        return Framing.CHUNKED if codings == [b"chunked"] else Framing.UNFRAMEABLE
    return Framing.CONTENT_LENGTH if has_length else Framing.CLOSE_DELIMITED


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a backend listens, and the Host header its requests carry."""

    scheme: str
    host: str  # as connect() takes it: no brackets around IPv6
    port: int
    host_header: bytes

    @classmethod
    def parse(cls, origin: str) -> Origin:
        parts = urlsplit(origin)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname or "", port, parts.netloc.encode("latin-1"))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host_header.decode('latin-1')}"


class StaleConnection(UpstreamError):
    """A kept-alive connection closed before any byte of the answer: the request may be resent once.

    `sent` says whether the request went out before the close was seen: one that never left may be
    resent whatever its method; one the backend may have read, only if it is idempotent."""

    kind = "no_answer"

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class _Refused(Exception):
    """Raised from a parser callback to stop parsing an answer the router refuses (the parser
    re-raises it as HttpParserCallbackError; the reason travels in Connection.refusal)."""


class Connection(asyncio.Protocol):
    """One TCP connection to a backend, carrying one request at a time (see the module docstring).

    `on_close` runs once, when the connection enters CLOSED: the pool forgets it there."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, origin: Origin, on_close: Callable[[Connection], None]
    ) -> None:
        self._loop = loop
        self.origin = origin
        self._on_close = on_close
        self._state = _CONNECTING
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.requests = 0  # requests written on this connection, the current one included
        self.idle_since = 0.0
        self.last_data = 0.0
        self._reading_paused = False
        self._idle_s = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._bytes_since_body = 0
        self.refusal: str | None = None
        self._keep_alive = True
        self._head_only = False
        self._framing = Framing.CLOSE_DELIMITED
        self.error: UpstreamError | None = None
        self._answered = False  # the answer was read whole (it stands even if the connection then closes)
        self._buffered: list[bytes] = []
        self._sink: BodySink | None = None
        self._on_first: Callable[[], None] | None = None
        self._got_body = False
        self._waiter: asyncio.Future[None] | None = None
        self._got_bytes = False

    def __repr__(self) -> str:
        return f"<Connection {self.origin} {self._state.value} requests={self.requests}>"

    @property
    def state(self) -> State:
        return self._state

    def _enter(self, state: State) -> None:
        self._state = state

    # -- predicates ------------------------------------------------------------------------------

    def is_closed(self) -> bool:
        return self._state is _CLOSED

    def is_idle(self) -> bool:
        return self._state is _IDLE

    def has_head(self) -> bool:
        """The final answer's head is read (status and raw_headers hold it)."""
        return self._state is _RECEIVING_BODY or self._answered

    def is_answered(self) -> bool:
        """The answer was read whole, whatever happened to the connection after."""
        return self._answered

    def has_body_bytes(self) -> bool:
        """Some of the answer's body has been parsed (handed to a sink, or buffered for one)."""
        return self._got_body

    def is_reusable(self) -> bool:
        """It may carry another request: the answer read whole, both ends keeping the connection, and
        no bytes left unread under a paused transport."""
        return self._state is _COMPLETE and self._keep_alive and not self._reading_paused

    # -- the request -----------------------------------------------------------------------------

    def start(self, data: bytes, head_only: bool) -> None:
        """IDLE → AWAITING_HEAD: write the request. A connection that closed before it could be
        written fails at once (StaleConnection if it served a request before): wait_head() raises."""
        self._reset()
        self._head_only = head_only
        transport = self.transport
        if self._state is not _IDLE or transport is None or transport.is_closing():
            if self.requests:
                self.error = StaleConnection(
                    "kept-alive connection closed before the request was sent", sent=False
                )
            else:
                self.error = NoAnswer("connection closed before the request was sent")
            self.close()
            return
        self.requests += 1
        self._enter(_AWAITING_HEAD)
        transport.write(data)

    def park(self, now: float) -> None:
        """COMPLETE → IDLE: the pool keeps it for the next request."""
        assert self.is_reusable(), self
        self.idle_since = now
        self._answered = False  # that answer was the last request's
        self._sink = None
        self._on_first = None
        self._enter(_IDLE)

    def wait_head(self) -> asyncio.Future[None]:
        """A future set when the final answer's head is read, or failed with why it will not be."""
        return self._wait(_AWAITING_HEAD)

    def wait_end(self) -> asyncio.Future[None]:
        """A future set when the body is read whole, or failed with why it will not be."""
        return self._wait(_RECEIVING_BODY)

    def _wait(self, leaving: State) -> asyncio.Future[None]:
        fut = self._loop.create_future()
        if self.error is not None:
            fut.set_exception(self.error)
        elif self._state is not leaving:
            fut.set_result(None)  # already past that step
        else:
            self._waiter = fut
        return fut

    def _wake(self) -> None:
        fut = self._waiter
        if fut is not None:
            self._waiter = None
            if not fut.done():
                if self.error is not None:
                    fut.set_exception(self.error)
                else:
                    fut.set_result(None)

    def attach_body_sink(self, sink: BodySink, on_first: Callable[[], None] | None = None) -> None:
        """Body chunks go to `sink` from now on, those that arrived before first; `on_first` runs once,
        before the first chunk."""
        self._sink = sink
        self._on_first = on_first
        if self._buffered:
            self._flush_body()

    def detach_body_sink(self) -> None:
        self._sink = None
        self._on_first = None

    def fail(self, error: UpstreamError) -> None:
        """Any state → CLOSED, with `error` for whoever waits (unless the answer was already whole)."""
        if self.error is None and not self._answered:
            self.error = error
        self.close()
        self._wake()

    def close(self) -> None:
        """Any state → CLOSED. A request in flight fails: who waits on it is told the router closed it."""
        self.unwatch_idle()
        if self._state is _CLOSED:
            return
        if self.error is None:
            if self._state is _AWAITING_HEAD:
                self.error = NoAnswer("connection closed by the router before the answer")
            elif self._state is _RECEIVING_BODY:
                self.error = StreamBroken("connection closed by the router mid-body")
        self._enter(_CLOSED)
        if self.transport is not None:
            self.transport.close()
        self._on_close(self)
        self._wake()

    def pause_reading(self) -> None:
        """The client reads slower than the backend writes: let TCP push back on the backend."""
        if not self._reading_paused and self.transport is not None and self._state is not _CLOSED:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and self._state is not _CLOSED:
            self._reading_paused = False
            self.transport.resume_reading()

    def watch_idle(self, idle_s: float) -> None:
        """Fail the body when nothing arrived for idle_s, not counting time a slow client held us."""
        self._idle_s = idle_s
        self._idle_timer = self._loop.call_later(idle_s, self._check_idle)

    def unwatch_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self._state is not _RECEIVING_BODY:
            return
        now = self._loop.time()
        if self._reading_paused:
            self.last_data = now
        left = self.last_data + self._idle_s - now
        if left > 0:
            self._idle_timer = self._loop.call_at(now + left, self._check_idle)
            return
        self.fail(StreamIdleTimeout(f"no chunk within {self._idle_s:g} s"))

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)
        if self._state is _CONNECTING:
            self._enter(_IDLE)
        else:  # closed while the handshake ran (the connect was cancelled)
            transport.close()

    def data_received(self, data: bytes) -> None:
        state = self._state
        if state is not _RECEIVING_BODY and state is not _AWAITING_HEAD:
            self.close()  # bytes nobody asked for: the connection cannot be trusted for another request
            return
        self._got_bytes = True
        self.last_data = self._loop.time()
        self._bytes_since_body += len(data)  # on_body sets it back to 0
        error: UpstreamError | None = None
        try:
            self._parser.feed_data(data)
            if self._head_only and self._answered:
                # llhttp cannot be told that a HEAD answer has no body: a fresh parser reads the next.
                self._parser = httptools.HttpResponseParser(self)
        except httptools.HttpParserUpgrade:
            error = NoAnswer("backend switched protocols unasked")
        except httptools.HttpParserError as exc:
            if self._answered:
                self.close()  # bytes after a whole answer: the answer stands, the connection does not
            elif self.refusal is not None:
                error = StreamBroken(self.refusal) if self.has_head() else NoAnswer(self.refusal)
            elif self.has_head():
                error = StreamBroken(f"invalid response body from backend: {exc}")
            else:
                error = NoAnswer(f"invalid response from backend: {exc}")
        if error is None and self._bytes_since_body > MAX_HEAD_BYTES and not self._answered:
            # A head or a trailer section still going past the limit: refused now, not at the
            # first-byte timeout, before the parser holds (and re-copies) any more of it.
            error = self._refuse("trailer section" if self.has_head() else "head")
        pieces = self._buffered
        if pieces and self._sink is not None:
            if len(pieces) == 1 and self._got_body:
                # The hot path of a stream: one read, one chunk, straight on (no call of _flush_body).
                self._sink(pieces.pop())
            else:
                self._flush_body()
        if error is not None:
            self.fail(error)

    def _refuse(self, part: str) -> UpstreamError:
        self._keep_alive = False
        self.refusal = f"backend's response {part} is over {MAX_HEAD_BYTES} bytes"
        return StreamBroken(self.refusal) if self.has_head() else NoAnswer(self.refusal)

    def _flush_body(self) -> None:
        """Everything one read brought goes to the sink as one piece: one write to the client for
        several SSE events that arrived together, not one per chunk of the backend's framing."""
        sink = self._sink
        assert sink is not None
        pieces = self._buffered
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        if not self._got_body:
            self._got_body = True
            if self._on_first is not None:
                self._on_first()
        sink(data)

    def connection_lost(self, exc: Exception | None) -> None:
        state = self._state
        if state is _AWAITING_HEAD:
            if self.requests > 1 and not self._got_bytes:
                self.fail(StaleConnection("kept-alive connection closed by the backend", sent=True))
            else:
                self.fail(NoAnswer("backend closed the connection before answering"))
        elif state is _RECEIVING_BODY:
            if exc is None and self._framing is Framing.CLOSE_DELIMITED:
                self.on_message_complete()
            else:
                self.fail(StreamBroken("backend closed the connection mid-body"))
        self.close()  # CONNECTING, IDLE, COMPLETE: nothing was waited for; CLOSED: a no-op

    def pause_writing(self) -> None:  # the request body is bounded by max_body_bytes: buffer it
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._state is not _AWAITING_HEAD:
            # A second answer to one request: never relayed, and the connection is not reused.
            self._keep_alive = False
            raise _Refused

    def on_header(self, name: bytes, value: bytes) -> None:
        # Head and trailer section each have the budget (_head_bytes restarts at the head's end).
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse("trailer section" if self.has_head() else "head")
            raise _Refused
        if self._state is _AWAITING_HEAD:  # a trailer field is not a header of the answer: counted, dropped
            self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status == 101:
            self.refusal = "backend switched protocols (101) to a request that asked for none"
            raise _Refused
        if 100 <= status < 200:  # an interim answer (103 Early Hints): the real one follows
            self.raw_headers = []
            return
        self.status = status
        self._keep_alive = self._parser.should_keep_alive()
        self._head_bytes = 0
        if self._head_only or status in _NO_BODY_STATUSES:
            self._answered = True
            self._enter(_COMPLETE)
        else:
            self._framing = response_framing(self.raw_headers)
            if self._framing is Framing.UNFRAMEABLE:
                self._keep_alive = False
                codings = b", ".join(v for n, v in self.raw_headers if n.lower() == b"transfer-encoding")
                named = codings.decode("latin-1")
                self.refusal = f"backend sent a Transfer-Encoding the router cannot relay: {named!r}"
                raise _Refused
            self._enter(_RECEIVING_BODY)
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._state is not _RECEIVING_BODY:
            self._keep_alive = False  # body bytes after a HEAD answer's head: nobody asked for them
            raise _Refused
        self._bytes_since_body = 0
        self._buffered.append(body)  # handed on once the read is parsed (_flush_body)

    def on_message_complete(self) -> None:
        if self._state is not _RECEIVING_BODY:
            return  # the end of an interim 1xx answer (or of a HEAD answer the parser read a body for)
        self._answered = True
        self._enter(_COMPLETE)
        self._wake()
