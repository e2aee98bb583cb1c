"""The `prefix-router` command: `serve`, `demo`, `sim`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

import prometheus_client

from prefix_router import __version__
from prefix_router.errors import SettingsError
from prefix_router.routing.config import Policy
from prefix_router.settings import Settings, load_settings


def _add_router_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config file (default: $PREFIX_ROUTER_CONFIG, else built-in defaults)",
    )
    parser.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        default=None,
        help="a backend base URL such as http://10.0.0.5:8000 (repeatable; replaces the config's list)",
    )
    parser.add_argument("--host", help="listen address (default 0.0.0.0)")
    parser.add_argument("--port", type=int, help="listen port (default 8080)")
    parser.add_argument("--metrics-port", type=int, help="also serve /metrics on this port")
    parser.add_argument("--admin-port", type=int, help="serve the admin API (drain) on this port (127.0.0.1)")
    parser.add_argument(
        "--policy", choices=[p.value for p in Policy], help="balancing policy (default prefix)"
    )
    parser.add_argument("--max-inflight", type=int, help="per-backend concurrency threshold (default 32)")
    parser.add_argument(
        "--prefix-chars", type=int, help="characters of message text in the key (default 4096)"
    )
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as a settings mapping that beats the file and the environment."""
    out: dict[str, Any] = {}

    def put(section: str, field: str, value: Any) -> None:
        if value is not None:
            out.setdefault(section, {})[field] = value

    put("server", "host", args.host)
    put("server", "port", args.port)
    put("server", "metrics_port", args.metrics_port)
    put("server", "admin_port", args.admin_port)
    put("server", "log_level", args.log_level)
    put("balancing", "policy", args.policy)
    put("balancing", "max_inflight", args.max_inflight)
    put("routing", "prefix_chars", args.prefix_chars)
    if args.backend:
        out["backends"] = [{"url": url} for url in args.backend]
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefix-router",
        description="A prefix-cache-aware HTTP routing proxy for vLLM fleets.",
    )
    parser.add_argument("--version", action="version", version=f"prefix-router {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the router in front of real backends")
    _add_router_flags(serve)

    from prefix_router.demo.run import add_demo_arguments
    from prefix_router.sim.cli import add_sim_arguments

    demo = sub.add_parser("demo", help="run a simulated vLLM fleet with the router in front (no GPU)")
    add_demo_arguments(demo)

    sim = sub.add_parser("sim", help="run simulated vLLM backends only")
    add_sim_arguments(sim)
    return parser


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def load_or_exit(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Settings:
    try:
        overrides = overrides_from_args(args)
        if extra:
            for section, values in extra.items():
                if isinstance(values, dict):
                    out = dict(values)
                    out.update(overrides.get(section, {}))
                    overrides[section] = out
                elif section not in overrides:
                    overrides[section] = values
        return load_settings(args.config, overrides)
    except SettingsError as exc:
        print(f"prefix-router: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def run_serve(args: argparse.Namespace) -> int:
    from prefix_router.router import create_app
    from prefix_router.runtime import run_loop, serve

    settings = load_or_exit(args)
    configure_logging(settings.server.log_level)
    if settings.server.access_log:
        from prefix_router.ops.access_log import LOGGER_NAME, route_to_stdout

        route_to_stdout(logging.getLogger(LOGGER_NAME))
    if not settings.backends and settings.discovery.mode.value == "static":
        print(
            "prefix-router: config error: backends: no backends (give --backend URL or a config file)",
            file=sys.stderr,
        )
        return 2
    return run_loop(serve(create_app(settings)))


def main(argv: Sequence[str] | None = None) -> int:
    # The process's one global switch: no `_created` series (they double every counter's series).
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "demo":
        from prefix_router.demo.run import run_demo

        return run_demo(args)
    from prefix_router.sim.cli import run_sim

    return run_sim(args)


if __name__ == "__main__":
    raise SystemExit(main())
