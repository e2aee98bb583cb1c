"""What one replica cannot see alone, seen through the shared store by real routers: a prefill another
router started (the request waits for its first byte, as one router holds back its own), and the
requests other routers have in flight on a backend (the follow limit counts them). A Redis killed
while a request waits for another router's prefill lets it go at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import orjson
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from prefix_router.fleet.shared_state import NAMESPACE, SharedPlacement
from prefix_router.routing.config import KeyConfig
from prefix_router.routing.keys import block_sizes, extract_key
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.shared_view import ClaimRequest, Takeover

from loopback import eventually_equal
from redisserver import RedisServer
from routerkit import RunningRouter, eventually, router_settings

CHAT = "/v1/chat/completions"
BACKEND_HEADER = "x-prefix-router-backend"
SYSTEM = "a long system prompt shared by one group of requests " * 40


async def _routers(
    router: Any, backends: list[Any], url: str, n: int, **sections: Any
) -> list[RunningRouter]:
    routing = {"shared_state_url": url, "shared_state_timeout_s": 2.0, **sections.pop("routing", {})}
    routers = [await router(router_settings(backends, routing=routing, **sections)) for _ in range(n)]
    for r in routers:
        shared = r.app.shared
        assert shared is not None
        await eventually(lambda shared=shared: shared.up and shared.can_wait)  # type: ignore[misc]
    return routers


def _body(question: str, stream: bool) -> dict[str, object]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": "m", "stream": stream, "messages": messages}


async def _stream(s: aiohttp.ClientSession, r: RunningRouter, question: str) -> str:
    async with s.post(f"{r.url}/stream?n=2", json=_body(question, True)) as resp:
        assert resp.status == 200
        await resp.read()
        return resp.headers[BACKEND_HEADER]


async def _second_held(
    s: aiohttp.ClientSession, backends: list[Any], first_router: RunningRouter, second_router: RunningRouter
) -> tuple[asyncio.Task[str], asyncio.Task[str]]:
    """A stream through the first router, then one for the same prefix through the second, which
    is held while the first one prefills."""
    first = asyncio.create_task(_stream(s, first_router, "first question"))
    await eventually(lambda: sum(len(b.seen) for b in backends) == 1)
    second = asyncio.create_task(_stream(s, second_router, "second question"))
    await asyncio.sleep(0.2)
    assert sum(len(b.seen) for b in backends) == 1, "held while the other router's request prefills"
    return first, second


def _sample(r: RunningRouter, name: str, labels: dict[str, str]) -> float:
    return r.app.registry.get_sample_value(name, labels) or 0.0


async def test_a_stream_waits_for_the_prefill_another_router_started_of_its_prefix(
    fake_backends: Any, router: Any, redis_server: RedisServer
) -> None:
    backends = await fake_backends(4)
    for b in backends:
        b.first_chunk_delay_s = 0.5  # a prefill
    first_router, second_router = await _routers(router, backends, redis_server.url, 2)

    async with aiohttp.ClientSession() as s:
        first, second = await _second_held(s, backends, first_router, second_router)
        home1, home2 = await asyncio.gather(first, second)
    assert home1 == home2
    home = next(b for b in backends if b.url == home1)
    assert home.seen[1].at >= home.first_chunk_at[0], "sent after the first one's first byte"
    ready = {"outcome": "ready"}
    assert _sample(second_router, "prefix_router_prefill_waits_total", ready) == 1
    assert _sample(first_router, "prefix_router_prefill_waits_total", ready) == 0


async def test_the_follow_limit_counts_the_requests_other_routers_have_in_flight(
    fake_backends: Any, router: Any, client: httpx.AsyncClient, redis_server: RedisServer
) -> None:
    backends = await fake_backends(3)
    gate = asyncio.Event()
    for b in backends:
        b.gate = gate  # requests stay in flight until the gate opens
    routers = await _routers(router, backends, redis_server.url, 3, balancing={"max_inflight": 2})

    async def send(r: RunningRouter, body: dict[str, object]) -> str:
        resp = await client.post(
            r.url + CHAT, content=orjson.dumps(body), headers={"content-type": "application/json"}
        )
        assert resp.status_code == 200, resp.text
        return resp.headers[BACKEND_HEADER]

    held = [asyncio.create_task(send(routers[i], _body(f"question {i}", False))) for i in range(2)]
    await eventually(lambda: sum(len(b.seen) for b in backends) == 2)
    owner = next(b for b in backends if b.seen).url
    assert sum(len(b.seen) for b in backends if b.url == owner) == 2  # the second router followed
    # The third router has nothing in flight itself; what the store says of the others decides.
    third = asyncio.create_task(send(routers[2], _body("question 2", False)))
    await eventually(lambda: sum(len(b.seen) for b in backends) == 3)
    assert sum(len(b.seen) for b in backends if b.url == owner) == 2, "the owner is at max_inflight"
    gate.set()
    homes = await asyncio.gather(*held, third)
    assert homes[:2] == [owner, owner] and homes[2] != owner


async def test_redis_killed_while_a_request_waits_for_another_routers_prefill_lets_it_go(
    fake_backends: Any, router: Any, redis_server: RedisServer
) -> None:
    backends = await fake_backends(3)
    for b in backends:
        b.first_chunk_delay_s = 3.0  # a long prefill: the wait would last until its first byte
    first_router, second_router = await _routers(
        router, backends, redis_server.url, 2, routing={"prefill_wait_s": 30.0}
    )

    async with aiohttp.ClientSession() as s:
        first, second = await _second_held(s, backends, first_router, second_router)
        redis_server.kill()
        # Nobody can say when that prefill ends now: the request is sent at once, and answered.
        await eventually(lambda: sum(len(b.seen) for b in backends) == 2, timeout_s=2.5)
        assert not any(b.first_chunk_at for b in backends), "sent before the first one's first byte"
        await asyncio.gather(first, second)
    assert not second_router.app.shared or not second_router.app.shared.can_wait
    # And the next requests route from local state, with the other routers' counts forgotten.
    third = _body("third question", False)
    async with aiohttp.ClientSession() as s, s.post(f"{second_router.url}{CHAT}", json=third) as resp:
        assert resp.status == 200
    assert second_router.app.backends.load.total_load() == 0


async def test_requests_held_for_another_routers_prefill_are_counted_where_they_will_go(
    fake_backends: Any, router: Any, redis_server: RedisServer
) -> None:
    """A request held for the prefill a router started is counted on that backend while it waits:
    when the prefill ends every waiter of every router goes at once, and a third router must not
    have sent one more there. With max_inflight 2, the third router's request goes elsewhere at
    once, and the backend stays within its bound."""
    backends = await fake_backends(3)
    for b in backends:
        b.first_chunk_delay_s = 0.5  # a prefill
    routers = await _routers(router, backends, redis_server.url, 3, balancing={"max_inflight": 2})

    async def stream(r: RunningRouter, question: str) -> str:
        # Streams on for a second after the first event: still in flight when the waiters go.
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{r.url}/stream?n=10&delay=0.1", json=_body(question, True)) as resp,
        ):
            assert resp.status == 200
            await resp.read()
            return resp.headers[BACKEND_HEADER]

    first = asyncio.create_task(stream(routers[0], "first question"))
    await eventually(lambda: sum(len(b.seen) for b in backends) == 1)
    owner = next(b for b in backends if b.seen)
    held = asyncio.create_task(stream(routers[1], "question 1"))
    await asyncio.sleep(0.1)  # past the time its router's counts are written again
    assert sum(len(b.seen) for b in backends) == 1, "held while the first one prefills"
    third = asyncio.create_task(stream(routers[2], "question 2"))
    await eventually(lambda: sum(len(b.seen) for b in backends) == 2)
    assert len(owner.seen) == 1, "the third went elsewhere at once: the owner is full with the one held"
    homes = await asyncio.gather(first, held, third)
    assert list(homes[:2]) == [owner.url, owner.url] and homes[2] != owner.url
    assert max(b.peak_active for b in backends) <= 2


async def test_a_request_held_for_a_prefill_is_placed_on_the_fleet_as_it_stands_when_the_prefill_ends(
    fake_backends: Any, router: Any, redis_server: RedisServer
) -> None:
    """Every replica's waiters go at once when a prefill ends, where it ran (which may not be the
    owner their claims named: its own request may have moved). They must be placed on the fleet's
    counts of that moment, not on the ones their claims saw before the wait: here another replica
    filled that backend to max_inflight meanwhile, and the held request goes elsewhere."""
    backends = await fake_backends(3)
    owner, prefilled_on = backends[0].url, backends[1].url
    (held_router,) = await _routers(router, backends, redis_server.url, 1, balancing={"max_inflight": 2})
    held_shared = held_router.app.shared
    assert held_shared is not None
    # Two other replicas, as the store sees them: one prefilling the prefix, one with requests in flight.
    prefilling = SharedPlacement(redis_server.url, 2.0, CollectorRegistry(), prefill_wait_s=5.0)
    busy_load = LoadTracker()
    busy = SharedPlacement(redis_server.url, 2.0, CollectorRegistry(), load=busy_load)
    async with _stand_ins(redis_server.url, prefilling, busy) as raw:
        # The key the router takes of a body sent to _stream's path: its first bytes, canonicalised.
        key = extract_key("/stream", orjson.dumps(_body("first question", True)), None, KeyConfig())
        blocks = key.blocks
        first = ClaimRequest(
            blocks, block_sizes(key.ends)[: len(blocks)], "1" * len(blocks), owner, 1e12, (), "other:1"
        )
        assert (await prefilling.claim(first)) is not None  # owner, prefill pending under other:1
        async with aiohttp.ClientSession() as s:
            held = asyncio.create_task(_stream(s, held_router, "second question"))
            ld = f"{NAMESPACE}ld:{held_shared.replica}"
            await eventually_equal(lambda: _hget(raw, ld, owner), "1")  # held, counted on the owner
            assert sum(len(b.seen) for b in backends) == 0
            # Meanwhile the other replica fills the backend the prefill will end on.
            for _ in range(2):
                busy_load.acquire(prefilled_on)
            assert (await busy.claim(ClaimRequest((99,), (100,), "1", backends[2].url, 1e12, ()))) is not None
            # The prefill's request went there instead of the owner, and its prefill ended there.
            prefilling.take_over(Takeover(owner, prefilled_on, 0), first, 1e12)
            await eventually_equal(lambda: _hget(raw, f"{NAMESPACE}o:{blocks[0]}", None), prefilled_on)
            prefilling.prefilled("other:1", first, prefilled_on)
            home = await held
        assert home != prefilled_on, "the backend the prefill ended on is at max_inflight by now"


@contextlib.asynccontextmanager
async def _stand_ins(url: str, *placements: SharedPlacement) -> AsyncIterator[Redis]:
    """Other replicas as the store sees them, up and running in the background for the block, and a
    raw connection to the store; all ended and closed after it."""
    raw = Redis.from_url(url, decode_responses=True)
    tasks = [asyncio.create_task(shared.run()) for shared in placements]
    try:
        await eventually(lambda: all(shared.up for shared in placements))
        yield raw
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for shared in placements:
            await shared.close()
        await raw.aclose()


async def _hget(raw: Redis, key: str, field: str | None) -> str | None:
    value = await (raw.get(key) if field is None else raw.hget(key, field))
    return value.decode() if isinstance(value, bytes) else value


async def test_the_requests_every_replica_holds_for_a_prefill_count_where_it_ended(
    fake_backends: Any, router: Any, redis_server: RedisServer
) -> None:
    """The waiters of every replica go at once when a prefill ends. Where it ended elsewhere than the
    owner their claims named (its own request moved), they were counted on that owner while held: the
    end must count the other replicas' waiters where they now go, or each replica admits its own as if
    it were the only one, past max_inflight. Here one other replica has three requests in flight
    there and another holds one for the same prefill: with max_inflight 4 that backend is full."""
    backends = await fake_backends(3)
    owner, prefilled_on = backends[0].url, backends[1].url
    (held_router,) = await _routers(router, backends, redis_server.url, 1, balancing={"max_inflight": 4})
    held_shared = held_router.app.shared
    assert held_shared is not None
    prefilling = SharedPlacement(redis_server.url, 2.0, CollectorRegistry(), prefill_wait_s=5.0)
    holding = SharedPlacement(redis_server.url, 2.0, CollectorRegistry(), prefill_wait_s=5.0)
    busy_load = LoadTracker()
    busy = SharedPlacement(redis_server.url, 2.0, CollectorRegistry(), load=busy_load)
    async with _stand_ins(redis_server.url, prefilling, holding, busy) as raw:
        key = extract_key("/stream", orjson.dumps(_body("first question", True)), None, KeyConfig())
        blocks, sizes = key.blocks, block_sizes(key.ends)[: len(key.blocks)]
        first = ClaimRequest(blocks, sizes, "1" * len(blocks), owner, 1e12, (), "other:1")
        assert (await prefilling.claim(first)) is not None  # owner, prefill pending under other:1
        # Another replica holds a request for that prefill: counted on the owner meanwhile.
        waits = await holding.claim(ClaimRequest(blocks, sizes, "1" * len(blocks), owner, 1e12, (), "", True))
        assert waits is not None and waits.wait_for == "other:1"
        holding.waiting_on(owner, 1)
        for _ in range(3):
            busy_load.acquire(prefilled_on)
        assert (await busy.claim(ClaimRequest((99,), (100,), "1", backends[2].url, 1e12, ()))) is not None
        async with aiohttp.ClientSession() as s:
            held = asyncio.create_task(_stream(s, held_router, "second question"))
            ld = f"{NAMESPACE}ld:{held_shared.replica}"
            await eventually_equal(lambda: _hget(raw, ld, owner), "1")  # held, counted on the owner
            assert sum(len(b.seen) for b in backends) == 0
            prefilling.take_over(Takeover(owner, prefilled_on, 0), first, 1e12)
            await eventually_equal(lambda: _hget(raw, f"{NAMESPACE}o:{blocks[0]}", None), prefilled_on)
            prefilling.prefilled("other:1", first, prefilled_on)
            home = await held
        assert home != prefilled_on, "three in flight there and the other replica's waiter going there: full"
