"""Other clients' /healthz latency while header fields that never end flood the router.

`--flooders` clients (4) each open a connection, send a request line and `X-Flood: ` and then 1 KiB of
`a` after 1 KiB, never a line end, until the router answers; then again on a new connection. With
`--from backend` they send `GET /flood` instead, which the backend answers with a response head whose
field never ends. Meanwhile one client sends `GET /healthz` every 10 ms on a kept-alive connection
(`--probes` of them). Reported: /healthz p50/p99/max, and how the flood requests were answered (431
expected from clients, 502 from the backend). The router runs as its own process with default settings,
in front of the sink backend of listener_memory.py.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter

import listener_memory as lm
from _common import markdown_table, package_version, print_header, report_results

from rawhttp import read_response


async def flooder(port: int, answers: Counter[str]) -> None:
    while True:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Flood: ")
        answer = asyncio.ensure_future(reader.read(12))
        try:
            while not answer.done():
                writer.write(b"a" * 1024)
                await writer.drain()
                await asyncio.sleep(0)
            got = await answer
            answers[got[9:12].decode() or "closed"] += 1
        except ConnectionError:
            answers["reset"] += 1
        writer.close()


async def backend_flooder(port: int, answers: Counter[str]) -> None:
    """`GET /flood` over and over: the backend floods each answer's head; the router answers 502."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while True:
        writer.write(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            resp = await read_response(reader, timeout_s=60)
        except (ConnectionError, asyncio.IncompleteReadError):
            answers["reset"] += 1
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            continue
        answers[str(resp.status)] += 1


async def run(port: int, flooders: int, probes: int, source: str) -> dict[str, object]:
    answers: Counter[str] = Counter()
    flood = flooder if source == "client" else backend_flooder
    tasks = [asyncio.ensure_future(flood(port, answers)) for _ in range(flooders)]
    await asyncio.sleep(0.5)
    latencies = []
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(probes):
        t0 = time.perf_counter()
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: bench\r\n\r\n")
        assert (await read_response(reader)).status == 200
        latencies.append(time.perf_counter() - t0)
        await asyncio.sleep(0.01)
    writer.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    latencies.sort()
    return {
        "flood_from": source,
        "flooders": flooders,
        "healthz_probes": probes,
        "healthz_p50_ms": round(latencies[len(latencies) // 2] * 1000, 2),
        "healthz_p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 2),
        "healthz_max_ms": round(latencies[-1] * 1000, 2),
        "flood_answers": dict(answers),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flooders", type=int, default=4)
    p.add_argument("--probes", type=int, default=300)
    p.add_argument("--from", dest="source", choices=["client", "backend"], default="client")
    args = p.parse_args()
    meta = print_header("Listener under a header flood", {"prefix-router": package_version("prefix-router")})
    with lm.router_on_sink(None) as router:
        result = asyncio.run(run(router.port, args.flooders, args.probes, args.source))
    print(markdown_table(["figure", "value"], list(result.items())))
    report_results("listener_flood", {**meta, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
