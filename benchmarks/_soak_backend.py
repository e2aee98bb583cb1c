"""Fake vLLM backends for the soak benchmark: several aiohttp listeners in one process.

Run as `python benchmarks/_soak_backend.py PORT [PORT ...]`; it prints `ready` once every port listens.
Each listener answers:

- `GET /health` 200 (the router's active probe);
- `GET /_soak/stats` its counters as JSON (handlers active now, handled, cancelled by a client leaving);
- any other request with a body: 400 when the body is not JSON (as vLLM would), 503 when the request
  carries `x-soak-mode: 503`; with `"stream": true` an SSE stream of `x-soak-chunks` events (each naming
  the request's `user` field), `x-soak-delay-ms` apart, cut by a TCP reset after `x-soak-reset-after`
  events when that header is given; otherwise the body echoed back byte for byte.

Loopback only; the process exits on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import orjson
from aiohttp import web


class Counters:
    __slots__ = ("active", "cancelled", "handled", "resets")

    def __init__(self) -> None:
        self.active = 0
        self.handled = 0
        self.cancelled = 0
        self.resets = 0


def build_app(counters: Counters) -> web.Application:
    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(_request: web.Request) -> web.Response:
        return web.json_response(
            {
                "active": counters.active,
                "handled": counters.handled,
                "cancelled": counters.cancelled,
                "resets": counters.resets,
            }
        )

    async def generate(request: web.Request) -> web.StreamResponse:
        counters.active += 1
        counters.handled += 1
        try:
            return await answer(request)
        except asyncio.CancelledError:
            counters.cancelled += 1
            raise
        finally:
            counters.active -= 1

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.headers.get("x-soak-mode") == "503":
            err = b'{"error":{"message":"overloaded","type":"server_error","code":503}}'
            return web.Response(status=503, body=err, content_type="application/json")
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            err = b'{"error":{"message":"invalid JSON","type":"invalid_request_error","code":400}}'
            return web.Response(status=400, body=err, content_type="application/json")
        if not (isinstance(doc, dict) and doc.get("stream") is True):
            return web.Response(body=body, content_type="application/json")
        marker = str(doc.get("user", ""))
        chunks = int(request.headers.get("x-soak-chunks", "8"))
        delay_s = float(request.headers.get("x-soak-delay-ms", "0")) / 1000
        reset_after = int(request.headers.get("x-soak-reset-after", "-1"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)
        for i in range(chunks):
            if i == reset_after:
                counters.resets += 1
                assert request.transport is not None
                request.transport.abort()
                return resp
            await resp.write(b'data: {"id":"' + marker.encode() + b'","i":' + str(i).encode() + b"}\n\n")
            if delay_s:
                await asyncio.sleep(delay_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_get("/_soak/stats", stats)
    app.router.add_route("*", "/{tail:.*}", generate)
    return app


async def main(ports: list[int]) -> None:
    runners = []
    for port in ports:
        runner = web.AppRunner(build_app(Counters()), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        runners.append(runner)
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


if __name__ == "__main__":
    ports = [int(p) for p in sys.argv[1:]]
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(ports))
    else:
        uvloop.run(main(ports))
