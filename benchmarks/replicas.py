"""Several router replicas in front of one fleet: does the per-backend bound hold with local counts only,
with the scraped load signal, and with shared placement state?

Three `prefix-router serve` processes on 127.0.0.1 (fresh for every run, so no prefix index carries
over) route to one simulated fleet of 4 backends that this process runs. A closed-loop client sends a
hot-prefix workload (half the requests share one system prompt) split round-robin across the three
replicas. Each replica counts only its own requests, so without the signal each may fill a backend to
`max_inflight` by itself; with `load_signal.enabled` each adds the other replicas' share, scraped from
the backends' `vllm:num_requests_running + vllm:num_requests_waiting` every `interval_s`; with
`routing.shared_state_url` (a `redis-server` this script starts on a loopback port, when the machine has
one) each claim carries the replica's counts and brings back the others'.

Per run: every backend's peak in-flight (running + waiting, the sim's high-water mark, reset with POST
/sim/reset before the run), the worst one over `max_inflight` as a ratio, the prefix-cache hit rate
(the backends' own counters) against the oracle, TTFT p50/p99, overflow share and errors.

    python benchmarks/replicas.py            # ~3 minutes on 2 cores
    python benchmarks/replicas.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, markdown_table, package_version, print_header, write_results
from prefix_router import __version__
from prefix_router.loadgen.drivers import (
    RequestResult,
    RunSummary,
    client_session,
    fetch_router_decisions,
    reset_sim,
    run_closed_loop,
    snapshot,
    summarise,
)
from prefix_router.loadgen.workloads import Workload, hot_prefix, oracle_hit_rate
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimFleet

from processes import RouterProcess, launch_router, stop_processes
from redisserver import RedisServer

REPLICAS = 3
BACKENDS = 4
MAX_INFLIGHT = 8
# Requests last ~0.2 s (10 ms overhead, ~1k prompt tokens at 0.04 ms, 32 tokens at 4 ms), long enough
# for many to overlap and for a 0.1 s scrape to be a fraction of a request's life.
SIM = SimConfig(overhead_ms=10.0, prefill_ms_per_token=0.04, itl_ms=4.0)
OUTPUT_TOKENS = 32
LOAD_FACTOR = [1.25]  # the shipped default; --load-factor sets it for a run


@dataclass(frozen=True)
class Variant:
    name: str
    signal: bool
    interval_s: float = 0.1
    shared: bool = False  # routing.shared_state_url on the script's redis-server


VARIANTS = (
    Variant("local counts only", False),
    Variant("scraped signal, 0.1 s", True),
    Variant("shared state (Redis)", False, shared=True),
)


@dataclass
class Run:
    variant: str
    concurrency: int
    summary: RunSummary
    peaks: dict[str, int]
    max_peak: int
    ratio: float
    errors: int


def router_config(
    urls: list[str], variant: Variant, order: int, load_factor: float, redis_url: str = ""
) -> dict[str, Any]:
    # Each replica lists the backends in its own order, as discovery may: the ring does not care.
    listed = urls[order:] + urls[:order]
    return {
        "routing": {"shared_state_url": redis_url if variant.shared else ""},
        "server": {"log_level": "warning"},
        "backends": [{"url": u} for u in listed],
        # Requests over the bound everywhere wait (bounded) in the replica rather than fail at once.
        "balancing": {
            "max_inflight": MAX_INFLIGHT,
            "load_factor": load_factor,
            "queue_timeout_s": 10.0,
            "queue_max": 256,
        },
        "health": {"interval_s": 2.0},
        "load_signal": {"enabled": variant.signal, "interval_s": variant.interval_s},
    }


@contextlib.asynccontextmanager
async def replicas(
    urls: list[str], variant: Variant, workdir: Path, redis_url: str = ""
) -> AsyncIterator[list[str]]:
    """REPLICAS routers in front of the same backends, ready; stopped on the way out."""
    started: list[RouterProcess] = []
    try:
        for i in range(REPLICAS):
            path = workdir / f"replica-{i}.yaml"
            path.write_text(yaml.safe_dump(router_config(urls, variant, i, LOAD_FACTOR[0], redis_url)))
            started.append(launch_router(["--config", str(path)], workdir / f"replica-{i}.log"))
        for router in started:
            await router.ready(readyz=True)
        yield [r.url for r in started]
    finally:
        stop_processes([r.proc for r in started])


def split(workload: Workload, parts: int) -> list[Workload]:
    """Request i goes to replica i mod parts (no request depends on another in this workload)."""
    return [
        Workload(f"{workload.name}[{p}]", workload.description, workload.requests[p::parts], workload.params)
        for p in range(parts)
    ]


async def run_one(
    session: aiohttp.ClientSession,
    urls: list[str],
    workload: Workload,
    variant: Variant,
    concurrency: int,
    oracle: float,
    workdir: Path,
    redis_url: str = "",
) -> Run:
    async with replicas(urls, variant, workdir, redis_url) as bases:
        await reset_sim(session, urls)
        before = await snapshot(session, urls)
        decisions_before = [await fetch_router_decisions(session, b) for b in bases]
        start = time.monotonic()
        parts = await asyncio.gather(
            *(
                run_closed_loop(session, base, part, concurrency=concurrency // REPLICAS)
                for base, part in zip(bases, split(workload, REPLICAS), strict=True)
            )
        )
        wall_s = time.monotonic() - start
        after = await snapshot(session, urls)
        decisions_after = [await fetch_router_decisions(session, b) for b in bases]
    results: list[RequestResult] = [r for part in parts for r in part]
    summary = summarise(
        results, before, after, wall_s=wall_s, oracle_hit_rate=oracle,
        decisions_before=_sum(decisions_before), decisions_after=_sum(decisions_after),
    )  # fmt: skip
    peaks = summary.peak_inflight
    max_peak = max(peaks.values())
    return Run(variant.name, concurrency, summary, peaks, max_peak, max_peak / MAX_INFLIGHT, summary.errors)


def _flush(server: RedisServer) -> None:
    """A fresh store for each run, as the replicas are fresh."""
    client = redis.Redis.from_url(server.url)
    try:
        client.flushall()
    finally:
        client.close()


def _sum(dicts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.0f}"


def table(runs: list[Run]) -> str:
    rows = []
    for r in runs:
        s = r.summary
        ordered = sorted(r.peaks.values(), reverse=True)
        rows.append(
            [
                r.variant,
                r.concurrency,
                " / ".join(str(p) for p in ordered),
                f"**{r.ratio:.2f}**",
                f"{s.hit_rate:.1%}",
                f"{s.oracle_ratio:.2f}" if s.oracle_ratio is not None else "–",
                _ms(s.ttft_p50_s),
                _ms(s.ttft_p99_s),
                f"{s.overflow_share:.1%}" if s.overflow_share is not None else "–",
                f"{s.throughput_rps:.0f}",
                r.errors,
            ]
        )
    headers = [
        "load accounting", "total concurrency", "peak in-flight per backend", "max peak / max_inflight",
        "hit rate", "vs oracle", "TTFT p50 ms", "TTFT p99 ms", "overflow", "req/s", "errors",
    ]  # fmt: skip
    return markdown_table(headers, rows)


async def main_async(args: argparse.Namespace) -> int:
    meta = print_header(
        "Several replicas: the per-backend bound with local counts, the scraped load signal, shared state",
        {
            "prefix_router": __version__,
            "aiohttp": package_version("aiohttp"),
            "uvicorn": package_version("uvicorn"),
        },
    )
    requests = 360 if args.quick else 1200
    concurrencies = [24, 48] if not args.quick else [24]
    workload = hot_prefix(requests=requests, cold_groups=12, question_tokens=64, max_tokens=OUTPUT_TOKENS)
    oracle = oracle_hit_rate(workload, block_size=SIM.block_size, capacity_blocks=None).hit_rate
    print(
        f"{REPLICAS} replicas, {BACKENDS} sim backends, max_inflight {MAX_INFLIGHT} per backend, "
        f"load_factor {LOAD_FACTOR[0]:g}; "
        f"{workload.description}; {OUTPUT_TOKENS} output tokens at itl {SIM.itl_ms:g} ms; "
        f"client split round-robin over the replicas; oracle hit rate {oracle:.1%}",
        flush=True,
    )
    runs: list[Run] = []
    binary = shutil.which("redis-server")
    variants = [v for v in VARIANTS if binary is not None or not v.shared]
    if binary is None:
        print("no redis-server on this machine: the shared-state variant is left out", flush=True)
    with tempfile.TemporaryDirectory(prefix="replicas-bench-") as tmp, contextlib.ExitStack() as stack:
        server = RedisServer(binary) if binary is not None else None
        if server is not None:
            server.start()
            stack.callback(server.close)
        redis_url = server.url if server is not None else ""
        async with SimFleet(SIM, count=BACKENDS) as fleet, client_session() as session:
            for concurrency in concurrencies:
                for variant in variants:
                    if server is not None and variant.shared:
                        await asyncio.to_thread(_flush, server)
                    run = await run_one(
                        session, fleet.urls, workload, variant, concurrency, oracle, Path(tmp), redis_url
                    )
                    runs.append(run)
                    print(
                        f"  {variant.name}, concurrency {concurrency}: max peak {run.max_peak} "
                        f"({run.ratio:.2f}x), hit rate {run.summary.hit_rate:.1%}, {run.errors} errors",
                        flush=True,
                    )
    print()
    text = table(runs)
    print(text)
    print()
    print(
        f"Peak in-flight is running + waiting as the backend saw it (its high-water mark over the run); "
        f"the bound each replica enforces is max_inflight = {MAX_INFLIGHT} on its own estimate of a "
        f"backend's load."
    )
    payload = {
        **meta,
        "params": {
            "replicas": REPLICAS, "backends": BACKENDS, "max_inflight": MAX_INFLIGHT,
            "load_factor": LOAD_FACTOR[0],
            "requests": requests, "output_tokens": OUTPUT_TOKENS,
            "sim": dataclasses.asdict(SIM), "quick": args.quick, "oracle_hit_rate": oracle,
        },
        "runs": [
            {
                "variant": r.variant, "concurrency": r.concurrency, "peaks": r.peaks, "max_peak": r.max_peak,
                "ratio": r.ratio, "summary": r.summary.as_dict(),
            }
            for r in runs
        ],
        "table": text,
    }  # fmt: skip
    path = write_results("replicas" + ("-quick" if args.quick else ""), payload)
    (path.with_suffix(".md")).write_text(text + "\n")
    print(f"\nresults: {path.relative_to(RESULTS_DIR.parent.parent)} (and .md)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--load-factor", type=float, default=1.25, help="balancing.load_factor of every replica (1.25)"
    )
    parser.add_argument("--quick", action="store_true", help="one concurrency, fewer requests (<1 minute)")
    args = parser.parse_args()
    LOAD_FACTOR[0] = args.load_factor
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
