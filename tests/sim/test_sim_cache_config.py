"""The sim exports vLLM's `vllm:cache_config_info`, so a router can read each backend's KV capacity."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimBackend


@pytest.mark.parametrize(
    ("block_size", "capacity_blocks"),
    [pytest.param(16, 25_000, id="default-geometry"), pytest.param(32, 777, id="small-cache")],
)
async def test_cache_config_info_carries_the_configured_capacity(
    block_size: int, capacity_blocks: int
) -> None:
    config = SimConfig(block_size=block_size, capacity_blocks=capacity_blocks, overhead_ms=1.0)
    async with (
        SimBackend(config) as backend,
        aiohttp.ClientSession() as http,
        http.get(f"{backend.url}/metrics") as response,
    ):
        assert response.status == 200
        text = await response.text()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge"
    [sample] = info.samples
    assert sample.name == "vllm:cache_config_info"
    assert sample.value == 1.0
    # Strings, as vLLM prints every CacheConfig field; no model_name label on this family in vLLM.
    assert sample.labels["num_gpu_blocks"] == str(capacity_blocks)
    assert sample.labels["block_size"] == str(block_size)
    assert sample.labels["engine"] == "0"
    assert sample.labels["enable_prefix_caching"] == "True"
    assert "model_name" not in sample.labels
    # What a router computes from it: the backend's KV capacity in tokens.
    tokens = int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
    assert tokens == capacity_blocks * block_size
