"""Streams that break, stall or run long; many clients aborting at once."""

from __future__ import annotations

import asyncio
import socket

import aiohttp

from fakebackend import Reset
from routerkit import eventually, router_settings


async def test_reset_after_first_byte_ends_the_client_stream_abnormally_never_retried(
    fake_backends, router
) -> None:
    backends = await fake_backends(2, script=Reset(after_chunks=3))
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


async def test_a_client_that_stops_reading_is_dropped_and_its_backend_request_cancelled(router) -> None:
    # nginx's send_timeout: a reader that takes nothing must not hold a backend slot (and a lease)
    # for ever. The backend streams without end; the client never reads.
    closed = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /health "):  # the router's probe: answered, and not counted
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        event = b"data: " + b"x" * 16_000 + b"\n\n"
        try:
            while True:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            closed.set()
            writer.close()

    backend = await asyncio.start_server(endless, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{backend.sockets[0].getsockname()[1]}"
    try:
        r = await router(router_settings([url], server={"send_timeout_s": 0.5}))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", r.port))
        # A StreamReader that is never read stops taking bytes after 2 x limit: a stalled client.
        _reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
        writer.write(b"GET /v1/stream HTTP/1.1\r\nhost: r\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(closed.wait(), 15)  # the router closed its upstream connection
        await eventually(lambda: sum(r.inflight().values()) == 0)
        assert r.app.upstream.pool_in_use() == 0
        writer.close()
    finally:
        backend.close()
