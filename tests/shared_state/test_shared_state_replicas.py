"""Three routers in front of the same fake backends, with one real redis-server between them:
conversations and system-prompt groups sent round robin over the routers stay on one backend, and
a Redis killed mid-run costs no request; when it comes back on its port, routing uses it again."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import orjson
from redis.asyncio import Redis

from prefix_router.routing.picker import Branch

from loopback import eventually_equal
from redisserver import RedisServer
from routerkit import RunningRouter, eventually, router_settings

CHAT = "/v1/chat/completions"
BACKEND_HEADER = "x-prefix-router-backend"


def _system(family: int, chars: int) -> str:
    text = f"System prompt {family}: you answer questions about topic {family * 7919 % 1000}. "
    return (text * (chars // len(text) + 1))[:chars]


async def _routers(
    router: Any, backends: list[Any], url: str, n: int = 3, **routing_settings: Any
) -> list[RunningRouter]:
    # A generous timeout: a loaded test machine must not turn a slow reply into a local decision.
    routing = {"shared_state_url": url, "shared_state_timeout_s": 2.0, **routing_settings}
    routers = [await router(router_settings(backends, routing=routing)) for _ in range(n)]
    for r in routers:
        assert r.app.shared is not None
        shared = r.app.shared
        await eventually(lambda shared=shared: shared.up)  # type: ignore[misc]
    return routers


async def _send(client: httpx.AsyncClient, r: RunningRouter, messages: list[dict[str, str]]) -> str:
    body = orjson.dumps({"model": "m", "messages": messages})
    resp = await client.post(r.url + CHAT, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    return resp.headers[BACKEND_HEADER]


async def _pins_left(probe: Redis) -> list[str]:
    return [key async for key in probe.scan_iter(match="prefix_router:pin:*")]


def _sample(r: RunningRouter, name: str, labels: dict[str, str] | None = None) -> float:
    return r.app.registry.get_sample_value(name, labels or {}) or 0.0


async def test_a_conversation_sent_round_robin_over_three_routers_stays_on_one_backend(
    fake_backends: Any, router: Any, client: httpx.AsyncClient, redis_server: RedisServer
) -> None:
    backends = await fake_backends(4)
    routers = await _routers(router, backends, redis_server.url)
    moved = 0
    homes = []
    for conv in range(8):
        messages = [{"role": "system", "content": _system(conv, 1000)}]
        seen = []
        for turn in range(6):
            messages.append({"role": "user", "content": f"conversation {conv}, question {turn}?"})
            seen.append(await _send(client, routers[(conv + turn) % 3], messages))
            messages.append({"role": "assistant", "content": f"answer {turn} of {conv}. " * 20})
        moved += sum(a != b for a, b in itertools.pairwise(seen))
        homes.append(seen[0])
    assert moved == 0
    assert len(set(homes)) > 1  # the conversations spread: agreement on one backend proves nothing
    match = {"branch": Branch.PREFIX_MATCH.value}
    followed = sum(_sample(r, "prefix_router_decisions_total", match) for r in routers)
    assert followed >= 8 * 5


async def test_groups_sharing_a_system_prompt_stay_on_one_backend_across_routers(
    fake_backends: Any, router: Any, client: httpx.AsyncClient, redis_server: RedisServer
) -> None:
    backends = await fake_backends(4)
    routers = await _routers(router, backends, redis_server.url)
    placements: dict[int, set[str]] = {}
    for i in range(60):
        group = i % 10
        messages = [
            {"role": "system", "content": _system(group, 2000)},
            {"role": "user", "content": f"one-shot question {i}"},
        ]
        placements.setdefault(group, set()).add(await _send(client, routers[i % 3], messages))
    assert all(len(where) == 1 for where in placements.values()), placements
    assert len(set.union(*placements.values())) > 1
    # One round trip a request: one script call each (a router's first also loads the script; the
    # commands the scripts run are counted under their own names). Besides, calls no request waits
    # for: take-overs, in-flight counts no claim carried, pins let go of; counted as they are sent,
    # so the figures agree once the last has landed.
    probe = Redis.from_url(redis_server.url, decode_responses=True)

    async def awaited_calls() -> int:
        evalsha = (await probe.info("commandstats"))["cmdstat_evalsha"]
        background = sum(r.app.shared.background_calls for r in routers if r.app.shared is not None)
        return int(evalsha["calls"] - evalsha["failed_calls"] - background)

    try:
        # Every request ended lets go of the blocks its claim pinned where it went.
        await eventually_equal(lambda: _pins_left(probe), [])
        await eventually_equal(awaited_calls, 60)
    finally:
        await probe.aclose()


async def test_redis_killed_mid_run_costs_no_request_and_is_used_again_when_back(
    fake_backends: Any, router: Any, client: httpx.AsyncClient, redis_server: RedisServer
) -> None:
    backends = await fake_backends(3)
    routers = await _routers(router, backends, redis_server.url)

    async def groups(first: int, count: int) -> dict[int, set[str]]:
        placed: dict[int, set[str]] = {}
        for i in range(count * 3):
            group = first + i % count
            messages = [
                {"role": "system", "content": _system(group, 2000)},
                {"role": "user", "content": f"question {i}"},
            ]
            placed.setdefault(group, set()).add(await _send(client, routers[i % 3], messages))
        return placed

    await groups(0, 4)
    redis_server.kill()
    await groups(100, 6)  # every one answered 200 (_send asserts it), from local state
    errors = sum(
        _sample(r, "prefix_router_shared_state_errors_total", {"reason": "connection"}) for r in routers
    )
    assert errors >= 1
    assert all(_sample(r, "prefix_router_shared_state_up") == 0 for r in routers if r.app.shared)
    redis_server.start()  # a new, empty server on the same port
    for r in routers:
        shared = r.app.shared
        assert shared is not None
        await eventually(lambda shared=shared: shared.up, timeout_s=10)  # type: ignore[misc]
    assert all(_sample(r, "prefix_router_shared_state_up") == 1 for r in routers)
    after = await groups(200, 6)
    assert all(len(where) == 1 for where in after.values()), after
    probe = Redis.from_url(redis_server.url)
    try:
        assert await probe.dbsize() > 0  # the new groups were claimed in the new server
    finally:
        await probe.aclose()


async def test_a_backend_one_router_cannot_use_hands_its_prefixes_to_where_that_router_sent_them(
    fake_backends: Any, router: Any, client: httpx.AsyncClient, redis_server: RedisServer
) -> None:
    backends = await fake_backends(3)
    first, second = await _routers(router, backends, redis_server.url, n=2)

    def group(i: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": _system(1, 2000)}, {"role": "user", "content": f"question {i}"}]

    owner = await _send(client, first, group(0))
    assert second.app.backends.drain(owner)  # the second router may no longer send there
    moved = await _send(client, second, group(1))
    assert moved != owner
    # The take-over is written in the background; then the first router, which could still use the
    # old owner, follows the prefix to where it went.
    for i in range(2, 200):
        if await _send(client, first, group(i)) == moved:
            break
        assert i < 50, "the first router never followed the take-over"


async def test_chats_opened_by_a_short_question_stay_on_one_backend_across_routers(
    fake_backends: Any, router: Any, client: httpx.AsyncClient, redis_server: RedisServer
) -> None:
    """No system prompt and a first question shorter than the key's first block: no block of it is
    claimed in the store, only who took it is noted there. Each turn goes through another router than
    the one before, and the turns of the other chats, interleaved, change what each cache holds."""
    backends = await fake_backends(8)
    routers = await _routers(router, backends, redis_server.url, kv_capacity_tokens=4096)
    chats: list[list[dict[str, str]]] = [[] for _ in range(12)]
    homes: list[list[str]] = [[] for _ in chats]
    for turn in range(4):
        for conv, messages in enumerate(chats):
            messages.append({"role": "user", "content": f"Hi, question {turn} of chat {conv}?"})
            homes[conv].append(await _send(client, routers[(conv + turn) % 3], messages))
            messages.append({"role": "assistant", "content": f"Answer {turn} of chat {conv}. " * 20})
    moved = {conv: seen for conv, seen in enumerate(homes) if len(set(seen)) > 1}
    assert not moved, f"conversations moved between backends: {moved}"
    assert len({seen[0] for seen in homes}) > 1  # they spread: agreement on one backend proves nothing


async def test_turns_longer_than_their_history_stay_on_one_backend_across_routers(
    fake_backends: Any, router: Any, client: httpx.AsyncClient, redis_server: RedisServer
) -> None:
    """Every conversation starts with one system prompt, and each turn brings more new text than its
    history holds (a document pasted in, a tool's long output), so no history covers half of its next
    request. The history is still that conversation's own: one router follows it, and so must the
    router that gets the next turn when another placed the last one."""
    backends = await fake_backends(4)
    routers = await _routers(router, backends, redis_server.url)
    system = _system(0, 600)
    homes: list[list[str]] = []
    for conv in range(8):
        messages = [{"role": "system", "content": system}]
        seen = []
        for turn in range(3):
            document = _system(100 + conv, 2000 * 3**turn)
            pasted = f"Conversation {conv}, turn {turn}, a document to read: {document}"
            messages.append({"role": "user", "content": pasted})
            seen.append(await _send(client, routers[(conv + turn) % 3], messages))
            messages.append({"role": "assistant", "content": f"answer {turn} of {conv}. " * 20})
        homes.append(seen)
    moved = {conv: seen for conv, seen in enumerate(homes) if len(set(seen)) > 1}
    assert not moved, f"conversations moved between backends: {moved}"
    assert len({seen[0] for seen in homes}) > 1  # they spread: a shared system prompt herds none
