"""What the main listener holds in memory: concurrent large uploads, and idle kept-alive connections.

- **uploads**: `--uploads` clients (12) each POST a `--upload-mib` (30 MiB) body at once, as fast as
  loopback takes it, while a small-request client keeps sending `GET /healthz` and a small proxied POST.
  The router's RSS is sampled every 10 ms; reported: RSS before, peak growth (sampled and VmHWM),
  RSS after, each upload's status (200, or 503 + Retry-After when the body budget had no room within its
  wait; `--retry` sends a refused upload again after Retry-After) and every small request's outcome.
- **idle**: `--idle` connections (2,000) each send one request, read its answer and stay open; reported:
  RSS growth per idle connection.

The router runs as its own process (`python -m prefix_router serve`), with the default server settings
unless `--buffered-mib` is given; the backend is a raw asyncio server in another process that reads each
body whole and answers a small JSON, so only the router's memory is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import markdown_table, package_version, print_header, report_results

from loopback import free_port
from processes import RouterProcess, launch_router, start_server, stop_process
from rawhttp import read_response

MiB = 1024 * 1024


# -- the backend: reads each request whole, answers {"bytes": n} -----------------------------------


class SinkBackend(asyncio.Protocol):
    """Also answers `GET /flood` with a response head whose one field never ends (for listener_flood.py),
    written as fast as the router reads it, until the router closes the connection."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.need = -1
        self.got = 0
        self.transport: asyncio.Transport | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.flooding: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.writable.set()

    async def flood_head(self) -> None:
        transport = self.transport
        assert transport is not None
        transport.write(b"HTTP/1.1 200 OK\r\nx-flood: ")
        while not transport.is_closing():
            transport.write(b"a" * 4096)
            await self.writable.wait()
            await asyncio.sleep(0)

    def data_received(self, data: bytes) -> None:
        if self.need < 0:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            if head.startswith(b"get /flood "):
                self.buf = bytearray()
                self.flooding = asyncio.ensure_future(self.flood_head())
                return
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip() == b"content-length":
                    length = int(value)
            rest = len(self.buf) - end - 4
            self.buf = bytearray()
            self.need, self.got = length, rest
        else:
            self.got += len(data)
        if self.got >= self.need:
            body = json.dumps({"bytes": self.need}).encode()
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
            self.transport.write(b"content-length: %d\r\n\r\n%s" % (len(body), body))
            self.need = -1


async def serve_backend(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(SinkBackend, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


# -- the router process ----------------------------------------------------------------------------


def rss_kib(pid: int, field: str = "VmRSS:") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def start_router(work: Path, backend_port: int, buffered_mib: int | None) -> RouterProcess:
    server: dict[str, Any] = {"drain_timeout_s": 1.0}
    if buffered_mib is not None:
        server["max_buffered_body_bytes"] = buffered_mib * MiB
    config = work / "router.yaml"
    config.write_text(json.dumps({"server": server, "health": {"interval_s": 1.0}}))  # JSON is YAML
    flags = [
        "--config",
        str(config),
        "--log-level",
        "warning",
        "--backend",
        f"http://127.0.0.1:{backend_port}",
    ]
    router = launch_router(flags, work / "router.log", metrics_port=free_port())
    router.wait_ready()
    return router


@contextlib.contextmanager
def router_on_sink(buffered_mib: int | None) -> Iterator[RouterProcess]:
    """The sink backend and a router in front of it, both children, stopped on the way out."""
    with tempfile.TemporaryDirectory(prefix="prefix-router-bench-") as tmp:
        work = Path(tmp)
        backend_port = free_port()
        argv = [sys.executable, __file__, "--backend", str(backend_port)]
        backend = start_server(argv, [backend_port], work / "backend.log")
        try:
            router = start_router(work, backend_port, buffered_mib)
            try:
                yield router
            finally:
                router.stop()
        finally:
            stop_process(backend)


# -- clients ---------------------------------------------------------------------------------------


async def upload(port: int, size: int, retry: bool) -> list[int]:
    statuses = []
    body = b"x" * size
    while True:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(body)
        try:
            resp = await read_response(reader, timeout_s=120)
            status, retry_after = resp.status, resp.header("retry-after")
        except (ConnectionError, asyncio.IncompleteReadError):
            status, retry_after = 0, None
        writer.close()
        statuses.append(status)
        if status != 503 or not retry:
            return statuses
        await asyncio.sleep(float(retry_after or "1"))


async def small_requests(port: int, stop: asyncio.Event, outcomes: list[int], latencies: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"model": "m", "prompt": "hi"}'
    requests = [
        b"GET /healthz HTTP/1.1\r\nhost: bench\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body),
    ]
    i = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        writer.write(requests[i % 2])
        try:
            status = (await read_response(reader, timeout_s=30)).status
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            status = 0
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        latencies.append(time.perf_counter() - t0)
        outcomes.append(status)
        i += 1
        await asyncio.sleep(0.01)
    writer.close()


async def uploads_case(pid: int, port: int, n: int, size: int, retry: bool) -> dict[str, Any]:
    await asyncio.sleep(0.5)
    before = rss_kib(pid)
    peak = before
    stop = asyncio.Event()
    small: list[int] = []
    small_s: list[float] = []

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_kib(pid))
            await asyncio.sleep(0.01)

    sampler = asyncio.ensure_future(sample())
    smalls = asyncio.ensure_future(small_requests(port, stop, small, small_s))
    t0 = time.perf_counter()
    results = await asyncio.gather(*(upload(port, size, retry) for _ in range(n)))
    elapsed = time.perf_counter() - t0
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.gather(sampler, smalls)
    after = rss_kib(pid)
    small_s.sort()
    return {
        "uploads": n,
        "upload_mib": size // MiB,
        "rss_before_mib": round(before / 1024, 1),
        "rss_peak_growth_mib": round((peak - before) / 1024, 1),
        "hwm_growth_mib": round((rss_kib(pid, "VmHWM:") - before) / 1024, 1),
        "rss_after_growth_mib": round((after - before) / 1024, 1),
        "upload_statuses": [s for r in results for s in r],
        "uploads_answered_200": sum(1 for r in results if r[-1] == 200),
        "small_requests": len(small),
        "small_requests_ok": sum(1 for s in small if s == 200),
        "small_p99_ms": round(small_s[int(0.99 * (len(small_s) - 1))] * 1000, 1) if small_s else None,
        "elapsed_s": round(elapsed, 2),
    }


async def idle_case(pid: int, port: int, n: int) -> dict[str, Any]:
    await asyncio.sleep(0.5)
    before = rss_kib(pid)
    conns = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: bench\r\n\r\n")
        assert (await read_response(reader)).status == 200
        conns.append(writer)
    await asyncio.sleep(1.0)
    held = rss_kib(pid)
    for writer in conns:
        writer.close()
    return {
        "idle_connections": n,
        "rss_before_mib": round(before / 1024, 1),
        "rss_growth_mib": round((held - before) / 1024, 1),
        "kib_per_idle_connection": round((held - before) / n, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--uploads", type=int, default=12)
    p.add_argument("--upload-mib", type=int, default=30)
    p.add_argument("--idle", type=int, default=2000)
    p.add_argument("--buffered-mib", type=int, default=None, help="server.max_buffered_body_bytes in MiB")
    p.add_argument("--retry", action="store_true", help="send an upload refused 503 again after Retry-After")
    p.add_argument("--quick", action="store_true", help="4 uploads, 200 idle connections")
    p.add_argument("--backend", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.backend is not None:
        asyncio.run(serve_backend(args.backend))
        return 0
    if args.quick:
        args.uploads, args.idle = 4, 200
    meta = print_header("Listener memory", {"prefix-router": package_version("prefix-router")})
    with router_on_sink(args.buffered_mib) as router:
        up = asyncio.run(
            uploads_case(router.pid, router.port, args.uploads, args.upload_mib * MiB, args.retry)
        )
        idle = asyncio.run(idle_case(router.pid, router.port, args.idle))
    print(f"## {up['uploads']} concurrent uploads of {up['upload_mib']} MiB")
    print()
    keys = [k for k in up if k != "upload_statuses"]
    print(markdown_table(["figure", "value"], [(k, up[k]) for k in keys]))
    print(f"\nupload statuses: {up['upload_statuses']}\n")
    print("## idle kept-alive connections")
    print()
    print(markdown_table(["figure", "value"], list(idle.items())))
    report_results("listener_memory", {**meta, "uploads": up, "idle": idle})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
