"""Several router replicas agree on placement without sharing any state.

Each replica builds its ring from the same member set (whatever order discovery or the config lists
it in) with the same fixed-seed hash, so a key's first choice is the same everywhere. These tests
check it twice: on the pickers directly (100k keys, exact agreement) and over HTTP, through three
real routers in front of the same fake backends.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
from typing import Any

import aiohttp
import orjson

from prefix_router.router import RouterApp, create_app
from prefix_router.routing.keys import RoutingKey, extract_key
from prefix_router.routing.picker import Branch
from prefix_router.routing.preamble_heat import HOT_MIN_REQUESTS

from routerkit import router_settings

CHAT = "/v1/chat/completions"
BACKEND_HEADER = "x-prefix-router-backend"


def _orders(urls: list[str]) -> list[list[str]]:
    """Three different listings of the same member set: as given, reversed, shuffled."""
    shuffled = list(urls)
    random.Random(7).shuffle(shuffled)
    if shuffled in (urls, urls[::-1]):
        shuffled = urls[1:] + urls[:1]
    return [list(urls), urls[::-1], shuffled]


def _body(i: int, *, model: str = "m") -> bytes:
    # Distinct from the first byte on, so no two prompts share a prefix-index block.
    prompt = f"{i:06d} {i * 2654435761 % 2**32:08x} a question about item {i}"
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": prompt}]})


def _decisions(app: RouterApp, branch: Branch) -> float:
    value = app.registry.get_sample_value("prefix_router_decisions_total", {"branch": branch.value})
    return value or 0.0


def test_three_rings_and_pickers_agree_on_100k_keys() -> None:
    urls = [f"http://10.0.0.{i}:8000" for i in range(1, 7)]
    apps = [create_app(router_settings(order)) for order in _orders(urls)]
    assert len({tuple(app.backends.ring.members) for app in apps}) == 1
    rings = [app.backends.ring for app in apps]
    # The rings, on 100k key hashes spread over the whole 64-bit space: the first choice and the
    # start of the walk (what overflow follows).
    rng = random.Random(11)
    disagreements = 0
    for _ in range(100_000):
        h = rng.getrandbits(64)
        if len({tuple(itertools.islice(ring.walk(h), 3)) for ring in rings}) != 1:
            disagreements += 1
    assert disagreements == 0
    # The pickers, on keys built from request bodies as the proxy builds them (models and tenants mixed
    # in): the whole decision, branch included.
    key_config = apps[0].settings.key_config()
    keys: list[RoutingKey] = [
        extract_key(CHAT, _body(i, model=f"m{i % 3}"), f"t{i % 5}" if i % 2 else None, key_config)
        for i in range(20_000)
    ]
    for key in keys:
        picks = {
            app.picker.pick(key, app.backends.ring, app.backends.candidates, app.backends.load)
            for app in apps
        }
        disagreements += len(picks) != 1
    assert disagreements == 0
    # And the keys do spread: agreement on a ring that sends everything to one backend proves nothing.
    owners = {rings[0].primary(k.ring_hash) for k in keys[:2000]}
    assert owners == set(urls)


def test_pickers_agree_after_learning_their_own_placements() -> None:
    """Each prefix index learns only from its replica's placements; when the placements agree (the
    ring decided them), the indexes do too, so follow-up turns of a conversation also agree."""
    urls = [f"http://10.0.1.{i}:8000" for i in range(1, 5)]
    apps = [create_app(router_settings(order)) for order in _orders(urls)]
    key_config = apps[0].settings.key_config()
    system = "You are a careful assistant. " * 40  # longer than a few index blocks
    disagreements = 0
    for conv in range(500):
        messages: list[dict[str, str]] = [{"role": "system", "content": f"{conv} {system}"}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"turn {turn} of conversation {conv}"})
            key = extract_key(CHAT, orjson.dumps({"model": "m", "messages": messages}), None, key_config)
            picks = set()
            for app in apps:
                decision = app.picker.pick(key, app.backends.ring, app.backends.candidates, app.backends.load)
                assert decision is not None
                picks.add(decision.backend_id)
                app.picker.placed(key, decision.backend_id)
            disagreements += len(picks) != 1
            messages.append({"role": "assistant", "content": f"answer {turn} " * 30})
    assert disagreements == 0


def test_stateless_replicas_spread_conversations_behind_one_system_prompt_and_agree_on_each() -> None:
    """What the chart renders for replicas without shared state (`first_placement: ring`), on traffic
    where one 2,000-character system prompt, most of every first turn, starts every conversation. Each
    turn goes to one replica, round robin, and each replica learns only its own placements: every turn
    of a conversation still lands on one backend, and the conversations spread over the fleet rather
    than all following the system prompt to the backend that took it first. Each replica places its
    first few conversations by the system prompt alone, until it has seen enough of the traffic to
    know the prompt starts all of it (routing/preamble_heat.py): those may move once, at their second
    turn."""
    urls = [f"http://10.0.1.{i}:8000" for i in range(1, 5)]
    apps = [
        create_app(router_settings(order, routing={"first_placement": "ring"})) for order in _orders(urls)
    ]
    key_config = apps[0].settings.key_config()
    system = "You answer questions about our product. " * 50  # 2,000 characters, shared by all
    replica = itertools.cycle(apps)
    homes: dict[int, set[str]] = {}
    for turn in range(3):
        for conv in range(200):
            messages: list[dict[str, str]] = [{"role": "system", "content": system}]
            for t in range(turn + 1):
                messages.append({"role": "user", "content": f"question {t} of conversation {conv}"})
                if t < turn:
                    messages.append({"role": "assistant", "content": f"answer {t} of {conv} " * 20})
            key = extract_key(CHAT, orjson.dumps({"model": "m", "messages": messages}), None, key_config)
            app = next(replica)
            key = app.placer.settle_key(key)  # as the relay does, once a request
            decision = app.picker.pick(key, app.backends.ring, app.backends.candidates, app.backends.load)
            assert decision is not None
            app.picker.placed(key, decision.backend_id)
            homes.setdefault(conv, set()).add(decision.backend_id)
    moved = [conv for conv, backends in homes.items() if len(backends) != 1]
    warm_up = int(HOT_MIN_REQUESTS + 1) * len(apps)  # each replica's first conversations
    assert all(conv < warm_up for conv in moved), f"conversations {moved} moved backend between turns"
    assert all(len(homes[conv]) <= 2 for conv in moved)
    per_backend = collections.Counter(next(iter(backends)) for backends in homes.values())
    assert set(per_backend) == set(urls)
    assert max(per_backend.values()) < 200 / len(urls) * 2, per_backend


async def test_three_routers_send_the_same_keys_to_the_same_backends(fake_backends: Any, router: Any) -> None:
    backends = await fake_backends(4)
    urls = [b.url for b in backends]
    # The bounded-load c and max_inflight are set out of reach, so no request can overflow: what is
    # compared is the ring's choice alone (and the overflow counters below prove the premise).
    balancing = {"load_factor": 100.0, "max_inflight": 1000}
    routers = [await router(router_settings(order, balancing=balancing)) for order in _orders(urls)]
    n_keys = 2000
    chosen: list[list[str | None]] = [[None] * n_keys for _ in routers]

    async def drive(index: int, lane: int, lanes: int, session: aiohttp.ClientSession) -> None:
        base = routers[index].url
        for i in range(lane, n_keys, lanes):
            async with session.post(
                base + CHAT, data=_body(i), headers={"content-type": "application/json"}
            ) as resp:
                assert resp.status == 200
                await resp.read()
                chosen[index][i] = resp.headers.get(BACKEND_HEADER)

    lanes = 4  # per replica
    connector = aiohttp.TCPConnector(limit=lanes * len(routers))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as s:
        await asyncio.gather(*(drive(i, n, lanes, s) for i in range(len(routers)) for n in range(lanes)))

    for r in routers:
        assert _decisions(r.app, Branch.OVERFLOW) == 0
        assert _decisions(r.app, Branch.FALLBACK) == 0
    assert all(name in urls for column in chosen for name in column)
    agree = sum(1 for i in range(n_keys) if len({col[i] for col in chosen}) == 1)
    assert agree / n_keys >= 0.999, f"only {agree} of {n_keys} keys went to the same backend everywhere"
    # Pairwise as well, so a failure names which replicas drifted apart.
    for (a, ca), (b, cb) in itertools.combinations(enumerate(chosen), 2):
        same = sum(x == y for x, y in zip(ca, cb, strict=True))
        assert same / n_keys >= 0.999, f"replicas {a} and {b} agree on {same} of {n_keys}"
    # Every backend took a share: the agreement is over a spread, not one busy backend.
    per_backend = {u: chosen[0].count(u) for u in urls}
    assert min(per_backend.values()) > n_keys / len(urls) / 3, per_backend


async def test_two_stateless_routers_keep_each_system_prompts_questions_on_one_backend(
    fake_backends: Any, router: Any
) -> None:
    """Two real routers as the chart runs them without shared state, each request to the next router:
    one-shot questions behind a 2,000-character system prompt of their own (one per app) land on one
    backend for each prompt, whichever router took them. The ring used to be keyed on the question too,
    which sent them to a backend by chance."""
    backends = await fake_backends(4)
    urls = [b.url for b in backends]
    routers = [
        await router(router_settings(order, routing={"first_placement": "ring"}))
        for order in _orders(urls)[:2]
    ]
    apps, questions = 9, 12
    homes: dict[int, set[str]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        n = 0
        for q in range(questions):
            for app_id in range(apps):
                system = (f"App {app_id}. " + "You answer questions about our product. " * 60)[:2000]
                body = {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Question {q} for app {app_id}?"},
                    ],
                }
                async with session.post(routers[n % 2].url + CHAT, data=orjson.dumps(body)) as resp:
                    assert resp.status == 200
                    await resp.read()
                    homes.setdefault(app_id, set()).add(resp.headers[BACKEND_HEADER])
                n += 1
    split = {app_id: sorted(b) for app_id, b in homes.items() if len(b) != 1}
    assert not split, f"apps whose questions went to more than one backend: {split}"
    assert len({next(iter(b)) for b in homes.values()}) >= 2  # and the apps spread
