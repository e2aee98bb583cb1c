"""The Responses API's stateful calls through two router replicas that share nothing.

Each simulated backend keeps its responses in its own memory, as vLLM's response store does. A
follow-up (`previous_response_id`), a retrieve, a delete or a cancel that reaches another backend gets
its 404; through the router, every one reaches the backend that stored the response, whichever
replica took the first request and whichever takes the next, streaming included.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import openai
import orjson
from openai.types.responses import ResponseCompletedEvent

from prefix_router.fleet.backends import BackendSpec
from prefix_router.routing.response_ids import backend_tag, decode_id
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimBackend

from routerkit import RunningRouter, router_settings, start_router

FAST = SimConfig(overhead_ms=0.0, prefill_ms_per_token=0.0, itl_ms=0.0)
N = 12


@contextlib.asynccontextmanager
async def fleet_and_replicas(count: int = 3) -> AsyncIterator[tuple[list[SimBackend], list[RunningRouter]]]:
    async with contextlib.AsyncExitStack() as stack:
        backends = [await stack.enter_async_context(SimBackend(FAST)) for _ in range(count)]
        urls = [b.url for b in backends]
        routers = [await start_router(router_settings(order)) for order in (urls, urls[::-1])]
        try:
            yield backends, routers
        finally:
            for r in routers:
                await r.stop()


def sdk(r: RunningRouter) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0)


def storing_backend(backends: list[SimBackend], client_id: str) -> SimBackend:
    decoded = decode_id(client_id)
    assert decoded is not None, f"{client_id!r} is not an id the router made"
    (backend,) = [b for b in backends if backend_tag(b.url) == decoded[0]]
    assert decoded[1] in backend.server.responses
    return backend


async def test_follow_ups_and_retrieves_reach_the_storing_backend_through_either_replica() -> None:
    async with fleet_and_replicas() as (backends, routers):
        clients = [sdk(r) for r in routers]
        not_found = 0
        for i in range(N):
            first, second = clients[i % 2], clients[(i + 1) % 2]
            question = f"{i:03d} the first question of conversation {i}"
            made = await first.responses.create(model="sim-llama", input=question, max_output_tokens=2)
            home = storing_backend(backends, made.id)
            try:
                follow = await second.responses.create(
                    model="sim-llama", input=f"and a follow-up {i}", previous_response_id=made.id
                )
                assert follow.previous_response_id == made.id, "echoed as the client knows it"
                assert storing_backend(backends, follow.id) is home
                stream = await first.responses.create(
                    model="sim-llama", input=f"streamed {i}", previous_response_id=follow.id, stream=True
                )
                events = [e async for e in stream]
                ids = {e.response.id for e in events if e.type in ("response.created", "response.completed")}
                (streamed_id,) = ids
                assert storing_backend(backends, streamed_id) is home
                got = await second.responses.retrieve(streamed_id)
                assert got.id == streamed_id and got.previous_response_id == follow.id
                replay = [e async for e in await first.responses.retrieve(follow.id, stream=True)]
                assert isinstance(replay[-1], ResponseCompletedEvent) and replay[-1].response.id == follow.id
                await second.responses.delete(made.id)
            except openai.NotFoundError:
                not_found += 1
                continue
            try:
                await first.responses.retrieve(made.id)
                raise AssertionError("a deleted response was found")
            except openai.NotFoundError as exc:
                assert f"'{made.id}'" in str(exc), "the storing backend's 404 names the id the client knows"
        for c in clients:
            await c.close()
    assert not_found == 0, f"{not_found} of {N} conversations met a 404"


async def test_cancel_reaches_the_storing_backend() -> None:
    async with fleet_and_replicas() as (_, routers):
        clients = [sdk(r) for r in routers]
        for i in range(6):
            made = await clients[0].responses.create(model="sim-llama", input=f"{i} cancel me")
            # The storing backend has it and refuses, as vLLM does, to cancel a synchronous response;
            # any other backend would have answered 404.
            try:
                await clients[1].responses.cancel(made.id)
                raise AssertionError("cancel of a finished synchronous response succeeded")
            except openai.BadRequestError as exc:
                assert "Cannot cancel a synchronous response" in str(exc)
        for c in clients:
            await c.close()


async def test_without_the_routers_ids_follow_ups_meet_404s() -> None:
    """The control: the backends' own ids, as the router passed them on before, land by their new input."""
    async with fleet_and_replicas() as (_, routers), httpx.AsyncClient(timeout=30) as http:
        statuses = []
        for i in range(N):
            first = {"model": "sim-llama", "input": f"q{i}"}
            made = (await http.post(f"{routers[0].url}/v1/responses", json=first)).json()
            decoded = decode_id(made["id"])
            assert decoded is not None
            follow = {"model": "sim-llama", "input": f"follow {i}", "previous_response_id": decoded[1]}
            statuses.append((await http.post(f"{routers[1].url}/v1/responses", json=follow)).status_code)
    assert statuses.count(404) > 0


async def test_a_response_whose_backend_left_is_a_404_that_says_so() -> None:
    async with fleet_and_replicas(2) as (backends, routers), httpx.AsyncClient(timeout=30) as http:
        made = (
            await http.post(f"{routers[0].url}/v1/responses", json={"model": "sim-llama", "input": "x"})
        ).json()
        home = storing_backend(backends, made["id"])
        for r in routers:
            r.app.backends.replace_members([BackendSpec(b.url) for b in backends if b is not home])
        before = home.server.stats()["requests"]
        follow = {"model": "sim-llama", "input": "y", "previous_response_id": made["id"]}
        for r in routers:
            for method, path, body in [
                ("GET", f"/v1/responses/{made['id']}", None),
                ("POST", "/v1/responses", follow),
            ]:
                resp = await http.request(method, f"{r.url}{path}", json=body)
                assert resp.status_code == 404
                error = resp.json()["error"]
                assert error["code"] == "response_not_found"
                assert "no longer in the fleet" in error["message"] and made["id"] in error["message"]
        assert home.server.stats()["requests"] == before


async def test_only_response_ids_are_rewritten_and_json_lengths_stay_right() -> None:
    async with fleet_and_replicas(1) as (_, routers), httpx.AsyncClient(timeout=30) as http:
        ask = {"model": "sim-llama", "input": "x", "max_output_tokens": 2}
        resp = await http.post(f"{routers[0].url}/v1/responses", json=ask)
        assert int(resp.headers["content-length"]) == len(resp.content)
        doc = orjson.loads(resp.content)
        assert decode_id(doc["id"]) is not None
        assert doc["output"][0]["id"].startswith("msg_"), "item ids are the backend's own"
        chat = await http.post(
            f"{routers[0].url}/v1/chat/completions",
            json={"model": "sim-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        )
        assert chat.json()["id"].startswith("chatcmpl-")
