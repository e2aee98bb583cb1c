"""The share of recent traffic each preamble carries (routing/preamble_heat.py), and how stateless
replicas place by it (Picker.settle_key): a system prompt a few requests share is placed alone,
one that starts much of the traffic keeps the first message in its ring key."""

from __future__ import annotations

import itertools
import random

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_router.routing.config import BalanceConfig, FirstPlacement, KeyConfig
from prefix_router.routing.keys import MIN_COLD_PREAMBLE_CHARS, RoutingKey, extract_key
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.picker import Candidates, Picker
from prefix_router.routing.preamble_heat import HALF_LIFE_REQUESTS, HOT_MIN_REQUESTS, PreambleHeat, hot_share
from prefix_router.routing.ring import HashRing, Member

CHAT = "/v1/chat/completions"
# What settings.py builds for `first_placement: ring` with the default follow_threshold.
RING_KEYS = KeyConfig(preamble_share=None, cold_preamble_share=0.5)
URLS = [f"http://10.0.2.{i}:8000" for i in range(1, 5)]
SYSTEM_MARK = "\x1esystem\x1f"


def _chat(system: str | None, question: str, tenant: str | None = None) -> RoutingKey:
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": question})
    body = orjson.dumps({"model": "m", "messages": messages})
    return extract_key(CHAT, body, tenant, RING_KEYS)


def test_a_fresh_preamble_is_cold_and_one_carrying_all_traffic_turns_hot_at_the_minimum() -> None:
    heat = PreambleHeat()
    assert not heat.is_hot(7, 4)
    for n in range(1, 10):
        heat.observe(7)
        assert heat.is_hot(7, 4) == (n >= 3), n  # the third in a row (decayed: 2.97)


def test_one_of_32_interleaved_preambles_never_turns_hot_after_the_first_half_lives() -> None:
    heat = PreambleHeat()
    rng = random.Random(3)
    for i in range(5000):
        heat.observe(rng.randrange(1, 33))
        if i >= 2 * HALF_LIFE_REQUESTS:  # before, a few draws of one can look like a large share
            assert not any(heat.is_hot(p, 4) for p in range(1, 33)), i


def test_a_preamble_taking_half_the_traffic_turns_hot_within_a_few_dozen_requests_and_cools_after() -> None:
    heat = PreambleHeat()
    rng = random.Random(5)
    for _ in range(500):  # a mix of 32 cold preambles
        heat.observe(rng.randrange(1, 33))
    turned = None
    for i in range(400):
        heat.observe(999 if i % 2 == 0 else rng.randrange(1, 33))
        if turned is None and heat.is_hot(999, 4):
            turned = i // 2 + 1
        if turned is not None:
            assert heat.is_hot(999, 4), "a preamble that keeps half the traffic stays hot"
    assert turned is not None and turned <= 40, turned
    for _ in range(600):  # the traffic moves away from it: about ten half-lives
        heat.observe(rng.randrange(1, 33))
    assert not heat.is_hot(999, 4)


def test_requests_without_a_preamble_count_in_the_total() -> None:
    heat = PreambleHeat()
    for i in range(400):
        heat.observe(5 if i % 16 == 0 else 0)  # the only preamble, on 1/16 of the traffic
    assert heat.count(5) >= HOT_MIN_REQUESTS
    assert hot_share(4) > 1 / 16
    assert not heat.is_hot(5, 4)


@pytest.mark.parametrize(
    ("share", "backends", "hot"),
    [
        pytest.param(1 / 16, 4, False, id="1/16-of-4-backends"),
        pytest.param(1 / 4, 4, True, id="1/4-of-4-backends"),
        pytest.param(1 / 8, 2, False, id="1/8-of-2-backends"),
        pytest.param(1 / 2, 2, True, id="1/2-of-2-backends"),
    ],
)
def test_hot_is_half_of_one_backends_fair_share(share: float, backends: int, hot: bool) -> None:
    heat = PreambleHeat()
    period = round(1 / share)
    for i in range(2000):
        heat.observe(5 if i % period == period - 1 else 0)
    assert heat.is_hot(5, backends) == hot


def test_the_table_is_bounded_and_drops_the_least_recently_seen() -> None:
    heat = PreambleHeat(entries=100)
    for p in range(1, 1001):
        heat.observe(p)
    assert len(heat) == 100
    assert heat.count(1) == 0.0 and heat.count(1000) > 0.0


@given(st.lists(st.integers(0, 20), max_size=300))
def test_counts_never_exceed_the_total_and_add_up_to_it_when_every_request_has_a_preamble(
    preambles: list[int],
) -> None:
    heat = PreambleHeat(half_life=16)
    for p in preambles:
        heat.observe(p)
    counts = sum(heat.count(p) for p in range(1, 21))
    assert counts <= heat.total() + 1e-9
    if 0 not in preambles:
        assert counts == pytest.approx(heat.total())


# Keys: the preamble's own ring position, only where it may be placed alone.

SYSTEM_2000 = "You answer questions about our product. " * 50


def test_a_long_system_prompt_gives_every_question_behind_it_one_preamble_position() -> None:
    keys = [_chat(SYSTEM_2000, f"question {i}?") for i in range(20)]
    assert len({k.preamble_ring_hash for k in keys}) == 1
    assert keys[0].preamble_ring_hash != 0
    assert len({k.ring_hash for k in keys}) == 20  # the ring key itself still takes the question
    assert keys[0].preamble_bytes == len(SYSTEM_MARK + SYSTEM_2000)
    assert keys[0].preamble_ring_hash not in {k.ring_hash for k in keys}


@pytest.mark.parametrize(
    ("system", "question"),
    [
        pytest.param(None, "a question", id="no-preamble"),
        pytest.param("s" * (MIN_COLD_PREAMBLE_CHARS - 20), "q", id="preamble-too-short"),
        pytest.param(SYSTEM_2000, "q" * 3000, id="preamble-under-half-the-first-exchange"),
    ],
)
def test_no_preamble_position_where_the_preamble_may_not_be_placed_alone(
    system: str | None, question: str
) -> None:
    key = _chat(system, question)
    assert key.preamble_ring_hash == 0 and key.preamble_bytes == 0


CACHE_ROOM_KEYS = KeyConfig(preamble_share=0.5, cold_preamble_share=0.5)  # as settings build them


@pytest.mark.parametrize(
    ("system", "config"),
    [
        pytest.param("s" * 5000, RING_KEYS, id="ring-preamble-past-prefix-chars"),
        pytest.param(SYSTEM_2000, CACHE_ROOM_KEYS, id="cache-room-ring-key-is-the-preamble"),
    ],
)
def test_a_preamble_that_is_the_whole_ring_key_has_the_ring_keys_position(
    system: str, config: KeyConfig
) -> None:
    """The ring key is the preamble already (or its first prefix_chars): the preamble's position is
    the ring key's, so every question behind it is counted as one preamble."""
    keys = []
    for i in range(3):
        body = orjson.dumps(
            {
                "model": "m",
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
            }
        )
        keys.append(extract_key(CHAT, body, None, config))
    assert len({(k.ring_hash, k.preamble_ring_hash) for k in keys}) == 1
    assert keys[0].preamble_ring_hash == keys[0].ring_hash != 0
    assert keys[0].preamble_bytes == min(4096, len(SYSTEM_MARK + system))
    # Settled while cold, placed by the ring, it is the key it was (a ring key cut at prefix_chars
    # keeps saying so: its ring_bytes stay 0).
    ring_placed = Picker(BalanceConfig(first_placement=FirstPlacement.RING))
    assert ring_placed.settle_key(keys[0], 4) == keys[0]
    assert ring_placed.settle_key(keys[1], 4).ring_bytes == keys[1].ring_bytes


def test_the_preamble_position_is_seeded_by_tenant_and_absent_with_cache_room_keys() -> None:
    assert (
        _chat(SYSTEM_2000, "q", "t1").preamble_ring_hash != _chat(SYSTEM_2000, "q", "t2").preamble_ring_hash
    )
    body = orjson.dumps({"model": "m", "messages": [{"role": "system", "content": SYSTEM_2000}]})
    assert extract_key(CHAT, body, None, KeyConfig()).preamble_ring_hash == 0


# The picker: first placements by cache room.


def _settled(picker: Picker, system: str, question: str) -> RoutingKey:
    """A first turn's key as settings build it for cache-room placement, settled over 2 backends."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body = orjson.dumps({"model": "m", "messages": messages})
    return picker.settle_key(extract_key(CHAT, body, None, CACHE_ROOM_KEYS), 2)


def test_by_cache_room_a_preamble_under_one_backends_share_of_the_traffic_is_minor() -> None:
    """Three products' system prompts over 2 backends: each carries a third of the traffic, under a
    backend's half, so it is cached on few backends and its conversations stay where it is; one
    system prompt all traffic shares is cached everywhere."""
    products = [f"You are the assistant of product {p}. " * 40 for p in range(3)]
    picker = Picker(BalanceConfig())
    keys = [_settled(picker, products[i % 3], f"q{i}") for i in range(60)]
    assert all(k.minor_preamble for k in keys[6:])
    assert all(k.ring_hash == k.preamble_ring_hash for k in keys), "the ring key stays as it was"
    picker = Picker(BalanceConfig())
    assert not any(_settled(picker, products[0], f"q{i}").minor_preamble for i in range(20))


# The picker: stateless replicas placing by the ring.


def _pickers(n: int) -> list[Picker]:
    config = BalanceConfig(first_placement=FirstPlacement.RING)
    return [Picker(config) for _ in range(n)]


def _place(picker: Picker, key: RoutingKey, ring: HashRing, load: LoadTracker) -> str:
    settled = picker.settle_key(key, len(URLS))
    decision = picker.pick(settled, ring, Candidates.of(URLS), load)
    assert decision is not None
    picker.placed(settled, decision.backend_id)
    return decision.backend_id


@pytest.mark.parametrize("system_chars", [600, 2000], ids=["600-chars", "2000-chars"])
def test_stateless_replicas_keep_each_system_prompts_questions_on_one_backend(system_chars: int) -> None:
    """Two replicas, each request to either, 17 groups of 30 one-shot questions behind each group's own
    system prompt: every group lands on one backend (before, the question spread them by chance), and
    the groups spread over the fleet."""
    ring, load = HashRing([Member(u) for u in URLS], 160), LoadTracker()
    pickers, rng = _pickers(2), random.Random(9)
    homes: dict[int, set[str]] = {}
    for i in range(30):
        for group in range(17):
            system = (f"group {group}: " + "Answer in the house style. " * 100)[:system_chars]
            homes.setdefault(group, set()).add(
                _place(rng.choice(pickers), _chat(system, f"q{i} {group}?"), ring, load)
            )
    assert all(len(backends) == 1 for backends in homes.values()), homes
    assert len({next(iter(b)) for b in homes.values()}) >= 3


def test_stateless_replicas_still_spread_conversations_behind_a_system_prompt_all_traffic_shares() -> None:
    ring, load = HashRing([Member(u) for u in URLS], 160), LoadTracker()
    pickers = _pickers(3)
    replicas = itertools.cycle(pickers)
    firsts = [_place(next(replicas), _chat(SYSTEM_2000, f"conversation {c}"), ring, load) for c in range(300)]
    # Each replica's first few (under HOT_MIN_REQUESTS) went by the preamble; then by the first message.
    warm = int(HOT_MIN_REQUESTS) * len(pickers)
    later = firsts[warm:]
    assert set(later) == set(URLS)
    assert max(later.count(u) for u in URLS) < len(later) / len(URLS) * 1.6
