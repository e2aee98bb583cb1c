"""Streams that break, stall or run long; many clients aborting at once."""

from __future__ import annotations

import asyncio

import aiohttp

from routerkit import eventually, router_settings


async def test_reset_after_first_byte_ends_the_client_stream_abnormally_never_retried(
    fake_backends, router
) -> None:
    backends = await fake_backends(2, mode="reset_after:3")
    r = await router(router_settings(backends))
    async with aiohttp.ClientSession() as s, s.get(f"{r.url}/stream?n=10") as resp:
        assert resp.status == 200
        got = b""
        broken = False
        try:
            async for chunk in resp.content.iter_any():
                got += chunk
        except aiohttp.ClientPayloadError:
            broken = True
    assert broken, "the client must see a truncated stream, not a clean end"
    assert got.count(b"data: ") == 3
    assert b"[DONE]" not in got, "no [DONE] is invented"
    assert sum(len(b.seen) for b in backends) == 1, "never retried after the first byte"
    async with aiohttp.ClientSession() as s, s.get(f"{r.url}/metrics") as m:
        text = await m.text()
    assert 'kind="stream_broken"' in text
    await eventually(lambda: sum(r.inflight().values()) == 0)


async def test_stream_idle_timeout_closes_both_sides(fake_backends, router) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, upstream={"stream_idle_timeout_s": 0.3}))
    async with aiohttp.ClientSession() as s, s.get(f"{r.url}/stream?n=10&hang_after=2") as resp:
        got = b""
        broken = False
        try:
            async with asyncio.timeout(5):
                async for chunk in resp.content.iter_any():
                    got += chunk
        except aiohttp.ClientPayloadError:
            broken = True
    assert broken and got.count(b"data: ") == 2
    await asyncio.wait_for(backends[0].cancel_event.wait(), 2)  # the backend side is closed too
    async with aiohttp.ClientSession() as s, s.get(f"{r.url}/metrics") as m:
        assert 'kind="stream_idle_timeout"' in await m.text()


async def test_long_steady_stream_is_never_cut_by_a_total_deadline(fake_backends, router) -> None:
    """Chunks every 0.05 s for 3 s: six times the idle timeout and far past any first-byte bound."""
    backends = await fake_backends(1)
    r = await router(
        router_settings(backends, upstream={"stream_idle_timeout_s": 0.5, "first_byte_timeout_s": 0.5})
    )
    async with aiohttp.ClientSession() as s, s.get(f"{r.url}/stream?n=60&delay=0.05") as resp:
        body = await resp.read()
    assert body.count(b"data: ") == 61
    assert body.endswith(b"data: [DONE]\n\n")


async def test_a_thousand_clients_aborting_mid_stream_leak_nothing(fake_backends, router) -> None:
    backends = await fake_backends(4, chunk_delay_s=0.02)
    r = await router(router_settings(backends))

    async def abort_one(i: int, s: aiohttp.ClientSession) -> None:
        resp = await s.get(f"{r.url}/stream?n=500", headers={"x-prefix-cache-key": str(i)})
        await resp.content.readuntil(b"\n\n")
        resp.close()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as s:
        for start in range(0, 1000, 250):
            await asyncio.gather(*(abort_one(i, s) for i in range(start, start + 250)))
    await eventually(lambda: sum(r.inflight().values()) == 0, 20)
    await eventually(lambda: r.app.upstream.pool_in_use() == 0, 20)
    await eventually(lambda: sum(b.active for b in backends) == 0, 20)
    assert r.app.proxy.active_requests == 0
    tasks = [t for t in asyncio.all_tasks() if "prefix_router" in repr(t.get_coro()) and "proxy" in repr(t)]
    assert not [t for t in tasks if "_watch_disconnect" in repr(t.get_coro())], "no watcher task left behind"
    assert sum(b.cancelled for b in backends) == 1000, "every abort reached its backend"
