"""Socket options both HTTP/1.1 sides of the relay set on their TCP connections."""

from __future__ import annotations

import asyncio
import contextlib
import socket


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """No Nagle: a response head written ahead of its body must not wait for the peer's delayed ACK
    (~40 ms). asyncio sets it only for sockets created as IPPROTO_TCP; uvloop's accept path not always."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
