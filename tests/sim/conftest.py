"""One simulated vLLM server on a loopback port and the official OpenAI client in front of it; a module
sets how the server behaves with its own `sim_config` fixture."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimBackend


@pytest.fixture
def sim_config() -> SimConfig:
    # Small timings keep tests fast; nothing asserts a wall-clock bound.
    return SimConfig(overhead_ms=1.0, prefill_ms_per_token=0.01, itl_ms=0.1)


@pytest.fixture
async def backend(sim_config: SimConfig) -> AsyncIterator[SimBackend]:
    async with SimBackend(sim_config) as running:
        yield running


@pytest.fixture
async def client(backend: SimBackend) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{backend.url}/v1", api_key="x", max_retries=0) as sdk:
        yield sdk
