"""The router learns each backend's KV capacity from vLLM's cache_config_info, and first placements
and owner ageing use it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from prefix_router.fleet.bytes_per_token import BytesPerTokenProbe
from prefix_router.fleet.kv_capacity import parse_kv_capacity_tokens
from prefix_router.routing.keys import extract_key
from prefix_router.settings import Settings
from prefix_router.upstream.client import Upstream
from prefix_router.upstream.config import UpstreamConfig

from loopback import eventually_equal
from routerkit import eventually, free_socket, router_settings, start_side_app

# The line as vLLM 0.x prints it (one engine), and what a data-parallel server adds.
VLLM_INFO = (
    b'vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",'
    b'cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
    b'is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="2048",'
    b'num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",'
    b'swap_space="4",swap_space_bytes="4294967296"} 1.0'
)


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        pytest.param(b"# HELP vllm:cache_config_info x\n" + VLLM_INFO + b"\n", 2048 * 16, id="vllm"),
        pytest.param(
            VLLM_INFO + b"\n" + VLLM_INFO.replace(b'engine="0"', b'engine="1"'),
            2 * 2048 * 16,
            id="two-engines",
        ),
        pytest.param(
            VLLM_INFO.replace(b'num_gpu_blocks="2048"', b'num_gpu_blocks="None"'), None, id="not-known"
        ),
        pytest.param(b'vllm:num_requests_running{engine="0"} 3.0\n', None, id="no-info-metric"),
        pytest.param(b'vllm:cache_config_info{block_size="16"', None, id="truncated"),
        pytest.param(b"", None, id="empty"),
    ],
)
def test_capacity_is_read_from_vllms_info_metric(text: bytes, tokens: int | None) -> None:
    assert parse_kv_capacity_tokens(text) == tokens


# What each fake's /tokenize answers: a count, or nothing (an engine without /tokenize).
TOKEN_COUNTS = (50, 200, None)


def _vllm_like(
    num_gpu_blocks: int | None, token_count: int | None, asked: list[dict[str, Any]]
) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        body = b"" if num_gpu_blocks is None else VLLM_INFO.replace(b"2048", str(num_gpu_blocks).encode())
        return web.Response(body=body, content_type="text/plain")

    async def tokenize(request: web.Request) -> web.Response:
        asked.append(await request.json())
        return web.json_response({"count": token_count, "max_model_len": 4096, "tokens": []})

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    if token_count is not None:
        app.router.add_post("/tokenize", tokenize)
    app.router.add_route("*", "/{tail:.*}", ok)
    return app


@pytest.fixture
async def tokenize_asks() -> list[list[dict[str, Any]]]:
    return [[], [], []]


@pytest.fixture
async def vllm_like(tokenize_asks: list[list[dict[str, Any]]]) -> AsyncIterator[list[str]]:
    runners: list[web.AppRunner] = []
    urls: list[str] = []
    for blocks, count, asked in zip((100, 300, None), TOKEN_COUNTS, tokenize_asks, strict=True):
        runner = web.AppRunner(_vllm_like(blocks, count, asked))
        await runner.setup()
        sock = free_socket()
        site = web.SockSite(runner, sock)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{sock.getsockname()[1]}")
    yield urls
    for runner in runners:
        await runner.cleanup()


async def test_the_router_learns_each_backends_capacity(vllm_like, router) -> None:
    r = await router(router_settings(vllm_like, health={"interval_s": 0.05}))
    ledgers = r.app.picker.ledgers
    assert ledgers is not None
    a, b, c = vllm_like
    await eventually(lambda: ledgers.capacity(a) == 100 * 16 * 4.0 and ledgers.capacity(b) == 300 * 16 * 4.0)
    # A backend that does not say counts as the known ones' mean: neither the roomiest nor full.
    assert ledgers.capacity(c) == (ledgers.capacity(a) + ledgers.capacity(b)) / 2


async def test_a_configured_capacity_wins(vllm_like, router) -> None:
    settings = router_settings(
        vllm_like, routing={"kv_capacity_tokens": 5000, "bytes_per_token": 3.0}, health={"interval_s": 0.05}
    )
    r = await router(settings)
    ledgers = r.app.picker.ledgers
    assert ledgers is not None
    await eventually(lambda: all(ledgers.capacity(u) == 15000.0 for u in vllm_like))


async def test_capacity_is_known_when_the_router_opens(vllm_like, router) -> None:
    # A probe interval far beyond the test: what is known at once was read before the listener opened.
    r = await router(router_settings(vllm_like, health={"interval_s": 300.0}))
    ledgers = r.app.picker.ledgers
    assert ledgers is not None
    a, b, _ = vllm_like
    assert (ledgers.capacity(a), ledgers.capacity(b)) == (100 * 16 * 4.0, 300 * 16 * 4.0)


def _chat(i: int) -> dict[str, Any]:
    # Every prompt the same length, so the learnt ratio is one key size over the backend's count; each
    # its own system prompt, so the ring spreads them.
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"Be brief {i:04d}."},
            {"role": "user", "content": "Why?"},
        ],
        "max_tokens": 4,
        "stream": False,
    }


def _key_bytes(settings: Settings) -> int:
    """Bytes of key material in each `_chat` body: what a learnt ratio divides by its token count."""
    return extract_key("/v1/chat/completions", orjson.dumps(_chat(0)), None, settings.key_config()).size


async def _until_each_answered(r, client, urls: list[str]) -> None:
    answered: set[str] = set()
    for i in range(400):
        resp = await client.post(f"{r.url}/v1/chat/completions", json=_chat(i))
        assert resp.status_code == 200
        answered.add(resp.headers["x-prefix-router-backend"])
        if answered == set(urls):
            return
    raise AssertionError(f"only {answered} answered")


async def test_each_backends_bytes_per_token_is_learnt_from_its_tokenize(
    vllm_like, tokenize_asks, router, client
) -> None:
    # First placements by the ring, so that every backend answers some (by cache room, the roomiest
    # would take them all).
    settings = router_settings(
        vllm_like, routing={"first_placement": "ring", "bytes_per_token": None}, health={"interval_s": 0.05}
    )
    r = await router(settings)
    ledgers = r.app.picker.ledgers
    assert ledgers is not None
    a, b, c = vllm_like
    await eventually(lambda: ledgers.capacity(a) == 100 * 16 * 4.0)
    await _until_each_answered(r, client, vllm_like)
    size = _key_bytes(settings)
    await eventually(
        lambda: ledgers.capacity(a) == 100 * 16 * size / 50 and ledgers.capacity(b) == 300 * 16 * size / 200
    )
    # An engine without /tokenize keeps the default.
    assert r.app.bytes_per_token(c) == 4.0
    # The engine is asked for the prompt as it would render it, nothing about generating.
    asked = tokenize_asks[0][0]
    assert set(asked) == {"model", "messages"}
    assert asked["model"] == "m" and asked["messages"][1] == {"role": "user", "content": "Why?"}


async def test_a_configured_bytes_per_token_is_not_learnt(vllm_like, tokenize_asks, router, client) -> None:
    settings = router_settings(
        vllm_like, routing={"bytes_per_token": 3.0, "first_placement": "ring"}, health={"interval_s": 0.05}
    )
    r = await router(settings)
    ledgers = r.app.picker.ledgers
    assert ledgers is not None
    await _until_each_answered(r, client, vllm_like)
    assert r.app.token_ratios is None, "a configured value is never learnt"
    assert ledgers.capacity(vllm_like[0]) == 100 * 16 * 3.0
    assert tokenize_asks == [[], [], []]


async def test_a_configured_capacity_is_converted_with_the_learnt_ratio(
    vllm_like, tokenize_asks, router, client
) -> None:
    settings = router_settings(
        vllm_like,
        routing={"kv_capacity_tokens": 5000, "first_placement": "ring", "bytes_per_token": None},
        health={"interval_s": 0.05},
    )
    r = await router(settings)
    ledgers = r.app.picker.ledgers
    assert ledgers is not None
    a, b, c = vllm_like
    await eventually(lambda: ledgers.capacity(c) == 5000 * 4.0)
    await _until_each_answered(r, client, vllm_like)
    size = _key_bytes(settings)
    await eventually(
        lambda: ledgers.capacity(a) == 5000 * size / 50 and ledgers.capacity(b) == 5000 * size / 200
    )
    assert ledgers.capacity(c) == 5000 * 4.0


async def test_the_admin_listing_shows_what_first_placements_weigh(
    vllm_like, tokenize_asks, router, client
) -> None:
    settings = router_settings(
        vllm_like, routing={"first_placement": "ring", "bytes_per_token": None}, health={"interval_s": 0.05}
    )
    r = await router(settings)
    a, b, c = vllm_like
    await _until_each_answered(r, client, vllm_like)
    size = _key_bytes(settings)
    server, task, port = await start_side_app(r.app.admin_app, r.app.settings)
    try:

        async def listed() -> dict[str, Any]:
            answer = (await client.get(f"http://127.0.0.1:{port}/admin/backends")).json()
            return {s["url"]: (s["kv_capacity_bytes"], s["bytes_per_token"]) for s in answer["backends"]}

        expected = {
            a: (100 * 16 * size / 50, size / 50),
            b: (300 * 16 * size / 200, size / 200),
            c: ((100 * 16 * size / 50 + 300 * 16 * size / 200) / 2, 4.0),  # says nothing: the others' mean
        }
        await eventually_equal(listed, expected)
    finally:
        server.should_exit = True
        await task


# -- the probe alone, against one loopback /tokenize ------------------------------------------------------


@pytest.fixture
async def scripted_tokenize() -> AsyncIterator[tuple[str, list[int]]]:
    """A /tokenize answering, call after call, the statuses in `script` (200: a count of 10 tokens)."""
    script: list[int] = []

    async def tokenize(_: web.Request) -> web.Response:
        status = script.pop(0) if script else 200
        return web.json_response({"count": 10} if status == 200 else {"error": "x"}, status=status)

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = free_socket()
    await web.SockSite(runner, sock).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", script
    await runner.cleanup()


async def _probe(url: str, changed: list[str]) -> tuple[BytesPerTokenProbe, Upstream]:
    upstream = Upstream(UpstreamConfig())
    await upstream.start()
    probe = BytesPerTokenProbe(
        upstream, lambda: [url], changed.append, interval_s=0.0, timeout_s=5.0, clock=time.monotonic
    )
    return probe, upstream


@contextlib.asynccontextmanager
async def _running(probe: BytesPerTokenProbe, upstream: Upstream) -> AsyncIterator[asyncio.Task[None]]:
    """The probe's own task, as the router runs it; cancelled and the upstream closed at the end."""
    task = asyncio.get_running_loop().create_task(probe.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await upstream.close()


async def test_a_failed_answer_is_asked_again_at_the_next_prompt(scripted_tokenize) -> None:
    url, script = scripted_tokenize
    script.append(500)
    changed: list[str] = []
    probe, upstream = await _probe(url, changed)
    body = orjson.dumps(_chat(0))
    try:
        probe.offer(url, "/v1/chat/completions", body, 40)
        await probe.probe_pending()
        assert probe.ratio(url) is None and probe.wants(url), "busy is not 'no /tokenize'"
        probe.offer(url, "/v1/chat/completions", body, 40)
        await probe.probe_pending()
        assert probe.ratio(url) == 4.0 and changed == [url]
    finally:
        await upstream.close()


async def test_an_engine_without_tokenize_is_asked_again_a_minute_later(scripted_tokenize) -> None:
    url, script = scripted_tokenize
    script.append(404)
    probe, upstream = await _probe(url, [])
    try:
        probe.offer(url, "/v1/chat/completions", orjson.dumps(_chat(0)), 40)
        await probe.probe_pending()
        assert probe.ratio(url) is None and not probe.wants(url)
    finally:
        await upstream.close()


async def test_a_prompt_it_cannot_write_back_does_not_stop_the_learning(scripted_tokenize) -> None:
    # orjson reads JSON nested deeper than it writes: such a body is skipped, and the next one is learnt.
    url, _ = scripted_tokenize
    changed: list[str] = []
    probe, upstream = await _probe(url, changed)
    chat = orjson.dumps(_chat(0))
    body = chat[:-1] + b',"chat_template_kwargs":{"deep":' + b"[" * 300 + b"1" + b"]" * 300 + b"}}"
    assert orjson.loads(body)["messages"]
    async with _running(probe, upstream) as task:
        probe.offer(url, "/v1/chat/completions", body, 40)
        await asyncio.sleep(0.05)
        probe.offer(url, "/v1/chat/completions", orjson.dumps(_chat(0)), 40)
        await eventually(lambda: probe.ratio(url) == 4.0)
        assert not task.done()


async def test_an_error_in_one_probe_is_logged_and_the_task_lives_on(scripted_tokenize, caplog) -> None:
    url, _ = scripted_tokenize
    upstream = Upstream(UpstreamConfig())  # not started yet: its first fetch raises
    changed: list[str] = []
    probe = BytesPerTokenProbe(
        upstream, lambda: [url], changed.append, interval_s=0.0, timeout_s=5.0, clock=time.monotonic
    )
    async with _running(probe, upstream) as task:
        probe.offer(url, "/v1/chat/completions", orjson.dumps(_chat(0)), 40)
        await eventually(lambda: "failed" in caplog.text)
        await upstream.start()
        probe.offer(url, "/v1/chat/completions", orjson.dumps(_chat(0)), 40)
        await eventually(lambda: probe.ratio(url) == 4.0)
        assert not task.done()
