"""`prefix-router demo --load`: the same shared-prefix workload through the router with our `prefix`
policy and with `random`, on one simulated fleet reset in between, and a table of what changed.

The fleet here is made cache-sensitive on purpose (see `load_sim_config`): prefill is slow enough
that a miss shows in TTFT, and each backend's cache holds a fair share of the groups' prefixes but
not all of them, so spreading every group over every backend (random) evicts what it needs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

from prefix_router.errors import SettingsError
from prefix_router.loadgen.drivers import Progress, RunSummary, Target, client_session, measure
from prefix_router.loadgen.workloads import Workload, cache_sensitive_config, oracle_hit_rate, shared_prefix
from prefix_router.router import RouterApp, create_app
from prefix_router.runtime import RouterServer
from prefix_router.settings import Settings, load_settings
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimFleet

POLICIES = ("prefix", "random")
MAX_TOKENS = 16


def load_sim_config(workload_groups: int, system_tokens: int, backends: int, concurrency: int) -> SimConfig:
    """Per-backend cache: room for twice a fair share of the group prefixes, plus a whole prompt for
    each request a backend runs at once (a cold prompt holds all its blocks until prefill ends) —
    enough for affinity, too little for every group on every backend."""
    return cache_sensitive_config(
        prefix_tokens=system_tokens,
        prompt_tokens=system_tokens + 160,
        prefixes_per_backend=2 * workload_groups / backends,
        running_per_backend=math.ceil(concurrency / backends),
    )


@contextlib.asynccontextmanager
async def serving(app: RouterApp) -> AsyncIterator[str]:
    """Serve `app` on an ephemeral 127.0.0.1 port for the duration; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = RouterServer(app, [sock])
    task = asyncio.get_running_loop().create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("the router did not start")
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.request_exit()
        with contextlib.suppress(Exception):
            await task
        sock.close()


def load_settings_for(args: argparse.Namespace, urls: list[str], policy: str) -> Settings:
    overrides: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0, "log_level": "warning"},
        "backends": [{"url": u} for u in urls],
        "balancing": {"max_inflight": args.max_inflight, "policy": policy},
        "health": {"interval_s": 1.0},
    }
    return load_settings(args.config, overrides)


async def _ticker(label: str, progress: Progress, total: int) -> None:
    while True:
        await asyncio.sleep(1.0)
        rate = progress.done / progress.elapsed_s if progress.elapsed_s > 0 else 0.0
        print(f"  [{label}] {progress.done}/{total} requests, {rate:.1f} req/s", flush=True)


async def run_policy(
    args: argparse.Namespace, fleet: SimFleet, workload: Workload, policy: str, oracle: float
) -> RunSummary:
    app = create_app(load_settings_for(args, fleet.urls, policy))
    async with serving(app) as router_url, client_session() as session:
        progress = Progress()
        ticker = asyncio.get_running_loop().create_task(_ticker(policy, progress, len(workload)))
        try:
            summary, _ = await measure(
                session,
                Target(router_url, tuple(fleet.urls)),
                workload,
                concurrency=args.concurrency,
                oracle_hit_rate=oracle,
                progress=progress,
            )
        finally:
            ticker.cancel()
    print(f"  [{policy}] {summary.requests} requests in {summary.wall_s:.1f} s", flush=True)
    return summary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def comparison_table(summaries: dict[str, RunSummary], urls: list[str]) -> str:
    """A short plain-text table, one column per policy."""
    names = list(summaries)
    rows: list[tuple[str, list[str]]] = [
        ("prefix-cache hit rate", [f"{s.hit_rate:.1%}" for s in summaries.values()]),
        ("  of the oracle's", [f"{(s.oracle_ratio or 0):.0%}" for s in summaries.values()]),
        ("TTFT p50", [_ms(s.ttft_p50_s) for s in summaries.values()]),
        ("TTFT p99", [_ms(s.ttft_p99_s) for s in summaries.values()]),
        ("throughput", [f"{s.throughput_rps:.1f} req/s" for s in summaries.values()]),
        ("errors", [str(s.errors) for s in summaries.values()]),
    ]
    for i, url in enumerate(urls):
        rows.append((f"share backend {i} ({url.rsplit(':', 1)[-1]})",
                     [f"{s.backend_share.get(url, 0.0):.0%}" for s in summaries.values()]))  # fmt: skip
    width = max(len(label) for label, _ in rows) + 2
    col = max(12, *(len(v) + 2 for _, vals in rows for v in vals))
    lines = ["".ljust(width) + "".join(n.rjust(col) for n in names)]
    lines.append("-" * (width + col * len(names)))
    lines += [label.ljust(width) + "".join(v.rjust(col) for v in vals) for label, vals in rows]
    return "\n".join(lines)


async def run_load(args: argparse.Namespace) -> int:
    for name in ("groups", "prompts", "concurrency", "system_tokens"):
        if getattr(args, name) < 1:
            print(f"prefix-router demo: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    workload = shared_prefix(
        groups=args.groups, prompts_per_group=args.prompts, system_tokens=args.system_tokens,
        max_tokens=MAX_TOKENS,
    )  # fmt: skip
    config = load_sim_config(args.groups, args.system_tokens, args.count, args.concurrency)
    oracle = oracle_hit_rate(
        workload, block_size=config.block_size, capacity_blocks=config.capacity_blocks * args.count
    ).hit_rate
    print(
        f"prefix-router demo --load: {workload.description}; {args.count} simulated backends "
        f"({config.capacity_blocks} KV blocks each, prefill {config.prefill_ms_per_token} ms/token), "
        f"concurrency {args.concurrency}",
        flush=True,
    )
    async with SimFleet(config, count=args.count) as fleet:
        urls = fleet.urls
        try:
            summaries = {p: await run_policy(args, fleet, workload, p, oracle) for p in POLICIES}
        except SettingsError as exc:
            print(f"prefix-router demo: {exc}", file=sys.stderr)
            return 2
    print()
    print(comparison_table(summaries, urls))
    print(f"\noracle hit rate (best any placement could do): {oracle:.1%}")
    ours, baseline = summaries["prefix"], summaries["random"]
    if ours.ttft_p50_s and baseline.ttft_p50_s:
        print(f"prefix vs random: TTFT p50 {baseline.ttft_p50_s / ours.ttft_p50_s:.1f}x lower", flush=True)
    return 0 if all(s.errors == 0 for s in summaries.values()) else 1
