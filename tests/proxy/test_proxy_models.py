"""A fleet serving several models and an adapter, behind a real router: each request reaches only
backends serving its model, `/v1/models` is the fleet's union, a model nobody serves is the router's 404.
Simulated vLLM backends on loopback ports; the router learns what they serve from their /v1/models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from prefix_router.fleet.backends import BackendSpec
from prefix_router.router import create_app
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimBackend

from fakebackend import FakeBackend
from routerkit import RunningRouter, eventually, router_settings, start_router

FAST: dict[str, Any] = {"overhead_ms": 0.0, "prefill_ms_per_token": 0.0, "itl_ms": 0.0}
LLAMA, OTHER, LORA = "sim-llama", "other-llama", "sql-lora"
CHAT = "/v1/chat/completions"


@contextlib.asynccontextmanager
async def sims(*configs: SimConfig) -> AsyncIterator[list[SimBackend]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(SimBackend(c)) for c in configs]


def two_model_fleet() -> contextlib.AbstractAsyncContextManager[list[SimBackend]]:
    return sims(
        SimConfig(model=LLAMA, **FAST),
        SimConfig(model=LLAMA, adapters=(LORA,), **FAST),
        SimConfig(model=OTHER, **FAST),
    )


async def model_router(backends: list[SimBackend], **models: Any) -> RunningRouter:
    r = await start_router(router_settings([b.url for b in backends], models={"probe": True, **models}))
    await eventually(lambda: all(r.app.models.has_report(b.url) for b in backends))
    return r


def chat(model: str, i: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"{i:04d} question {i}"}]
    return {"model": model, "messages": messages, "max_tokens": 1}


async def send_mix(client: httpx.AsyncClient, base: str, n: int) -> list[tuple[str, int]]:
    out = []
    for i in range(n):
        model = (LLAMA, OTHER, LORA)[i % 3]
        resp = await client.post(f"{base}{CHAT}", json=chat(model, i))
        out.append((model, resp.status_code))
    return out


async def test_every_request_reaches_a_backend_serving_its_model() -> None:
    async with two_model_fleet() as fleet, httpx.AsyncClient(timeout=30) as client:
        r = await model_router(fleet)
        try:
            answered = await send_mix(client, r.url, 60)
        finally:
            await r.stop()
        assert [s for _, s in answered] == [200] * 60, "no backend answered 404 for a model it lacks"
        requests = [b.server.stats()["requests"] for b in fleet]
        assert requests[2] == 20, "other-llama went to its one backend, and nothing else did"
        assert requests[0] + requests[1] == 40 and requests[0] > 0, "sim-llama spread over its two"
        assert requests[1] >= 20, "the adapter went only where it is loaded"


async def test_without_model_routing_the_same_load_meets_backend_404s() -> None:
    """The control for the test above: the router as it was, model-blind, on the same fleet."""
    async with two_model_fleet() as fleet, httpx.AsyncClient(timeout=30) as client:
        r = await start_router(router_settings([b.url for b in fleet]))  # models.probe off
        try:
            answered = await send_mix(client, r.url, 60)
        finally:
            await r.stop()
    assert sum(1 for _, s in answered if s == 404) > 0


async def test_models_is_the_deduplicated_union_and_unknown_models_are_the_routers_404() -> None:
    async with two_model_fleet() as fleet, httpx.AsyncClient(timeout=30) as client:
        r = await model_router(fleet)
        try:
            listing = (await client.get(f"{r.url}/v1/models")).json()
            before = [b.server.stats()["requests"] for b in fleet]
            missing = await client.post(f"{r.url}{CHAT}", json=chat("gpt-4o", 0))
            responses = await client.post(f"{r.url}/v1/responses", json={"model": "gpt-4o", "input": "x"})
            after = [b.server.stats()["requests"] for b in fleet]
        finally:
            await r.stop()
    assert listing["object"] == "list"
    assert sorted(m["id"] for m in listing["data"]) == [OTHER, LLAMA, LORA]
    assert next(m for m in listing["data"] if m["id"] == LORA)["parent"] == LLAMA
    for resp in (missing, responses):
        assert resp.status_code == 404
        error = resp.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "model_not_found")
        assert "gpt-4o" in error["message"]
    assert before == after, "no backend saw the request"


async def test_one_model_is_retrieved_from_the_fleets_listing() -> None:
    async with two_model_fleet() as fleet, httpx.AsyncClient(timeout=30) as client:
        r = await model_router(fleet)
        try:
            found = await client.get(f"{r.url}/v1/models/{LORA}")
            missing = await client.get(f"{r.url}/v1/models/gpt-4o")
        finally:
            await r.stop()
    assert found.status_code == 200 and found.json()["id"] == LORA and found.json()["parent"] == LLAMA
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_an_unloaded_adapter_goes_to_its_base_only_when_configured() -> None:
    async with sims(SimConfig(model=LLAMA, **FAST)) as fleet, httpx.AsyncClient(timeout=30) as client:
        r = await model_router(fleet)
        try:
            refused = await client.post(f"{r.url}{CHAT}", json=chat("new-lora", 0))
        finally:
            await r.stop()
        r = await model_router(fleet, adapters_to_base=True)
        try:
            forwarded = await client.post(f"{r.url}{CHAT}", json=chat("new-lora", 0))
        finally:
            await r.stop()
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    # Sent on to the base model's backend; this one (like vLLM without runtime LoRA loading) has no
    # such adapter, and says so itself.
    assert forwarded.status_code == 404 and forwarded.json()["error"]["type"] == "NotFoundError"
    assert fleet[0].server.stats()["requests"] == 0, "refused before scheduling"


async def test_a_backend_that_joins_is_asked_what_it_serves_at_once() -> None:
    async with two_model_fleet() as fleet, httpx.AsyncClient(timeout=30) as client:
        r = await model_router(fleet[:2])  # health probes an hour apart: only the join can ask
        try:
            before = await client.post(f"{r.url}{CHAT}", json=chat(OTHER, 0))
            r.app.backends.replace_members([BackendSpec(b.url) for b in fleet])
            await eventually(lambda: r.app.models.has_report(fleet[2].url))
            after = await client.post(f"{r.url}{CHAT}", json=chat(OTHER, 0))
        finally:
            await r.stop()
    assert before.status_code == 404 and before.json()["error"]["code"] == "model_not_found"
    assert after.status_code == 200


@pytest.mark.parametrize("probe", [False, True])
async def test_static_backends_may_declare_their_models(probe: bool) -> None:
    """Fake backends list no models (they echo every path): what the config declares is what they serve."""
    backends = [FakeBackend("a"), FakeBackend("b")]
    for backend in backends:
        await backend.start()
    settings = router_settings(backends, models={"probe": probe})
    declared = zip(settings.backends, ("m1", "m2"), strict=True)
    settings = settings.model_copy(
        update={"backends": tuple(b.model_copy(update={"models": (m,)}) for b, m in declared)}
    )
    r = await start_router(settings)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(8):
                resp = await client.post(f"{r.url}{CHAT}", json=chat("m2", i))
                assert resp.headers["x-fake-backend"] == "b"
            assert (await client.post(f"{r.url}{CHAT}", json=chat("m3", 0))).status_code == 404
            listing = (await client.get(f"{r.url}/v1/models")).json()
    finally:
        await r.stop()
        for backend in backends:
            await backend.stop()
    assert sorted(m["id"] for m in listing["data"]) == ["m1", "m2"]


async def test_the_admin_listing_says_what_each_backend_serves() -> None:
    async with two_model_fleet() as fleet:
        urls = [b.url for b in fleet]
        r = await model_router(fleet)
        try:
            transport = httpx.ASGITransport(app=r.app.admin_app)
            async with httpx.AsyncClient(transport=transport, base_url="http://admin") as admin:
                listing = (await admin.get("/admin/backends")).json()
        finally:
            await r.stop()
    served = {b["url"]: b["models"] for b in listing["backends"]}
    assert served == {urls[0]: [LLAMA], urls[1]: [LLAMA, LORA], urls[2]: [OTHER]}


async def test_the_router_knows_the_models_before_it_takes_a_request() -> None:
    async with two_model_fleet() as fleet:
        app = create_app(router_settings([b.url for b in fleet], models={"probe": True}))
        await app.start()  # the listener opens after this returns
        try:
            known = [app.models.has_report(b.url) for b in fleet]
            await asyncio.sleep(0)  # let the background tasks start, so stop() cancels them running
        finally:
            await app.stop()
    assert known == [True, True, True]


async def test_metrics_and_the_access_log_name_the_model_but_only_one_the_fleet_serves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Per-model counts for operators, without a client's made-up model names as label values."""
    caplog.set_level(logging.INFO, logger="prefix_router.access")
    async with two_model_fleet() as fleet, httpx.AsyncClient(timeout=30) as client:
        r = await start_router(
            router_settings([b.url for b in fleet], models={"probe": True}, server={"access_log": True})
        )
        await eventually(lambda: all(r.app.models.has_report(b.url) for b in fleet))
        try:
            answered = await send_mix(client, r.url, 9)
            invented = [await client.post(f"{r.url}{CHAT}", json=chat(f"made-up-{i}", i)) for i in range(3)]
        finally:
            await r.stop()
    assert [s for _, s in answered] == [200] * 9
    assert [resp.status_code for resp in invented] == [404] * 3

    def count(model: str, klass: str) -> float | None:
        labels = {"model": model, "status_class": klass}
        return r.app.registry.get_sample_value("prefix_router_model_requests_total", labels)

    assert (count(LLAMA, "2xx"), count(OTHER, "2xx"), count(LORA, "2xx")) == (3.0, 3.0, 3.0)
    assert count(LLAMA, "5xx") == 0.0, "a model's series stand at 0 from its first answer"
    assert count("none", "4xx") == 3.0, "a model nobody serves is counted as none"
    labelled = {
        s.labels["model"]
        for metric in r.app.registry.collect()
        if metric.name == "prefix_router_model_requests"
        for s in metric.samples
    }
    assert labelled == {LLAMA, OTHER, LORA, "none"}, "no label value a client invented"
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "prefix_router.access"]
    chats = [line for line in lines if line["path"] == CHAT]
    assert [line["model"] for line in chats] == [m for m, _ in answered] + [None] * 3
