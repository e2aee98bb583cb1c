"""The sim answers vLLM's /tokenize, with the count its generation would report as prompt tokens, so a
router learns its bytes per token as it would from vLLM."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimBackend

MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is a prefix cache, and why does placement matter for it?"},
]


@pytest.mark.parametrize(
    ("path", "generate", "tokenize"),
    [
        pytest.param(
            "/v1/chat/completions", {"messages": MESSAGES}, {"messages": MESSAGES}, id="chat-templated"
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": "Once upon a time there was a router"},
            {"prompt": "Once upon a time there was a router"},
            id="completion",
        ),
    ],
)
async def test_tokenize_counts_what_a_generation_reports(
    path: str, generate: dict[str, Any], tokenize: dict[str, Any]
) -> None:
    config = SimConfig(overhead_ms=1.0, prefill_ms_per_token=0.01, itl_ms=0.1)
    async with SimBackend(config) as backend, aiohttp.ClientSession() as http:
        async with http.post(
            f"{backend.url}{path}", json={"model": config.model, "max_tokens": 2, **generate}
        ) as r:
            assert r.status == 200
            prompt_tokens = (await r.json())["usage"]["prompt_tokens"]
        async with http.post(f"{backend.url}/tokenize", json={"model": config.model, **tokenize}) as r:
            assert r.status == 200
            answer = await r.json()
    assert answer["count"] == prompt_tokens == len(answer["tokens"])


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        pytest.param({"model": "sim-llama", "prompt": [1, 2, 3]}, 400, "prompt", id="token-ids"),
        pytest.param({"model": "sim-llama", "messages": []}, 400, "messages", id="no-messages"),
        pytest.param({"model": "other", "prompt": "x"}, 404, "model", id="unknown-model"),
    ],
)
async def test_tokenize_refuses_what_vllm_refuses(body: dict[str, Any], status: int, param: str) -> None:
    async with (
        SimBackend(SimConfig(overhead_ms=1.0)) as backend,
        aiohttp.ClientSession() as http,
        http.post(f"{backend.url}/tokenize", json=body) as r,
    ):
        assert r.status == status
        error = (await r.json())["error"]
    assert error["param"] == param
