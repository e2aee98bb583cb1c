"""What shared placement state adds to a request's latency: one router with `routing.shared_state_url`
on a loopback redis-server against one without, on the same fast fake backends, in one run.

Two `prefix-router serve` processes (one of each mode) in front of the same 4 fake backends
(benchmarks/_soak_backend.py: the body echoed back at once), and a `redis-server` on a loopback port.
One client sends N sequential chat requests to each router, interleaved request by request (A, B,
A, B, ...), so both modes see the same machine load over the run. The bodies are 60 families of a
1,000-character system prompt with a question each: new prefixes and known ones, as real traffic.
Reported: end-to-end latency percentiles per mode and their difference (what the claim round trip
costs), and how the shared router decided.

    python benchmarks/shared_state_latency.py              # 2,000 requests per mode, ~1 minute
    python benchmarks/shared_state_latency.py --requests 500
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import yaml
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import markdown_table, package_version, print_header, report_results
from prefix_router import __version__
from prefix_router.fleet.shared_state import SharedPlacement
from prefix_router.routing.shared_view import ClaimRequest

from loopback import eventually, free_port
from processes import RouterProcess, launch_router, start_server, stop_processes
from redisserver import RedisServer

HERE = Path(__file__).resolve().parent
CHAT = "/v1/chat/completions"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bodies(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        family = i % 60
        system = (f"You are assistant {family} for product line {family * 37}. " * 30)[:1000]
        question = f"question {i}: what does item {i * 7919 % 10_000} do?"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        out.append(orjson.dumps({"model": "m", "messages": messages, "max_tokens": 8}))
    return out


def router_config(backends: list[str], shared_url: str) -> dict[str, Any]:
    routing: dict[str, Any] = {"shared_state_url": shared_url}
    return {
        "server": {"log_level": "warning"},
        "backends": [{"url": u} for u in backends],
        "routing": routing,
        "health": {"interval_s": 3600},
        "balancing": {"max_inflight": 1000},
    }


def decisions(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("prefix_router_decisions_total{"):
            branch = line.split('branch="', 1)[1].split('"', 1)[0]
            out[branch] = float(line.rsplit(" ", 1)[1])
        if line.startswith("prefix_router_shared_state_errors_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[f"errors:{reason}"] = float(line.rsplit(" ", 1)[1])
    return out


async def round_trips(url: str, n: int) -> dict[str, float]:
    """p50 of the claim alone, called as the proxy calls it (8 blocks, 4 backends listed), against a
    PING from redis-py: what the script costs over the bare round trip."""
    shared = SharedPlacement(url, 1.0, CollectorRegistry())
    task = asyncio.get_running_loop().create_task(shared.run())
    await eventually(lambda: shared.up, 5, "the shared store connected")
    listed = tuple(f"http://10.9.0.{i}:8000" for i in range(4))
    redis = Redis.from_url(url)  # the same library, its own pool
    out: dict[str, float] = {}
    for name in ("ping", "claim"):
        times: list[float] = []
        for i in range(n):
            started = time.perf_counter()
            if name == "ping":
                await redis.ping()
            else:
                blocks = tuple(range(i * 4, i * 4 + 8))  # half the blocks known, as a new turn
                await shared.claim(ClaimRequest(blocks, (256,) * 8, "00011111", listed[i % 4], 1e12, listed))
            times.append(time.perf_counter() - started)
        out[name] = percentile(times, 0.5) * 1e6
    task.cancel()
    await shared.close()
    await redis.aclose()
    return out


def start_routers(work: Path, redis_url: str, backends: list[str]) -> dict[str, RouterProcess]:
    """One router without shared state ("local") and one with it ("shared"), side by side."""
    routers = {}
    for mode in ("local", "shared"):
        path = work / f"{mode}.yaml"
        path.write_text(yaml.safe_dump(router_config(backends, redis_url if mode == "shared" else "")))
        routers[mode] = launch_router(["--config", str(path)], work / f"{mode}.log")
    for router in routers.values():
        router.wait_ready()
    return routers


def interleaved_latencies(ports: dict[str, int], warmup: int, requests: int) -> dict[str, list[float]]:
    """Seconds per request of each router, the two taking turns at going first."""
    conns = {m: http.client.HTTPConnection("127.0.0.1", p, timeout=10) for m, p in ports.items()}
    latencies: dict[str, list[float]] = {m: [] for m in ports}
    headers = {"content-type": "application/json"}
    for i, body in enumerate(bodies(warmup + requests)):
        for mode in ("local", "shared") if i % 2 == 0 else ("shared", "local"):
            started = time.perf_counter()
            conns[mode].request("POST", CHAT, body=body, headers=headers)
            resp = conns[mode].getresponse()
            resp.read()
            elapsed = time.perf_counter() - started
            if resp.status != 200:
                sys.exit(f"{mode}: status {resp.status}")
            if i >= warmup:
                latencies[mode].append(elapsed)
    return latencies


def latency_table(latencies: dict[str, list[float]]) -> tuple[str, dict[str, Any], dict[float, float]]:
    rows = []
    summary: dict[str, Any] = {}
    quantiles = (0.5, 0.9, 0.99)
    for mode in ("local", "shared"):
        summary[mode] = {q: percentile(latencies[mode], q) * 1e6 for q in quantiles}
        rows.append([mode, len(latencies[mode]), *(f"{summary[mode][q]:.0f}" for q in quantiles)])
    added = {q: summary["shared"][q] - summary["local"][q] for q in quantiles}
    rows.append(["added by shared state", "", *(f"{added[q]:+.0f}" for q in quantiles)])
    return markdown_table(["mode", "requests", "p50 µs", "p90 µs", "p99 µs"], rows), summary, added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000, help="sequential requests per mode")
    parser.add_argument("--warmup", type=int, default=200, help="requests per mode not counted")
    args = parser.parse_args()
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        sys.exit("redis-server is not installed (Debian: apt-get install redis-server)")
    redis_version = subprocess.run([redis_bin, "--version"], capture_output=True, text=True).stdout.split()[2]
    meta = print_header(
        "Added latency of shared placement state (Redis on loopback)",
        {"prefix-router": __version__, "redis-py": package_version("redis"), "redis-server": redis_version},
    )
    redis = RedisServer(redis_bin)
    children: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            redis.start()
            backend_ports = [free_port() for _ in range(4)]
            argv = [sys.executable, str(HERE / "_soak_backend.py"), *map(str, backend_ports)]
            children.append(start_server(argv, backend_ports, Path(tmp) / "backends.log"))
            routers = start_routers(Path(tmp), redis.url, [f"http://127.0.0.1:{p}" for p in backend_ports])
            children += [r.proc for r in routers.values()]
            time.sleep(1.5)  # the shared router's first ping
            ports = {m: r.port for m, r in routers.items()}
            latencies = interleaved_latencies(ports, args.warmup, args.requests)
            counts = {m: decisions(p) for m, p in ports.items()}
            stop_processes(children)  # the round trips alone: only redis-server and this process run
            alone = asyncio.run(round_trips(f"redis://127.0.0.1:{redis.port}/1", args.requests))
        finally:
            stop_processes(children)
            redis.close()
    table, summary, added = latency_table(latencies)
    print(table)
    print()
    print(
        f"- the claim alone (in this process, nothing else running): p50 {alone['claim']:.0f} µs,"
        f" a PING {alone['ping']:.0f} µs"
    )
    print(f"- shared router's decisions: {counts['shared']}")
    print(f"- local router's decisions: {counts['local']}")
    payload = {
        **meta,
        "latency_us": summary,
        "added_us": added,
        "round_trip_p50_us": alone,
        "decisions": counts,
    }
    report_results("shared_state_latency", payload)


if __name__ == "__main__":
    main()
