"""The `prefix-router` command: `serve`, `demo`, `sim`.

What a user meets first: every refusal (a bad setting, a missing extra, a taken port, no backends) is one
line on stderr and exit 2, before anything starts; Ctrl-C ends with one line, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prefix_router import __version__

if TYPE_CHECKING:
    from prefix_router.settings import Settings

# Everything else is imported inside the functions, after main() has its Ctrl-C guard: an interrupt
# while the libraries load must end as quietly as one while serving.

SERVE_EXAMPLES = """\
examples:
  prefix-router serve --backend http://vllm-0:8000 --backend http://vllm-1:8000
  prefix-router serve --config router.yaml --port 9000
  PREFIX_ROUTER_BACKENDS=http://vllm-0:8000,http://vllm-1:8000 prefix-router serve
  PREFIX_ROUTER_BALANCING__MAX_INFLIGHT=16 prefix-router serve --config router.yaml

Flags beat PREFIX_ROUTER_<SECTION>__<FIELD> variables, which beat the config file.
"""

NO_BACKENDS = (
    "config error: backends: none given; pass --backend URL, set PREFIX_ROUTER_BACKENDS=http://host:8000 "
    "(comma-separated), list them in the config file, or set discovery.mode to dns or kubernetes"
)


def _add_router_flags(parser: argparse.ArgumentParser) -> None:
    from prefix_router.routing.config import Policy

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

    serve = sub.add_parser(
        "serve",
        help="run the router in front of real backends",
        description="Run the router in front of vLLM backends.",
        epilog=SERVE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_router_flags(serve)

    from prefix_router.demo.run import add_demo_arguments
    from prefix_router.sim.cli import add_sim_arguments

    demo = sub.add_parser("demo", help="run a simulated vLLM fleet with the router in front (no GPU)")
    add_demo_arguments(demo)

    sim = sub.add_parser("sim", help="run simulated vLLM backends only")
    add_sim_arguments(sim)
    return parser


def configure_logging(settings: Settings) -> None:
    """The process's log handlers: set here, by the command, never by a constructor."""
    logging.basicConfig(
        level=settings.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if settings.server.access_log:
        from prefix_router.ops.access_log import LOGGER_NAME, route_to_stdout

        route_to_stdout(logging.getLogger(LOGGER_NAME))


def fail(message: str, prog: str = "prefix-router") -> int:
    """One line on stderr; exit code 2 (a usage or configuration error, as argparse's own)."""
    print(f"{prog}: {message}", file=sys.stderr)
    return 2


def check_discovery(settings: Settings) -> None:
    """Build (not run) the discovery source now, so a missing extra or namespace is a start-up error.

    The missing `kubernetes` extra is named first: without it nothing else about the mode matters.
    """
    from prefix_router.fleet.discovery import build_discovery
    from prefix_router.settings import DiscoveryMode

    if settings.discovery.mode is DiscoveryMode.KUBERNETES:
        from prefix_router.fleet.discovery.kubernetes import import_kubernetes_client

        import_kubernetes_client()
    build_discovery(settings.discovery, ())


def run_serve(args: argparse.Namespace) -> int:
    from prefix_router.errors import SettingsError
    from prefix_router.router import create_app
    from prefix_router.runtime import PortInUse, bind_sockets, run_loop, serve
    from prefix_router.settings import DiscoveryMode, load_settings

    try:
        settings = load_settings(args.config, overrides_from_args(args))
        if not settings.backends and settings.discovery.mode is DiscoveryMode.STATIC:
            return fail(NO_BACKENDS)
        check_discovery(settings)
    except SettingsError as exc:
        return fail(str(exc))
    s = settings.server
    try:
        sockets = bind_sockets(s.host, s.port)
    except PortInUse as exc:
        return fail(exc.describe())
    except OSError as exc:
        return fail(f"cannot listen on {s.host}:{s.port}: {exc.strerror or exc}")
    configure_logging(settings)
    try:
        code = run_loop(serve(create_app(settings), sockets))
    except SettingsError as exc:  # raised while starting (discovery reads its environment then)
        return fail(str(exc))
    finally:
        for sock in sockets:
            sock.close()
    if code == 0:
        print("prefix-router: stopped", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C before a command's own handler is installed, or where it has none (demo --load): the
        # loop has already cancelled and cleaned up its tasks. One line, and the shell's 128 + SIGINT.
        print("prefix-router: stopped", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    import prometheus_client

    # The process's one global switch: no `_created` series (they double every counter's series).
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "demo":
        from prefix_router.demo.run import run_demo

        return run_demo(args)
    from prefix_router.sim.cli import run_sim

    return run_sim(args)


if __name__ == "__main__":
    raise SystemExit(main())
