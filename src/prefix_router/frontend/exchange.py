"""What the relay and the router see of one client request, whatever front end received it.

The HTTP/1.1 listener (`frontend/http1.py`) implements it today; an HTTP/2 listener would hand the relay
the same thing. The request is read whole before it is handed over; the response goes back through
`start`/`write`/`end`, or in one `respond`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from prefix_router.errors import RouterError

ResponseParts = tuple[int, list[tuple[bytes, bytes]], bytes]  # status, headers, body
ErrorRenderer = Callable[[RouterError], ResponseParts]


class FlowControl(Protocol):
    """What a slow client pauses: the upstream connection feeding its response."""

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class Exchange(Protocol):
    """One request, read whole, and the way back to its client."""

    method: str
    target: bytes  # as sent: the backend sees exactly this, even a trailing "?"
    raw_path: bytes  # the path as sent, undecoded: local routes match on it
    path: str  # percent-decoded
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client_ip: str | None
    scheme: str
    client_gone: bool  # the client closed; nothing written will reach it
    started: bool  # a response head has been framed: an error can no longer be answered
    status: int
    flow: FlowControl | None  # set by the relay while a backend streams into this response
    backend: str | None  # for the access log: who answered, on which branch, how many body bytes
    branch: str | None
    model: str | None  # the model routed to, when it is one the fleet serves (metrics, access log)
    sent: int

    @property
    def writing_paused(self) -> bool: ...

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    def flush(self) -> None: ...
    def write(self, data: bytes) -> None: ...
    def end(self) -> None: ...
    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None: ...


Handler = Callable[[Exchange], Awaitable[None]]


class AccessLog(Protocol):
    """Told of every request a listener finished: answered, or refused before it was whole."""

    def answered(self, ex: Exchange, duration_s: float) -> None: ...
    def refused(self, client_ip: str | None, target: bytes, status: int) -> None: ...
