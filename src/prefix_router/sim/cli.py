"""`prefix-router sim` / `python -m prefix_router.sim`: run a fleet of simulated vLLM servers.

Every SimConfig field is a flag; defaults come from SimConfig, so the two cannot drift.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
import sys
from dataclasses import fields

from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimFleet

_DEFAULTS = SimConfig()
PROG = "prefix-router sim"

# SimConfig field -> (flag, help). Each field's default and its source live in config.py.
_CONFIG_FLAGS: dict[str, tuple[str, str]] = {
    "model": ("--model", "served model name (vLLM's --served-model-name)"),
    "adapters": ("--adapters", "LoRA adapter names loaded on every backend, listed with `parent`"),
    "responses_store": ("--responses-store", "store Responses API results (vLLM's response store)"),
    "responses_store_max": ("--responses-store-max", "stored responses kept at most"),
    "block_size": ("--block-size", "tokens per KV block"),
    "capacity_blocks": ("--capacity-blocks", "KV cache size in blocks"),
    "max_num_seqs": ("--max-num-seqs", "running requests at most; the rest wait FIFO"),
    "overhead_ms": ("--overhead-ms", "fixed part of every time to first token, ms"),
    "prefill_ms_per_token": ("--prefill-ms-per-token", "prefill cost per uncached prompt token, ms"),
    "itl_ms": ("--itl-ms", "inter-token latency of a lone sequence, ms"),
    "itl_batch_slowdown": (
        "--itl-batch-slowdown",
        "relative ITL growth per extra running sequence: itl = itl_ms * (1 + this * (running - 1))",
    ),
    "default_max_tokens": ("--default-max-tokens", "output tokens when a request sets no max_tokens"),
    "max_tokens_limit": ("--max-tokens-limit", "requested max_tokens above this are clamped"),
}


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument(
        "--port",
        type=int,
        default=8001,
        help="port of the first backend; the others take the next ports; 0 = each a free port "
        "(default: %(default)s)",
    )
    parser.add_argument("--count", type=int, default=4, help="number of backends (default: %(default)s)")
    for field in fields(SimConfig):
        flag, help_text = _CONFIG_FLAGS[field.name]
        default = getattr(_DEFAULTS, field.name)
        kind: dict[str, object]
        if isinstance(default, bool):
            kind = {"action": argparse.BooleanOptionalAction}
        elif isinstance(default, tuple):
            kind = {"nargs": "*", "type": str}
        else:
            kind = {"type": type(default)}
        parser.add_argument(
            flag,
            dest=field.name,
            default=default,
            help=f"{help_text} (default: %(default)s)",
            **kind,  # type: ignore[arg-type]
        )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    values = {field.name: getattr(args, field.name) for field in fields(SimConfig)}
    values["adapters"] = tuple(values["adapters"])
    config = SimConfig(**values)
    config.validate()
    return config


def run_sim(args: argparse.Namespace) -> int:
    """Serve the fleet until SIGINT or SIGTERM; returns the process exit code."""
    try:
        config = config_from_args(args)
        fleet = SimFleet(config, host=args.host, base_port=args.port, count=args.count)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve_until_signalled(fleet))
    except OSError as exc:  # typically a port already in use: one line, before any URL is printed
        if exc.errno == errno.EADDRINUSE and args.port:
            print(f"{PROG}: a port in {args.port}..{args.port + args.count - 1} is in use; try --port "
                  f"{args.port + args.count} or --port 0 (free ports)", file=sys.stderr)  # fmt: skip
        else:
            print(f"{PROG}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the signal handlers below are installed
        print(f"{PROG}: stopped", file=sys.stderr)
        return 130
    print(f"{PROG}: stopped", file=sys.stderr)
    return 0


async def _serve_until_signalled(fleet: SimFleet) -> None:
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signal_number, stop_requested.set)
    async with fleet:
        for url in fleet.urls:
            print(url, flush=True)
        await stop_requested.wait()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m prefix_router.sim", description="Run simulated vLLM servers with a prefix cache."
    )
    add_sim_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_sim(build_parser().parse_args(argv))
