"""`prefix-router demo`: a simulated vLLM fleet with the router in front, on one machine, no GPU.

Without `--load` it serves until Ctrl-C. With `--load` it drives a shared-prefix workload through the
router twice, with our `prefix` policy and with `random`, on the same fleet (reset in between), and
prints what prefix affinity buys: the engines' own hit rate, TTFT, and how the load spread.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from prefix_router.errors import SettingsError
from prefix_router.runtime import run_loop
from prefix_router.settings import Settings, load_settings
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimFleet


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", type=int, default=4, help="simulated backends (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="router listen address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="router port (default: %(default)s)")
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=32,
        help="per-backend concurrency threshold (default: %(default)s)",
    )
    parser.add_argument("--config", metavar="FILE", help="router YAML config; its backends are replaced")
    load = parser.add_argument_group("load (--load: run a workload, print a comparison, exit)")
    load.add_argument(
        "--load", action="store_true", help="drive a shared-prefix workload: prefix vs random, then exit"
    )
    load.add_argument("--groups", type=int, default=8, help="prefix groups (default: %(default)s)")
    load.add_argument("--prompts", type=int, default=16, help="prompts per group (default: %(default)s)")
    load.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: %(default)s)")
    load.add_argument(
        "--system-tokens",
        type=int,
        default=2048,
        help="system prompt tokens per group (default: %(default)s)",
    )


def demo_settings(args: argparse.Namespace, urls: list[str]) -> Settings:
    overrides: dict[str, Any] = {
        "server": {"host": args.host, "port": args.port},
        "backends": [{"url": u} for u in urls],
        "balancing": {"max_inflight": args.max_inflight},
        "health": {"interval_s": 1.0},
    }
    return load_settings(args.config, overrides)


def banner(router_url: str, urls: list[str], model: str) -> str:
    body = '{"model":"' + model + '","messages":[{"role":"user","content":"Hello!"}]}'
    return "\n".join(
        [
            f"prefix-router demo: {len(urls)} simulated vLLM backends: {', '.join(urls)}",
            f"Router:        {router_url}",
            f'OpenAI client: OpenAI(base_url="{router_url}/v1", api_key="unused")',
            f"Try:           curl -s {router_url}/v1/chat/completions -H 'content-type: application/json' "
            f"-d '{body}'",
            f"Metrics:       {router_url}/metrics",
            "Ctrl-C to stop.",
        ]
    )


async def _run(args: argparse.Namespace) -> int:
    from prefix_router.router import create_app
    from prefix_router.runtime import serve

    sim_config = SimConfig()
    async with SimFleet(sim_config, count=args.backends) as fleet:
        try:
            settings = demo_settings(args, fleet.urls)
        except SettingsError as exc:
            print(f"prefix-router demo: {exc}", file=sys.stderr)
            return 2
        host = settings.server.host
        shown = f"[{host}]" if ":" in host else host
        if host in ("0.0.0.0", "::"):
            shown = "127.0.0.1"
        print(banner(f"http://{shown}:{settings.server.port}", fleet.urls, sim_config.model), flush=True)
        return await serve(create_app(settings))


def run_demo(args: argparse.Namespace) -> int:
    if args.backends < 1:
        print("prefix-router demo: --backends must be at least 1", file=sys.stderr)
        return 2
    try:
        if getattr(args, "load", False):
            from prefix_router.demo.load import run_load

            return run_loop(run_load(args))
        return run_loop(_run(args))
    except OSError as exc:
        print(f"prefix-router demo: {exc}", file=sys.stderr)
        return 1
