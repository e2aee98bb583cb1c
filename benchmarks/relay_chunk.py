"""The router's Python cost of relaying one streamed chunk, without the kernel: µs per SSE event.

One backend connection (`upstream.http1.Connection`, its response head already read, chunked) feeds
one client exchange (`frontend.http1.Http1Exchange`, chunked), as the relay wires them for a stream:
every read of the backend's socket is one chunk holding one ~240-byte SSE event, parsed by llhttp and
written, re-framed, to the client's transport. Both transports are stand-ins whose write keeps the
last piece (a C call), so what is timed is the interpreter, httptools and the framing: the part of a
relayed event that the code of this repository decides. The kernel's part (the read, the write, epoll)
and uvloop's are measured by `long_streams.py` (CPU per relayed event) and are most of the total.

`--streams N` spreads the events over N such pairs in random order, as N open streams do: the objects
of each event are then cold in the CPU's caches, which costs more than the warm loop of `--streams 1`.
Best of --rounds rounds, the median beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import package_version, print_header
from prefix_router.frontend.http1 import Http1Exchange, HttpProtocol, Listener, ListenerLimits
from prefix_router.upstream.http1 import Connection, Origin

EVENT = (
    b'data: {"t":123456789012345,"id":"chatcmpl-long","object":"chat.completion.chunk",'
    b'"created":1700000000,"model":"bench-model","choices":[{"index":0,"delta":{"content":" token"},'
    b'"finish_reason":null}]}\n\n'
)
RESPONSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class StandInTransport:
    """What the two protocols call on a transport; write and is_closing are C callables."""

    def __init__(self) -> None:
        self.written: collections.deque[bytes] = collections.deque(maxlen=1)
        self.write = self.written.append
        self.is_closing = bool  # bool() is False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_stream(loop: asyncio.AbstractEventLoop, listener: Listener) -> Any:
    """A client exchange whose response has started, fed by a backend connection past its head; the
    connection's data_received, which a read of the backend's socket calls."""
    client = HttpProtocol(listener)
    client.connection_made(StandInTransport())  # type: ignore[arg-type]
    ex = Http1Exchange(client, "POST", b"/v1/chat/completions", [], b"", True, True)
    ex.start(200, [(b"content-type", b"text/event-stream")])
    ex.flush()
    conn = Connection(loop, Origin.parse("http://127.0.0.1:1"), lambda c: None)
    conn.connection_made(StandInTransport())  # type: ignore[arg-type]
    conn.start(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n", head_only=False)
    conn.data_received(RESPONSE_HEAD)
    conn.attach_body_sink(ex.write)
    return conn.data_received


async def measure(streams: int, events: int, rounds: int) -> tuple[float, float]:
    """(best, median) µs per event over the rounds."""
    loop = asyncio.get_running_loop()
    limits = ListenerLimits(65536, 30.0, 1 << 20, 30.0, 75.0, 30.0)
    listener = Listener(None, None, limits)  # type: ignore[arg-type]  # no request is ever handled
    feeds = [open_stream(loop, listener) for _ in range(streams)]
    random.Random(1).shuffle(feeds)
    read = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(events):
            feeds[i % streams](read)
        times.append((time.perf_counter() - start) / events * 1e6)
    return min(times), statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4000], help="open streams (default 1 4000)")
    p.add_argument("--events", type=int, default=200_000, help="events a round")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    print_header("Python cost of one relayed chunk", {"httptools": package_version("httptools")})
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        for streams in args.streams:
            best, median = runner.run(measure(streams, args.events, args.rounds))
            rounds = f"best of {args.rounds} rounds (median {median:.3f})"
            print(f"{streams:,} streams: {best:.3f} µs per event, {rounds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
