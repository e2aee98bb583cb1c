"""The HTTP surface of one simulated backend, through the official OpenAI client and raw HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimBackend, SimFleet

from loopback import eventually

# Small timings keep tests fast; nothing below asserts a wall-clock bound.
TEST_CONFIG = SimConfig(overhead_ms=1.0, prefill_ms_per_token=0.01, itl_ms=0.1)
LONG_SYSTEM_PROMPT = "You are a careful assistant who answers in plain words. " * 20


@pytest.fixture
def sim_config() -> SimConfig:
    return TEST_CONFIG


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def chat_messages(question: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": LONG_SYSTEM_PROMPT}, {"role": "user", "content": question}]


async def test_chat_completion_returns_a_full_response_with_usage(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.create(
        model="sim-llama", messages=chat_messages("Hello?"), max_tokens=5
    )
    choice = completion.choices[0]
    assert completion.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    usage = completion.usage
    assert usage is not None
    assert usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + 5
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0


async def test_repeating_a_chat_prompt_hits_the_prefix_cache(client: openai.AsyncOpenAI) -> None:
    messages = chat_messages("What is a prefix cache?")
    first = await client.chat.completions.create(model="sim-llama", messages=messages)
    second = await client.chat.completions.create(model="sim-llama", messages=messages)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    prompt_tokens = second.usage.prompt_tokens
    block_size = TEST_CONFIG.block_size
    assert second.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // block_size * block_size
    assert second.usage.prompt_tokens_details.cached_tokens > 0


async def test_a_shared_system_prompt_is_reused_across_questions(client: openai.AsyncOpenAI) -> None:
    await client.chat.completions.create(model="sim-llama", messages=chat_messages("First question"))
    second = await client.chat.completions.create(model="sim-llama", messages=chat_messages("Another one"))
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    assert 0 < cached < second.usage.prompt_tokens


async def test_chat_streaming_sends_role_tokens_and_usage_last(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="sim-llama",
        messages=chat_messages("Stream, please"),
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    finish_reasons = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finish_reasons[-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    assert all(chunk.usage is None for chunk in chunks[:-1])

    full = await client.chat.completions.create(
        model="sim-llama", messages=chat_messages("Stream, please"), max_tokens=7
    )
    assert text == full.choices[0].message.content


async def test_streaming_without_include_usage_sends_no_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="sim-llama", messages=chat_messages("x"), max_tokens=3, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert all(chunk.usage is None for chunk in chunks)
    assert all(chunk.choices for chunk in chunks)


async def test_completions_non_streaming_and_streaming(client: openai.AsyncOpenAI) -> None:
    prompt = "Once upon a time, " * 10
    completion = await client.completions.create(model="sim-llama", prompt=prompt, max_tokens=4)
    assert completion.object == "text_completion"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 4

    stream = await client.completions.create(
        model="sim-llama", prompt=prompt, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == completion.choices[0].text
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens


async def test_completions_accept_token_ids(client: openai.AsyncOpenAI) -> None:
    completion = await client.completions.create(model="sim-llama", prompt=list(range(50)), max_tokens=1)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 50


async def test_cache_salt_isolates_tenants(client: openai.AsyncOpenAI) -> None:
    messages = chat_messages("Same words, different tenants")
    await client.chat.completions.create(model="sim-llama", messages=messages, extra_body={"cache_salt": "a"})
    other = await client.chat.completions.create(
        model="sim-llama", messages=messages, extra_body={"cache_salt": "b"}
    )
    same = await client.chat.completions.create(
        model="sim-llama", messages=messages, extra_body={"cache_salt": "a"}
    )
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert same.usage is not None and same.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens


async def test_max_tokens_above_the_limit_is_clamped(http: aiohttp.ClientSession) -> None:
    async with SimBackend(SimConfig(max_tokens_limit=32, itl_ms=0.0)) as capped:
        response = await http.post(f"{capped.url}/v1/completions", json={"prompt": "x", "max_tokens": 10**9})
        completion = await response.json()
    assert completion["usage"]["completion_tokens"] == 32


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        pytest.param({"max_tokens": -1}, "max_tokens", id="negative-max-tokens"),
        pytest.param({"max_completion_tokens": 0}, "max_completion_tokens", id="zero-max-completion-tokens"),
        pytest.param({"n": 2}, "n", id="n-above-one"),
        pytest.param({"cache_salt": 5}, "cache_salt", id="non-string-salt"),
    ],
)
async def test_invalid_fields_are_rejected_with_400(
    client: openai.AsyncOpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(model="sim-llama", messages=chat_messages("x"), extra_body=extra)
    assert raised.value.status_code == 400
    assert param in str(raised.value)


async def test_an_unknown_model_is_404_like_vllm(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-nothing", messages=chat_messages("x"))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/chat/completions", b"{not json", id="chat-bad-json"),
        pytest.param("/v1/completions", b"[1, 2", id="completions-bad-json"),
        pytest.param("/v1/chat/completions", b"[]", id="chat-not-an-object"),
        pytest.param("/v1/chat/completions", b'{"messages": []}', id="chat-no-messages"),
        pytest.param("/v1/completions", b'{"prompt": {"a": 1}}', id="completions-bad-prompt"),
        pytest.param("/v1/completions", b'{"prompt": ""}', id="completions-empty-prompt"),
    ],
)
async def test_malformed_bodies_get_an_openai_shaped_400(
    backend: SimBackend, http: aiohttp.ClientSession, path: str, body: bytes
) -> None:
    async with http.post(
        f"{backend.url}{path}", data=body, headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
        payload = await r.json()
    assert set(payload["error"]) >= {"message", "type", "code"}
    assert payload["error"]["code"] == 400


async def test_a_prompt_too_large_for_the_kv_cache_is_400(http: aiohttp.ClientSession) -> None:
    async with SimBackend(SimConfig(block_size=4, capacity_blocks=2)) as small:
        response = await http.post(f"{small.url}/v1/completions", json={"prompt": "x" * 100})
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "prompt"


async def test_models_lists_the_served_model(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [model.id for model in models.data] == ["sim-llama"]


async def test_health_is_an_empty_200(backend: SimBackend, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{backend.url}/health") as response:
        assert response.status == 200
        assert await response.read() == b""


async def test_metrics_use_vllm_names_and_types(
    backend: SimBackend, client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    for _ in range(2):
        await client.chat.completions.create(
            model="sim-llama", messages=chat_messages("metrics"), max_tokens=3
        )
    async with http.get(f"{backend.url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    expected_types = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
    }
    assert {name: families[name].type for name in expected_types} == expected_types
    for counter in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens"):
        assert f"# TYPE vllm:{counter}_total counter" in text or f"# TYPE vllm:{counter} counter" in text
        assert f'vllm:{counter}_total{{engine="0",model_name="sim-llama"}}' in text
    samples = {
        (sample.name, sample.labels.get("finished_reason"), sample.labels.get("le")): sample.value
        for family in families.values()
        for sample in family.samples
    }
    assert samples[("vllm:request_success_total", "length", None)] == 2
    assert samples[("vllm:generation_tokens_total", None, None)] == 6
    assert samples[("vllm:prefix_cache_hits_total", None, None)] > 0
    assert samples[("vllm:time_to_first_token_seconds_count", None, None)] == 2
    assert samples[("vllm:time_to_first_token_seconds_bucket", None, "+Inf")] == 2
    assert samples[("vllm:num_requests_running", None, None)] == 0


async def test_stats_and_reset(
    backend: SimBackend, client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    for _ in range(2):
        await client.chat.completions.create(model="sim-llama", messages=chat_messages("stats"))
    async with http.get(f"{backend.url}/sim/stats") as response:
        stats = await response.json()
    assert stats["requests"] == 2
    assert stats["prefix_cache_hits"] > 0
    assert stats["prefix_cache_queries"] >= stats["prefix_cache_hits"]
    assert (stats["running"], stats["waiting"], stats["peak_running"], stats["peak_inflight"]) == (0, 0, 1, 1)

    async with http.post(f"{backend.url}/sim/reset") as response:
        assert response.status == 200
        stats = await response.json()
    assert (stats["requests"], stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (0, 0, 0)
    again = await client.chat.completions.create(model="sim-llama", messages=chat_messages("stats"))
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 0


async def test_concurrent_requests_beyond_max_num_seqs_queue(http: aiohttp.ClientSession) -> None:
    config = SimConfig(max_num_seqs=2, overhead_ms=0.0, prefill_ms_per_token=0.0, itl_ms=2.0)
    async with SimBackend(config) as small:

        async def complete(index: int) -> int:
            body = {"prompt": f"request {index}", "max_tokens": 20}
            async with http.post(f"{small.url}/v1/completions", json=body) as response:
                return response.status

        statuses = await asyncio.gather(*(complete(index) for index in range(6)))
        stats = small.server.stats()
    assert statuses == [200] * 6
    assert stats["peak_running"] == 2
    assert stats["peak_inflight"] == 6
    assert stats["peak_waiting"] == 4


async def test_a_client_disconnect_mid_stream_frees_the_slot(http: aiohttp.ClientSession) -> None:
    config = SimConfig(max_num_seqs=1, overhead_ms=0.0, prefill_ms_per_token=0.0, itl_ms=20.0)
    async with SimBackend(config) as slow:
        scheduler = slow.server.scheduler
        body = {"prompt": "stream forever", "max_tokens": 4096, "stream": True}
        response = await http.post(f"{slow.url}/v1/completions", json=body)
        assert response.status == 200
        assert (await response.content.readline()).startswith(b"data: ")
        assert scheduler.num_running == 1
        response.close()  # drops the connection
        await eventually(lambda: scheduler.num_running == 0)
        assert scheduler.counters.requests_aborted == 1
        assert scheduler.kv_cache_usage == 0.0


async def test_a_client_disconnect_while_waiting_leaves_the_queue(http: aiohttp.ClientSession) -> None:
    config = SimConfig(max_num_seqs=1, overhead_ms=0.0, prefill_ms_per_token=0.0, itl_ms=20.0)
    async with SimBackend(config) as slow:
        scheduler = slow.server.scheduler
        busy = await http.post(
            f"{slow.url}/v1/completions", json={"prompt": "a", "max_tokens": 4096, "stream": True}
        )

        async def wait_in_queue() -> None:
            async with http.post(
                f"{slow.url}/v1/completions", json={"prompt": "b", "max_tokens": 1}
            ) as response:
                await response.read()

        queued = asyncio.create_task(wait_in_queue())
        await eventually(lambda: scheduler.num_waiting == 1)
        queued.cancel()  # closes its connection
        await eventually(lambda: scheduler.num_waiting == 0)
        assert scheduler.num_running == 1
        busy.close()
        await eventually(lambda: scheduler.num_running == 0)
        assert scheduler.counters.requests_finished == 0


async def test_a_fleet_serves_independent_backends_on_free_ports(http: aiohttp.ClientSession) -> None:
    async with SimFleet(TEST_CONFIG, count=3) as fleet:
        urls = fleet.urls
        assert len(set(urls)) == 3
        assert all(url.startswith("http://127.0.0.1:") for url in urls)
        async with http.post(f"{urls[0]}/v1/completions", json={"prompt": "only the first"}) as response:
            assert response.status == 200
        counts = []
        for url in urls:
            async with http.get(f"{url}/sim/stats") as response:
                counts.append((await response.json())["requests"])
    assert counts == [1, 0, 0]
