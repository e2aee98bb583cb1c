"""`python -m prefix_router.sim` and the argparse hooks the main CLI reuses."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from dataclasses import fields

import aiohttp

from prefix_router.sim.cli import add_sim_arguments, config_from_args
from prefix_router.sim.config import SimConfig


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_match_sim_config() -> None:
    args = parse([])
    assert config_from_args(args) == SimConfig()
    assert (args.host, args.port, args.count) == ("127.0.0.1", 8001, 4)


def test_every_config_field_is_a_flag() -> None:
    flags = (
        "--model m --block-size 32 --capacity-blocks 100 --max-num-seqs 3 --overhead-ms 1.5 "
        "--prefill-ms-per-token 0.5 --itl-ms 2 --itl-batch-slowdown 0.1 --default-max-tokens 8 "
        "--max-tokens-limit 64"
    )
    args = parse(flags.split())
    config = config_from_args(args)
    assert config == SimConfig(
        model="m",
        block_size=32,
        capacity_blocks=100,
        max_num_seqs=3,
        overhead_ms=1.5,
        prefill_ms_per_token=0.5,
        itl_ms=2.0,
        itl_batch_slowdown=0.1,
        default_max_tokens=8,
        max_tokens_limit=64,
    )
    assert {field.name for field in fields(SimConfig)} <= set(vars(args))


async def test_module_runs_a_fleet_until_sigterm() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefix_router.sim", "--port", "0", "--count", "2", "--overhead-ms", "0",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    try:
        async with asyncio.timeout(30):
            urls = [(await process.stdout.readline()).decode().strip() for _ in range(2)]
        assert len(set(urls)) == 2
        async with aiohttp.ClientSession() as http:
            for url in urls:
                async with http.get(f"{url}/health") as response:
                    assert response.status == 200
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
