"""A scriptable fake backend on a loopback port, for the router's real-server tests.

It answers every path. What it answers is a typed script, `FakeBackend(script=...)` or
`backend.script = ...` between requests:

- `Echo()` (the default): 200 with what it received as JSON (its name, method, path, query, headers,
  body), so tests see exactly what the router forwarded; held while `gate` is set and not yet open;
- `Reply(status, body, headers)`: that answer (an OpenAI-shaped error body when none is given for a
  status of 400 or more);
- `Stream(chunks, gap_s)`: an SSE stream of `chunks` events, then `[DONE]`;
- `Reset(after_chunks)`: a stream cut by a TCP reset after that many events;
- `Hang()`: never answers, not even the status line;
- `Close()`: closes the connection without answering;
- `Garbage()`: answers bytes that are not HTTP, then closes.

Anything else is refused when it is set, so a test cannot silently get echoes it did not ask for.
Paths script one request whatever the script: /stream?n=&delay=&hang_after= streams, /status/<code>
answers that status with no body.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from loopback import free_socket


@dataclass(frozen=True)
class Echo:
    """200 with the request as JSON."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes | None = None  # None: an OpenAI-shaped error body for status >= 400, else empty
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Stream:
    chunks: int = 5
    gap_s: float | None = None  # None: the backend's chunk_delay_s


@dataclass(frozen=True)
class Reset:
    after_chunks: int = 0


@dataclass(frozen=True)
class Hang:
    """No answer at all: the request waits until the router gives up or the test ends."""


@dataclass(frozen=True)
class Close:
    """The connection closed with nothing sent."""


@dataclass(frozen=True)
class Garbage:
    """Bytes that are not an HTTP response, then a close."""


Script = Echo | Reply | Stream | Reset | Hang | Close | Garbage
SCRIPTS = (Echo, Reply, Stream, Reset, Hang, Close, Garbage)


def checked_script(script: object) -> Script:
    if not isinstance(script, SCRIPTS):
        names = ", ".join(t.__name__ for t in SCRIPTS)
        raise TypeError(f"a FakeBackend script is one of {names}, not {script!r}")
    return script


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    at: float = 0.0  # loop time of arrival


@dataclass
class FakeBackend:
    name: str
    script: Script = field(default_factory=Echo)
    health_status: int = 200
    health_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    first_chunk_delay_s: float = 0.0  # a prefill before a stream's first event
    first_chunk_at: list[float] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    active: int = 0
    peak_active: int = 0
    cancelled: int = 0  # handlers cancelled because the router closed the connection
    health_probes: int = 0
    metrics_scrapes: int = 0
    gate: asyncio.Event | None = None  # when set, Echo requests wait for it (to hold requests in flight)
    port: int = 0
    _runner: web.AppRunner | None = None
    cancel_event: asyncio.Event = field(default_factory=asyncio.Event)

    def __setattr__(self, name: str, value: Any) -> None:
        # A misspelt or retired attribute (the old `mode` strings) fails instead of being ignored.
        if name not in self.__dataclass_fields__ and not hasattr(type(self), name):
            raise AttributeError(f"FakeBackend has no attribute {name!r}")
        if name == "script":
            value = checked_script(value)
        super().__setattr__(name, value)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, sock: socket.socket | None = None) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        if sock is None:
            sock = free_socket(self.port)  # a stopped backend starts again on its port
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.path
        if path == "/health":
            self.health_probes += 1
            if self.health_delay_s:
                await asyncio.sleep(self.health_delay_s)
            return web.Response(status=self.health_status)
        if path == "/metrics":  # the router's side scrapes (KV capacity, load signal): no vLLM series
            self.metrics_scrapes += 1
            return web.Response(text="", content_type="text/plain")
        now = asyncio.get_running_loop().time()
        self.seen.append(Seen(request.method, path, request.query_string, dict(request.headers), body, now))
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            return await self._answer(request, path, body)
        except asyncio.CancelledError:
            self.cancelled += 1
            self.cancel_event.set()
            raise
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request, path: str, body: bytes) -> web.StreamResponse:
        script = self.script
        if isinstance(script, Reply):
            return self._reply(script)
        if path.startswith("/status/"):  # an empty answer with that status (204, 304, ...)
            return web.Response(status=int(path.rsplit("/", 1)[1]), headers={"x-fake-backend": self.name})
        if isinstance(script, Hang):
            await asyncio.Event().wait()
        if isinstance(script, Close | Garbage):
            assert request.transport is not None
            if isinstance(script, Garbage):
                request.transport.write(b"NOT HTTP AT ALL\r\n\r\n")
            request.transport.close()
            await asyncio.sleep(3600)
        if isinstance(script, Stream | Reset) or path.startswith("/stream"):
            return await self._stream(request, script)
        if self.gate is not None:
            await self.gate.wait()
        payload: dict[str, Any] = {
            "backend": self.name,
            "method": request.method,
            "path": path,
            "query": request.rel_url.raw_query_string,
            "raw_path": request.raw_path,
            "headers": dict(request.headers),
            "body": body.decode("utf-8", "replace"),
        }
        return web.json_response(payload, headers={"x-fake-backend": self.name})

    def _reply(self, reply: Reply) -> web.Response:
        headers = {"x-fake-backend": self.name, **reply.headers}
        if reply.body is not None or reply.status < 400:
            return web.Response(status=reply.status, body=reply.body or b"", headers=headers)
        error = {"message": f"{self.name} says {reply.status}", "type": "fake_backend", "code": reply.status}
        return web.json_response({"error": error}, status=reply.status, headers=headers)

    async def _stream(self, request: web.Request, script: Script) -> web.StreamResponse:
        q = request.query
        if isinstance(script, Stream):
            n = script.chunks
            delay = self.chunk_delay_s if script.gap_s is None else script.gap_s
        else:
            n = int(q.get("n", "5"))
            delay = float(q.get("delay", str(self.chunk_delay_s)))
        reset_after = script.after_chunks if isinstance(script, Reset) else None
        hang_after = int(q["hang_after"]) if "hang_after" in q else None
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)  # headers at once, the first event after the "prefill", as vLLM does
        if self.first_chunk_delay_s:
            await asyncio.sleep(self.first_chunk_delay_s)
        for i in range(n):
            if reset_after is not None and i == reset_after:
                assert request.transport is not None
                request.transport.abort()
                await asyncio.sleep(3600)
            if hang_after is not None and i == hang_after:
                await asyncio.Event().wait()
            event = json.dumps({"i": i, "backend": self.name})
            await resp.write(f"data: {event}\n\n".encode())
            if i == 0:
                self.first_chunk_at.append(asyncio.get_running_loop().time())
            if delay:
                await asyncio.sleep(delay)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
