"""The HTTP/1.1 listener's own limits, below ASGI: request-head size (431) and time (408).

uvicorn's httptools protocol bounds neither the size of a request head nor how long a client may take
to send it, so a slowloris client could hold a connection forever and a 1 MB header would be relayed.
This subclass counts the bytes of each request head and times it from its first byte (and a fresh
connection from its accept), answering as nginx's large_client_header_buffers / client_header_timeout
would, with an OpenAI-shaped JSON body. Framing errors (both Content-Length and Transfer-Encoding,
duplicate Content-Length: llhttp rejects both) get the same JSON shape with 400.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def error_bytes(status: int, message: str, code: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}})
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        % (status, _REASONS[status], len(body))
    )
    return head + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    max_head_bytes = 65536
    head_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._in_head = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._rejected = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        super().data_received(data)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._in_head:
            self._reject(
                408, f"request head not received within {self.head_timeout_s:g} s", "request_timeout"
            )
        elif self.cycle is None or self.cycle.response_complete:
            self.transport.close()  # accepted, and silent: nothing to answer

    def _reject(self, status: int, message: str, code: str) -> None:
        self._rejected = True
        self._disarm()
        self.transport.write(error_bytes(status, message, code))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._reject(400, msg, "bad_request")

    # Parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._in_head = True
        self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        if self._rejected:
            return
        super().on_headers_complete()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.max_head_bytes and not self._rejected:
            self._reject(431, f"request head over {self.max_head_bytes} bytes", "headers_too_large")


def guarded_protocol(max_head_bytes: int, head_timeout_s: float) -> type[GuardedHttpToolsProtocol]:
    """A protocol class with these limits, for uvicorn.Config(http=...)."""
    return type(
        "BoundGuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {"max_head_bytes": max_head_bytes, "head_timeout_s": head_timeout_s},
    )
