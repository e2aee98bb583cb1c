"""Streaming pass-through, client disconnects, leases back to zero."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from fakebackend import Hang
from routerkit import eventually, router_settings


async def test_sse_relayed_chunk_by_chunk_as_produced(fake_backends, router) -> None:
    backends = await fake_backends(1, chunk_delay_s=0.2)
    r = await router(router_settings(backends))
    arrivals: list[float] = []
    raw = b""
    async with aiohttp.ClientSession() as s, s.get(f"{r.url}/stream?n=5") as resp:
        assert resp.headers["content-type"] == "text/event-stream"
        start = time.monotonic()
        async for chunk in resp.content.iter_any():
            raw += chunk
            arrivals.append(time.monotonic() - start)
    direct = b""
    async with aiohttp.ClientSession() as s, s.get(f"{backends[0].url}/stream?n=5&delay=0") as resp:
        direct = await resp.read()
    assert raw == direct, "SSE bytes must be relayed unchanged"
    # The first event must arrive long before the stream ends: nothing is buffered.
    assert len(arrivals) >= 3
    assert arrivals[0] < arrivals[-1] - 0.4


async def test_client_disconnect_mid_stream_closes_upstream_and_releases_lease(fake_backends, router) -> None:
    backends = await fake_backends(1, chunk_delay_s=0.05)
    r = await router(router_settings(backends))
    async with aiohttp.ClientSession() as s:
        resp = await s.get(f"{r.url}/stream?n=100000")
        await resp.content.readuntil(b"\n\n")
        assert r.inflight()[backends[0].url] == 1
        resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(backends[0].cancel_event.wait(), 2.0)
    await eventually(lambda: r.inflight()[backends[0].url] == 0)
    assert r.app.upstream.pool_in_use() == 0


async def test_client_disconnect_before_headers_cancels_upstream(fake_backends, router) -> None:
    backends = await fake_backends(1, script=Hang())
    r = await router(router_settings(backends))
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(f"{r.url}/v1/completions", json={"prompt": "x"}))
        await eventually(lambda: backends[0].active == 1)
        task.cancel()
    await asyncio.wait_for(backends[0].cancel_event.wait(), 2.0)
    await eventually(lambda: r.inflight()[backends[0].url] == 0)
    text = await _metrics(r.url)
    assert "prefix_router_client_disconnects_total 1.0" in text


async def test_many_aborted_streams_leak_nothing(fake_backends, router) -> None:
    backends = await fake_backends(2, chunk_delay_s=0.01)
    r = await router(router_settings(backends))

    async def abort_one(i: int, s: aiohttp.ClientSession) -> None:
        resp = await s.get(f"{r.url}/stream?n=1000&i={i}", headers={"x-prefix-cache-key": str(i)})
        await resp.content.readuntil(b"\n\n")
        resp.close()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=50)) as s:
        await asyncio.gather(*(abort_one(i, s) for i in range(200)))
    await eventually(lambda: sum(r.inflight().values()) == 0, 10)
    await eventually(lambda: r.app.upstream.pool_in_use() == 0, 10)
    await eventually(lambda: sum(b.active for b in backends) == 0, 10)
    assert r.app.proxy.active_requests == 0


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        return await resp.text()


async def test_second_stream_for_a_prefix_in_prefill_waits_for_its_first_byte(fake_backends, router) -> None:
    """Two streams for one new prefix sent together: the second reaches the backend only after the
    first one's first byte, so an engine would find the prefix cached."""
    backends = await fake_backends(4)
    for b in backends:
        b.first_chunk_delay_s = 0.5  # a prefill
    r = await router(router_settings(backends))
    system = "a long shared system prompt " * 60

    def body(q: str) -> dict[str, object]:
        return {
            "model": "m",
            "stream": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
        }

    async with aiohttp.ClientSession() as s:

        async def one(q: str) -> tuple[str, bytes]:
            async with s.post(f"{r.url}/stream?n=2", json=body(q)) as resp:
                return resp.headers["x-prefix-router-backend"], await resp.read()

        first = asyncio.create_task(one("first question"))
        await eventually(lambda: sum(len(b.seen) for b in backends) == 1)
        second = asyncio.create_task(one("second question"))
        await asyncio.sleep(0.2)
        assert sum(len(b.seen) for b in backends) == 1, "held while the first prefills"
        (home1, _), (home2, _) = await asyncio.gather(first, second)
    assert home1 == home2
    home = next(b for b in backends if b.url == home1)
    assert home.seen[1].at - home.first_chunk_at[0] >= 0, "sent after the first one's first byte"
    async with aiohttp.ClientSession() as s, s.get(f"{r.url}/metrics") as m:
        text = await m.text()
    assert 'prefix_router_prefill_waits_total{outcome="ready"} 1.0' in text
    assert 'prefix_router_wait_seconds_count{reason="prefill"} 1.0' in text  # the hold, timed
