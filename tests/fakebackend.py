"""A scriptable fake backend on a loopback port, for the router's real-server tests.

It answers every path. By default it echoes what it received as JSON (its name, method, path, query,
headers, body), so tests can see exactly what the router forwarded. `mode` makes it misbehave the
ways real backends do: 503/429, hang before headers, hang mid-stream, reset after N chunks, close
without answering, answer garbage, drip bytes. Paths under /stream and /hang script one request;
/status/<code> answers that status with no body.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


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
    mode: str = "echo"  # echo | status:<code> | hang | close | garbage | reset_after:<n> | drip
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
    gate: asyncio.Event | None = None  # when set, echo requests wait for it (to hold requests in flight)
    port: int = 0
    _runner: web.AppRunner | None = None
    cancel_event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, sock: socket.socket | None = None) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
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
        mode = self.mode
        if mode.startswith("status:"):
            code = int(mode.split(":", 1)[1])
            return web.json_response({"error": {"message": f"{self.name} says {code}"}}, status=code)
        if path.startswith("/status/"):  # an empty answer with that status (204, 304, ...)
            return web.Response(status=int(path.rsplit("/", 1)[1]), headers={"x-fake-backend": self.name})
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "close":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(3600)
        if mode == "garbage":
            assert request.transport is not None
            request.transport.write(b"NOT HTTP AT ALL\r\n\r\n")
            request.transport.close()
            await asyncio.sleep(3600)
        if path.startswith("/stream") or mode.startswith("reset_after:"):
            return await self._stream(request)
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

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        n = int(request.query.get("n", "5"))
        delay = float(request.query.get("delay", str(self.chunk_delay_s)))
        reset_after = int(self.mode.split(":", 1)[1]) if self.mode.startswith("reset_after:") else None
        hang_after = int(request.query["hang_after"]) if "hang_after" in request.query else None
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
