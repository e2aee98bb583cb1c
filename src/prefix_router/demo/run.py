"""`prefix-router demo`: a simulated vLLM fleet with the router in front, on one machine, no GPU.

Without `--load` it serves until Ctrl-C. With `--load` it drives a shared-prefix workload through the
router twice, with our `prefix` policy and with `random`, on the same fleet (reset in between), and
prints what prefix affinity buys: the engines' own hit rate, TTFT, and how the load spread.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

from prefix_router.errors import SettingsError
from prefix_router.runtime import PortInUse, bind_sockets, run_loop
from prefix_router.settings import Settings, load_settings
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimFleet

PROG = "prefix-router demo"


class _DeprecatedAlias(argparse.Action):
    """An old flag spelling, hidden from --help, that still works and says once what replaced it."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.replacement = replacement

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{PROG}: {option_string} is deprecated; use {self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--count", type=int, default=4, metavar="N", help="simulated backends (default: %(default)s)"
    )
    parser.add_argument(
        "--backends", dest="count", type=int, action=_DeprecatedAlias, replacement="--count N"
    )
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


def openai_one_liner(router_url: str, model: str) -> str:
    """A shell line that sends one chat request with the OpenAI SDK and prints the reply (needs only
    `pip install openai`); the demo test runs it as printed."""
    code = (
        "from openai import OpenAI; "
        f'client = OpenAI(base_url="{router_url}/v1", api_key="unused"); '
        f'reply = client.chat.completions.create(model="{model}", '
        'messages=[{"role": "user", "content": "Hello!"}]); '
        "print(reply.choices[0].message.content)"
    )
    return f"python -c '{code}'"


def banner(router_url: str, urls: list[str], model: str) -> str:
    body = '{"model":"' + model + '","messages":[{"role":"user","content":"Hello!"}]}'
    return "\n".join(
        [
            f"{PROG}: {len(urls)} simulated vLLM backends: {', '.join(urls)}",
            f"Router:        {router_url}",
            f"Try:           curl -s {router_url}/v1/chat/completions -H 'content-type: application/json' "
            f"-d '{body}'",
            "OpenAI SDK:    (pip install openai)",
            f"  {openai_one_liner(router_url, model)}",
            f"Metrics:       {router_url}/metrics",
            "Ctrl-C to stop.",
        ]
    )


def shown_url(host: str, port: int) -> str:
    """The router's URL as a client on this machine reaches it."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _run(args: argparse.Namespace, sockets: list[socket.socket]) -> int:
    from prefix_router.router import create_app
    from prefix_router.runtime import serve

    sim_config = SimConfig()
    async with SimFleet(sim_config, count=args.count) as fleet:
        try:
            settings = demo_settings(args, fleet.urls)
        except SettingsError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        port = sockets[0].getsockname()[1]  # --port 0: the one the system chose
        text = banner(shown_url(args.host, port), fleet.urls, sim_config.model)
        return await serve(create_app(settings), sockets, on_started=lambda: print(text, flush=True))


def run_demo(args: argparse.Namespace) -> int:
    if args.count < 1:
        print(f"{PROG}: --count must be at least 1", file=sys.stderr)
        return 2
    if getattr(args, "load", False):
        from prefix_router.demo.load import run_load

        return run_loop(run_load(args))  # the router and the fleet there take free ports
    # The router's port is bound before anything is printed, and kept: a taken port is one line, and
    # the curl line printed below can only reach this router. The simulated backends take free ports.
    try:
        sockets = bind_sockets(args.host, args.port)
    except PortInUse as exc:
        print(f"{PROG}: {exc.describe()}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        code = run_loop(_run(args, sockets))
    except OSError as exc:  # the simulated fleet could not start
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    finally:
        for sock in sockets:
            sock.close()
    if code == 0:
        print(f"{PROG}: stopped", file=sys.stderr)
    return code
