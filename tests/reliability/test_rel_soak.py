"""A short soak: thousands of mixed requests (streams, aborts, 503s, bad input) leave nothing behind.

The long version, with RSS measured on a router subprocess, is benchmarks/soak.py. Here the router runs
in process under uvicorn, so its counters can be read directly afterwards: no lease, pooled connection,
active request or disconnect watcher outlives its request, every answer belongs to its own request, and
/healthz kept answering throughout (within a generous bound: CI machines are noisy).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

import aiohttp
from aiohttp import web

from fakebackend import FakeBackend
from routerkit import eventually, router_settings, start_router

REQUESTS = 3000
CONCURRENCY = 32
MAX_BODY = 64 * 1024
MIX = {
    "chat": 0.55,
    "stream": 0.20,
    "abort": 0.10,
    "badjson": 0.04,
    "e503": 0.04,
    "reset": 0.03,
    "overlimit": 0.02,
    "trace": 0.02,
}
PROBE_INTERVAL_S = 0.05
PROBE_BOUND_S = 2.0  # generous: a blocked loop shows as seconds; a noisy CI machine as ~100s of ms


class ScriptedBackend(FakeBackend):
    """A fake backend scripted per request: `x-soak-mode: 503`, and /soak/stream?id=&n=&delay=&reset_after=
    whose every event names the request's id."""

    async def _answer(self, request: web.Request, path: str, body: bytes) -> web.StreamResponse:
        if request.headers.get("x-soak-mode") == "503":
            return web.json_response({"error": {"message": f"{self.name} is overloaded"}}, status=503)
        if path != "/soak/stream":
            return await super()._answer(request, path, body)
        q = request.query
        marker, n, delay = q["id"], int(q.get("n", "8")), float(q.get("delay", "0"))
        reset_after = int(q.get("reset_after", "-1"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            if i == reset_after:
                assert request.transport is not None
                request.transport.abort()
                return resp
            await resp.write(f"data: {json.dumps({'id': marker, 'i': i})}\n\n".encode())
            if delay:
                await asyncio.sleep(delay)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def one_request(s: aiohttp.ClientSession, base: str, i: int, kind: str) -> str:
    marker = f"soak-{i:06d}"
    tenant = {"x-prefix-cache-key": f"tenant-{i % 37}"}
    doc = {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"family {i % 53} " + "policy text " * 20},
            {"role": "user", "content": f"{marker} question"},
        ],
    }
    try:
        if kind in ("chat", "badjson", "e503", "overlimit"):
            body = json.dumps(doc).encode()
            headers = {"content-type": "application/json", **tenant}
            if kind == "badjson":
                body = b'{"messages": [{"content": "' + marker.encode() + b'"'  # cut short: not JSON
            elif kind == "e503":
                headers["x-soak-mode"] = "503"
            elif kind == "overlimit":
                body += b" " * MAX_BODY
            async with s.post(f"{base}/v1/chat/completions", data=body, headers=headers) as resp:
                got = await resp.read()
                if kind == "e503":
                    return "ok" if resp.status == 503 else f"status_{resp.status}"
                if kind == "overlimit":
                    return "ok" if resp.status == 413 else f"status_{resp.status}"
                if resp.status != 200:
                    return f"status_{resp.status}"
                echoed = json.loads(got)["body"]
                return "ok" if marker in echoed and echoed == body.decode() else "mixed_up"
        if kind == "trace":
            async with s.request("TRACE", f"{base}/v1/models", headers=tenant) as resp:
                await resp.read()
                return "ok" if resp.status == 405 else f"status_{resp.status}"
        query = {"stream": f"id={marker}&n=8", "abort": f"id={marker}&n=2000&delay=0.005"}.get(
            kind, f"id={marker}&n=8&reset_after=2"
        )
        async with s.get(f"{base}/soak/stream?{query}", headers=tenant) as resp:
            if resp.status != 200:
                return f"status_{resp.status}"
            if kind == "abort":
                first = await resp.content.readuntil(b"\n\n")
                resp.close()  # hang up mid-stream
                return "ok" if marker.encode() in first else "mixed_up"
            try:
                got = await resp.read()
            except aiohttp.ClientPayloadError:
                return "ok" if kind == "reset" else "truncated"
            if kind == "reset":
                return "not_truncated"
            events = [e for e in got.split(b"\n\n") if e.startswith(b"data: {")]
            complete = len(events) == 8 and got.endswith(b"data: [DONE]\n\n")
            own = all(json.loads(e[6:])["id"] == marker for e in events)
            return "ok" if complete and own else "mixed_up"
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
        # A 413 sent before the body was read closes the connection; the client may see only the close.
        return "ok" if kind == "overlimit" else f"exc_{type(exc).__name__}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"exc_{type(exc).__name__}"


async def test_mixed_soak_leaks_nothing_and_healthz_keeps_answering() -> None:
    backends = [ScriptedBackend(name=f"s{i}") for i in range(3)]
    for b in backends:
        await b.start()
    r = await start_router(router_settings(backends, server={"max_body_bytes": MAX_BODY}))
    rng = random.Random(7)
    kinds = rng.choices(list(MIX), list(MIX.values()), k=REQUESTS)
    outcomes: dict[str, Counter[str]] = {k: Counter() for k in MIX}
    probe_latencies: list[float] = []
    probe_failures: list[str] = []
    done = asyncio.Event()
    try:

        async def probe() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                for _ in range(2000):  # bounded: 100 s at most
                    if done.is_set():
                        return
                    t0 = time.perf_counter()
                    try:
                        async with s.get(f"{r.url}/healthz") as resp:
                            await resp.read()
                            if resp.status != 200:
                                probe_failures.append(f"status_{resp.status}")
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        probe_failures.append(type(exc).__name__)
                    probe_latencies.append(time.perf_counter() - t0)
                    await asyncio.sleep(PROBE_INTERVAL_S)

        next_i = 0

        async def worker(s: aiohttp.ClientSession) -> None:
            nonlocal next_i
            while next_i < REQUESTS:
                i = next_i
                next_i += 1
                outcomes[kinds[i]][await one_request(s, r.url, i, kinds[i])] += 1

        prober = asyncio.get_running_loop().create_task(probe())
        connector = aiohttp.TCPConnector(limit=CONCURRENCY)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as s:
            await asyncio.wait_for(asyncio.gather(*(worker(s) for _ in range(CONCURRENCY))), 120)
        done.set()
        await asyncio.wait_for(prober, 15)

        unexpected = {k: {o: n for o, n in c.items() if o != "ok"} for k, c in outcomes.items()}
        assert not any(unexpected.values()), f"answers other than expected: {unexpected}"
        assert sum(sum(c.values()) for c in outcomes.values()) == REQUESTS

        await eventually(lambda: sum(r.inflight().values()) == 0, 20)
        await eventually(lambda: r.app.upstream.pool_in_use() == 0, 20)
        await eventually(lambda: sum(b.active for b in backends) == 0, 20)
        await eventually(lambda: r.app.proxy.active_requests == 0, 20)

        def watchers() -> list[asyncio.Task[object]]:
            return [t for t in asyncio.all_tasks() if "_watch_disconnect" in repr(t.get_coro())]

        await eventually(lambda: not watchers(), 10)
        aborts = outcomes["abort"]["ok"]
        await eventually(lambda: sum(b.cancelled for b in backends) == aborts, 20)

        assert not probe_failures, f"/healthz failed during the soak: {Counter(probe_failures)}"
        assert len(probe_latencies) >= 5, "the prober ran during the soak"
        worst = max(probe_latencies)
        assert worst < PROBE_BOUND_S, f"/healthz took {worst * 1000:.0f} ms during the soak"
    finally:
        done.set()
        await r.stop()
        for b in backends:
            await b.stop()
